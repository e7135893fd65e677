"""The ``transactional`` decorator's wrapper: open a transaction unless the caller brings one."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ._errors import ConfigurationError


def wrap(
    fn: Callable[..., Any],
    is_async: bool,
    begin: Callable[[], AbstractContextManager[Session]],
    begin_async: Callable[[], AbstractAsyncContextManager[AsyncSession]],
) -> Callable[..., Any]:
    """``fn`` called with a session from ``begin``/``begin_async``, or the caller's ``session=``.

    The session goes first when ``fn``'s first parameter is ``session`` (the
    form type checkers understand), else as the keyword ``session=``.
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

    if inspect.iscoroutinefunction(fn):
        if not is_async:
            raise ConfigurationError(
                f"{fn.__qualname__} is async but this Outbox has a sync engine"
            )

        @functools.wraps(fn)
        async def run_async(*args: Any, session: AsyncSession | None = None, **kw: Any) -> Any:
            if session is not None:
                return await call(session, args, kw)
            async with begin_async() as new_session:
                return await call(new_session, args, kw)

        return run_async

    if is_async:
        raise ConfigurationError(f"{fn.__qualname__} is sync but this Outbox has an AsyncEngine")

    @functools.wraps(fn)
    def run(*args: Any, session: Session | None = None, **kw: Any) -> Any:
        if session is not None:
            return call(session, args, kw)
        with begin() as new_session:
            return call(new_session, args, kw)

    return run
