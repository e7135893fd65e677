"""``sweeping``: ``Inbox.sweep`` every few seconds while a FastStream (or FastAPI) app runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError
from ..inbox import Inbox
from ._threads import in_daemon_thread

log = safe_logger("outbox.inbox")


def sweeping(inbox: Inbox, *, every: float = 2.0) -> AbstractAsyncContextManager[None]:
    """Sweep ``inbox`` every ``every`` seconds inside the ``async with``; for an app's lifespan.

    Without it a held message whose predecessor never comes waits forever
    instead of parking its key after ``gap_timeout``: ``Inbox.handle`` only
    settles the record it is given. The sweep runs on a worker thread (it
    touches the database) and never overlaps itself; an error other than an
    outage (which ``sweep`` waits out) is logged and the next turn tries again.
    """
    if isinstance(every, bool) or not isinstance(every, int | float) or every <= 0:
        raise ConfigurationError(f"every must be positive seconds, got {every!r}")
    return _sweeping(inbox, float(every))


@contextlib.asynccontextmanager
async def _sweeping(inbox: Inbox, every: float) -> AsyncIterator[None]:
    async def sweep_forever() -> None:
        while True:
            try:
                await in_daemon_thread(inbox.sweep)  # never joined at exit (see _threads)
            except Exception:
                log.exception("inbox sweep of group %r failed; trying again in %gs", inbox.group, every)
            await asyncio.sleep(every)

    task = asyncio.create_task(sweep_forever(), name=f"outbox-inbox-sweep-{inbox.group}")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
