"""Outages: the database or the broker cannot serve us *now*. Not the message's fault.

An outage never counts as a handler attempt, never parks, never alerts and
never ends the consumer: the work waits with capped backoff and is tried again
as it is. ``is_outage`` draws the line; ``OutageLog`` says so once per change of
state (down, then back up) instead of once per failed transaction.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, PendingRollbackError

log = logging.getLogger("outbox.inbox")

# SQLSTATE classes that mean "try again later": 08 connection exception, 40 transaction
# rollback (serialization failure, deadlock), 53 insufficient resources (disk full, too many
# connections), 57 operator intervention (admin shutdown, the server is starting up),
# 55P03 lock not available, 58 system error (I/O).
_OUTAGE_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
_OUTAGE_SQLSTATES = ("55P03",)
# 57014 is a statement timeout or a cancel: a handler's query too slow for its limit is the
# message's problem (it would time out again), not the database's.
_NOT_OUTAGE_SQLSTATES = ("57014",)
# SQLite reports everything as OperationalError, "no such table" (a bug) included.
_SQLITE_OUTAGES = ("locked", "busy", "disk i/o", "unable to open", "disk is full", "readonly")

OUTAGE_BACKOFF_MAX = 5.0


class Outage(Exception):
    """Raised inside the inbox's transaction when the database failed under a handler."""


def is_outage(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) says the database is unavailable, not wrong.

    Lost or refused connections, deadlocks, serialization failures, lock
    timeouts, a full disk, a server shutting down: retried unchanged, they
    succeed once the database is back. Integrity, data and programming errors
    are not outages: retried unchanged they fail again, so they count.
    """
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, Outage):
            return True
        if isinstance(error, PendingRollbackError) and "invalid transaction" in str(error):
            return True  # the connection died under the transaction
        if isinstance(error, DBAPIError) and _dbapi_outage(error):
            return True
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
        seen += 1
    return False


def _dbapi_outage(error: DBAPIError) -> bool:
    if error.connection_invalidated or isinstance(error, InterfaceError):
        return True
    sqlstate = getattr(error.orig, "sqlstate", None)
    if sqlstate:
        if sqlstate in _NOT_OUTAGE_SQLSTATES:
            return False
        return sqlstate.startswith(_OUTAGE_SQLSTATE_CLASSES) or sqlstate in _OUTAGE_SQLSTATES
    if not isinstance(error, OperationalError):
        return False
    if type(error.orig).__module__.startswith("sqlite3"):
        text = str(error.orig).lower()
        return any(word in text for word in _SQLITE_OUTAGES)
    return True  # a driver error without a SQLSTATE: the connection failed


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
            delay = min(0.2 * 2 ** min(self._failures - 1, 5), OUTAGE_BACKOFF_MAX)
        return delay * random.uniform(0.75, 1.0)

    def answered(self) -> None:
        if self._since is None:  # the common case: no lock, no log
            return
        with self._lock:
            if self._since is not None:
                log.warning("%s available again after %.1fs", self.what, time.monotonic() - self._since)
            self._since = None
            self._failures = 0
