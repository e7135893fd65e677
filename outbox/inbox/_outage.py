"""Outages: the database or the broker cannot serve us *now*. Not the message's fault.

An outage never counts as a handler attempt, never parks, never alerts and
never ends the consumer: the work waits with capped backoff and is tried again
as it is. ``is_outage`` draws the line; ``OutageLog`` says so once per change of
state (down, then back up) instead of once per failed transaction.
"""

from __future__ import annotations

import random
import threading
import time

from transports._logsafe import safe_logger

from .._outage import is_database_outage

log = safe_logger("outbox.inbox")

OUTAGE_BACKOFF_MAX = 5.0


class Outage(Exception):
    """Raised inside the inbox's transaction when the database failed under a handler."""


def is_outage(error: BaseException) -> bool:
    """``Outage`` raised by the transaction step, or a database outage (``is_database_outage``).

    Outside a handler, an ``OSError`` is one too: the asyncio drivers (asyncpg)
    raise the socket's own error (``ConnectionRefusedError``, a DNS failure, a
    missing Unix socket) when they cannot connect, where a sync driver raises
    its ``OperationalError``, and the inbox's own code does no other I/O.
    What a handler raises is judged by ``is_handler_outage`` instead.
    """
    return is_handler_outage(error) or isinstance(error, OSError)


def is_handler_outage(error: BaseException) -> bool:
    """An error raised under a handler that is the database's, not the handler's.

    Not a bare ``OSError``: that is the handler's own I/O failing (an HTTP call
    refused), which counts as an attempt like any other failure.
    """
    return isinstance(error, Outage) or is_database_outage(error)


class OutageLog:
    """Tracks whether the database answers; logs when that changes, and paces the retries.

    ``failed`` returns how long to wait before trying again: exponential from
    0.2 s, capped at ``OUTAGE_BACKOFF_MAX``, with jitter so that workers do not
    all knock at once. Safe to call from several threads.
    """

    def __init__(self, what: str = "the database") -> None:
        self.what = what
        self._lock = threading.Lock()
        self._failures = 0
        self._since: float | None = None

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: BaseException) -> float:
        with self._lock:
            self._failures += 1
            if self._since is None:
                self._since = time.monotonic()
                log.warning("%s unavailable (%s: %s); waiting for it, nothing counts as a failed "
                            "attempt meanwhile", self.what, type(error).__name__,
                            str(error).splitlines()[0] if str(error) else "")
            delay = min(0.2 * 2.0 ** min(self._failures - 1, 5), OUTAGE_BACKOFF_MAX)
        return delay * random.uniform(0.75, 1.0)

    def answered(self) -> None:
        if self._since is None:  # the common case: no lock, no log
            return
        with self._lock:
            if self._since is not None:
                log.warning("%s available again after %.1fs", self.what, time.monotonic() - self._since)
            self._since = None
            self._failures = 0
