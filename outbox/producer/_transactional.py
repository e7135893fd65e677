"""The ``transactional`` decorator's wrappers: open a transaction unless the caller brings one.

One wrapper per flavour, chosen by the outbox (``Outbox`` sync, ``AsyncOutbox``
async); both hand the session the same way and refuse a function of the other
kind when it is decorated, not when it is first called.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..core._errors import ConfigurationError

_Call = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def _session_call(fn: Callable[..., Any]) -> _Call:
    """How to hand ``fn`` its session: first when its first parameter is ``session``, else as ``session=``.

    The first form is the one type checkers understand.
    """
    params = list(inspect.signature(fn).parameters.values())
    if "session" not in {p.name for p in params}:
        raise ConfigurationError(
            f"{fn.__qualname__} must take the session first or as a 'session' keyword "
            "argument to be transactional"
        )
    positional = params[0].name == "session" and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def call(session: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        return fn(session, *args, **kw) if positional else fn(*args, session=session, **kw)

    return call


def wrap_sync(fn: Callable[..., Any], begin: Callable[[], AbstractContextManager[Session]],
              outbox: str) -> Callable[..., Any]:
    """``fn`` called with a session from ``begin``, or the caller's ``session=``; ``outbox`` says whose."""
    call = _session_call(fn)
    if inspect.iscoroutinefunction(fn):
        raise ConfigurationError(f"{fn.__qualname__} is async but {outbox}")

    @functools.wraps(fn)
    def run(*args: Any, session: Session | None = None, **kw: Any) -> Any:
        if session is not None:
            return call(session, args, kw)
        with begin() as new_session:
            return call(new_session, args, kw)

    return run


def wrap_async(fn: Callable[..., Any], begin: Callable[[], AbstractAsyncContextManager[AsyncSession]],
               outbox: str) -> Callable[..., Any]:
    """``wrap_sync`` for an ``async def`` ``fn`` and an async ``begin``."""
    call = _session_call(fn)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigurationError(f"{fn.__qualname__} is sync but {outbox}")

    @functools.wraps(fn)
    async def run_async(*args: Any, session: AsyncSession | None = None, **kw: Any) -> Any:
        if session is not None:
            return await call(session, args, kw)
        async with begin() as new_session:
            return await call(new_session, args, kw)

    return run_async
