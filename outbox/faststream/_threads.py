"""Blocking inbox calls from an event loop, on daemon threads: a stuck one never holds the exit.

``asyncio.to_thread`` runs on the loop's default executor, which ``asyncio.run``
joins when the app ends: a thread still in a query to a frozen database (or
waiting out an outage) would keep the process alive after SIGTERM, past any
grace period. A daemon thread per call costs a thread start (tens of
microseconds) against a database transaction (milliseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """``asyncio.to_thread`` on a daemon thread: awaited like it, but never joined at exit.

    The context variables go along (tracing spans), as with ``to_thread``.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile: nobody waits for it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(cast(T, result))

    def target() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = context.run(fn)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: the app stopped without it
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=target, name="outbox-faststream-call", daemon=True).start()
    return await future
