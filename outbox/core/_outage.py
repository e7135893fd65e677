"""Outages: a database or a broker cannot serve us *now*; not the work's fault (DESIGN §9).

One module for every worker, relay and inbox alike:

- ``is_database_outage`` draws the line. Anything else a statement raises (an
  integrity, data or programming error, a statement timeout) would fail again
  unchanged, so it is the work's own failure. The inbox adds its own rule on
  top (``Outage``, ``is_outage``, ``is_handler_outage``: a handler's own I/O
  failing is the handler's failure).
- ``is_missing_schema`` marks one kind of those: a statement naming a table,
  column or schema that is not there. Neither an outage (it does not go away
  by itself) nor, when the statement is the worker's own, the work's failure:
  the tables were not made (or not upgraded) where the worker looks, which
  the operator fixes.
- ``OutageBackoff`` paces the retries: capped exponential, tenacity's
  ``wait_exponential``, optionally jittered so that workers do not all knock at
  once.
- ``OutageTracker`` says so once per change of state (down, then back up, with how
  long it was gone) and counts it, instead of a line per failed attempt.
- ``OutageGate`` keeps callers off a dependency that is down: one of them at a
  time probes it once its backoff has passed, the others put their work off
  (the inbox's tenants, the fleet's databases, a retention thread).

An outage never counts as an attempt, never parks, never alerts and never ends
a worker; the waits are ``Event`` waits, so a stop (SIGTERM) ends them at once.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import tenacity
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, PendingRollbackError

from ._errors import ConfigurationError

MAX_OUTAGE_BACKOFF = 5.0
"""Seconds between attempts to reach a dependency that is down, at most."""

# SQLSTATE classes that mean "try again later": 08 connection exception, 40 transaction
# rollback (serialization failure, deadlock), 53 insufficient resources (disk full, too many
# connections), 57 operator intervention (admin shutdown, the server is starting up),
# 55P03 lock not available, 58 system error (I/O).
_OUTAGE_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
_OUTAGE_SQLSTATES = ("55P03",)
# 57014 is a statement timeout or a cancel: a handler's query too slow for its limit is the
# message's problem (it would time out again), not the database's.
_NOT_OUTAGE_SQLSTATES = ("57014",)
# A partitioned inbox's fence (housekeeping._inbox_partitions): a check constraint that keeps a
# coming day's ids out of the default partition while that day's partition is made. A record it
# refuses is refused for the database's state, not its own: once a retention pass takes the fence
# down (a killed pass can leave it up until the next one) the same record goes in.
_CHECK_VIOLATION = "23514"
_PARTITION_FENCE = re.compile(r"ck_\w*inbox_messages_not_p\d{8}")
# MySQL/MariaDB error numbers that mean "try again later". The drivers (PyMySQL, aiomysql,
# mysqlclient) raise OperationalError for most server errors, a misspelt column (1054)
# included, so the number decides, not the class. Client side: 2002/2003 cannot connect,
# 2006 server gone away, 2013/2055 connection lost mid-query. Server side: 1040/1203 too
# many connections, 1053 shutdown in progress, 1205 lock wait timeout, 1213 deadlock
# (both roll back our work: rerun the transaction), 1021/1114 disk or table full,
# 1037/1038/1041 out of memory or resources, 1152/1159/1160/1161 connection aborted or
# a network read/write failed, 1180 error during commit, 1927 connection killed (MariaDB),
# 4031 disconnected for inactivity (MySQL 8). Statement timeouts (MySQL 3024, MariaDB
# 1969) are not outages: like PostgreSQL's 57014, the work would time out again.
_MYSQL_OUTAGE_CODES = frozenset({
    2002, 2003, 2006, 2013, 2055, 1040, 1203, 1053, 1205, 1213, 1021, 1114, 1037, 1038, 1041,
    1152, 1159, 1160, 1161, 1180, 1927, 4031,
})
_MYSQL_DRIVERS = ("pymysql", "aiomysql", "MySQLdb", "asyncmy", "mysql", "mariadb")
# SQLite reports everything as OperationalError, "no such table" (a bug) included.
_SQLITE_OUTAGES = ("locked", "busy", "disk i/o", "unable to open", "disk is full", "readonly")


def is_database_outage(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) says the database is unavailable, not wrong.

    Lost or refused connections, deadlocks, serialization failures, lock
    timeouts, a full disk, a server shutting down: retried unchanged, they
    succeed once the database is back. Integrity, data and programming errors
    are not outages: retried unchanged they fail again, so they count.
    """
    seen = 0
    link: BaseException | None = error  # then what caused it, and so on down the chain
    while link is not None and seen < 8:
        if isinstance(link, PendingRollbackError) and "invalid transaction" in str(link):
            return True  # the connection died under the transaction
        if isinstance(link, DBAPIError) and _dbapi_outage(link):
            return True
        if not isinstance(link, DBAPIError) and _raw_mysql_outage(link):
            return True
        link = link.__cause__ or link.__context__
        seen += 1
    return False


def _dbapi_outage(error: DBAPIError) -> bool:
    if error.connection_invalidated or isinstance(error, InterfaceError):
        return True
    # First: PyMySQL gives its errors a SQLSTATE too, and a lock wait timeout's (HY000)
    # says nothing; the MySQL error number does.
    code = _mysql_error_code(error.orig)
    if code is not None:
        return code in _MYSQL_OUTAGE_CODES
    sqlstate = getattr(error.orig, "sqlstate", None)
    if sqlstate == _CHECK_VIOLATION and _PARTITION_FENCE.fullmatch(_constraint_name(error.orig)):
        return True
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


def _constraint_name(orig: BaseException | None) -> str:
    """The constraint a PostgreSQL error names: psycopg's ``diag``, or asyncpg's error behind
    SQLAlchemy's adapter."""
    for source in (getattr(orig, "diag", None), getattr(orig, "__cause__", None)):
        name = getattr(source, "constraint_name", None)
        if isinstance(name, str):
            return name
    return ""


def _raw_mysql_outage(error: BaseException) -> bool:
    """A MySQL driver's own error that SQLAlchemy let through unwrapped.

    A checked-out connection's isolation level (the relay's and inbox's READ
    COMMITTED, and back, ``outbox.core._engine._keep_levels``) is set outside
    SQLAlchemy's error wrapping, so a pooled connection the server dropped
    surfaces there as the driver's bare error.
    """
    code = _mysql_error_code(error)
    if code is None:
        return False
    return code in _MYSQL_OUTAGE_CODES or type(error).__name__ == "InterfaceError"


def _mysql_error_code(orig: BaseException | None) -> int | None:
    """The MySQL error number a MySQL driver's exception carries as its first argument."""
    if orig is None or type(orig).__module__.split(".")[0] not in _MYSQL_DRIVERS:
        return None
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


# A table, column or schema that is not there: PostgreSQL's undefined_table, undefined_column,
# invalid_schema_name; MySQL's 1146 no such table, 1054 unknown column, 1049 unknown database
# (a schema= on MySQL is a database); SQLite's words (its errors carry no code; a schema= there is an
# attached database).
_MISSING_SQLSTATES = ("42P01", "42703", "3F000")
_MYSQL_MISSING_CODES = frozenset({1146, 1054, 1049})
_SQLITE_MISSING = ("no such table", "no such column", "unknown database")


def is_missing_schema(error: BaseException) -> bool:
    """True when ``error``, a statement's, says a table, column or schema it names is not there.

    Only ``error`` itself is read, not what it was raised during: a statement
    of the inbox's that failed while a handler's error was being handled is
    judged by its own error. A COMMIT's error is never one (SQLAlchemy gives it
    no statement): a missing table fails the statement that names it, so one
    met at COMMIT is a deferred trigger's of a handler's write, that work's own.
    """
    if not isinstance(error, DBAPIError) or error.statement is None:
        return False
    orig = error.orig
    code = _mysql_error_code(orig)
    if code is not None:
        return code in _MYSQL_MISSING_CODES
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate:
        return sqlstate in _MISSING_SQLSTATES
    if type(orig).__module__.startswith("sqlite3"):
        text = str(orig).lower()
        return any(text.startswith(words) for words in _SQLITE_MISSING)
    return False


class Outage(Exception):
    """Raised inside the inbox's transaction when the database failed under a handler."""


def is_outage(error: BaseException) -> bool:
    """``Outage`` raised by the inbox's transaction step, or a database outage (``is_database_outage``).

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


# -- pacing -------------------------------------------------------------------

_RETRYING = tenacity.Retrying()
"""The controller a wait strategy's call state names; the strategies read only the attempt number."""


def delay_before(wait: tenacity.wait.wait_base, attempt: int) -> float:
    """The delay tenacity wait strategy ``wait`` gives after failed attempt number ``attempt`` (from 1).

    Wait strategies are called with tenacity's ``RetryCallState``; this is the
    one place that builds one, for the workers that count attempts themselves
    (a row's attempts live in its table, a handler's in its delivery).
    """
    state = tenacity.RetryCallState(_RETRYING, fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return float(wait(state))


@dataclass(frozen=True)
class OutageBackoff:
    """Delays while a dependency is down: ``first``, twice that, four times … up to ``cap`` seconds.

    ``jitter`` (0 to 1) cuts each delay by up to that fraction at random, so
    that workers that lost the database together do not all come back at once.
    """

    first: float = 0.2
    cap: float = MAX_OUTAGE_BACKOFF
    jitter: float = 0.0
    _wait: tenacity.wait_exponential = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("first", "cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigurationError(f"OutageBackoff.{name} must be positive seconds, got {value!r}")
        jitter = self.jitter
        if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not 0 <= jitter <= 1:
            raise ConfigurationError(f"OutageBackoff.jitter must be from 0 to 1, got {self.jitter!r}")
        object.__setattr__(self, "_wait", tenacity.wait_exponential(multiplier=self.first, max=self.cap))

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (1 for the first)."""
        delay = delay_before(self._wait, max(1, failures))
        return delay * random.uniform(1.0 - self.jitter, 1.0) if self.jitter else delay


# -- telling -----------------------------------------------------------------

@dataclass(frozen=True)
class OutageWording:
    """The two log lines of an outage: ``down % (what, detail)`` and ``up % (what, seconds)``."""

    down: str
    up: str


RELAY_WORDING = OutageWording(down="%s unreachable (%s); waiting with capped backoff",
                              up="%s reachable again after %.1f s")
INBOX_WORDING = OutageWording(
    down="%s unavailable (%s); waiting for it, nothing counts as a failed attempt meanwhile",
    up="%s available again after %.1fs")


def first_line(error: BaseException | str) -> str:
    """``error`` in one short line for a log: the exception's type and its message's first line."""
    if isinstance(error, str):
        text = error.strip().splitlines()[0] if error.strip() else error
        return text[:300]
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


class OutageTracker:
    """Whether one dependency answers; logs and counts when that changes, and paces the retries.

    ``failed`` records a failure and returns how long to wait before trying
    again (``backoff``, by consecutive failures); the first failure after an
    answer logs one WARNING and calls ``count``. ``answered`` logs once that the
    dependency is back. Safe to call from several threads: the first report of
    a change logs it, the others are silent.
    """

    def __init__(self, what: str, *, log: logging.Logger, wording: OutageWording = INBOX_WORDING,
                 backoff: OutageBackoff = OutageBackoff(), count: Callable[[], object] | None = None,
                 detail: Callable[[BaseException | str], str] = first_line) -> None:
        self.what = what
        self.backoff = backoff
        self._log, self._wording, self._count, self._detail = log, wording, count, detail
        self._lock = threading.Lock()
        self._failures = 0
        self._since: float | None = None

    @property
    def down(self) -> bool:
        """True from a failure until the next answer."""
        return self._since is not None

    def failed(self, error: BaseException | str) -> float:
        """Record that the dependency failed; the seconds to wait before trying again."""
        with self._lock:
            self._failures += 1
            failures = self._failures
            changed = self._since is None
            if changed:
                self._since = time.monotonic()
        if changed:
            self._log.warning(self._wording.down, self.what, self._detail(error))
            if self._count is not None:
                self._count()
        return self.backoff.delay(failures)

    def answered(self, started: float | None = None) -> None:
        """Record that the dependency worked; logs only the change from down to up.

        ``started`` (``time.monotonic()``): when the work that worked began. Work
        that began before the outage was told says nothing of now (a long
        transaction that committed just before the server went away): ignored.
        """
        if self._since is None:  # the common case: no lock, no log
            return
        with self._lock:
            if self._since is None or (started is not None and started < self._since):
                return
            since, self._since, self._failures = self._since, None, 0
        if since is not None:
            self._log.warning(self._wording.up, self.what, time.monotonic() - since)


@contextlib.contextmanager
def told_if_late(failed: Callable[[str], object], after: float, why: str, *,
                 unless: Callable[[], bool] | None = None) -> Iterator[None]:
    """While the block runs, ``failed(why)`` is called (an ``OutageTracker``'s or an
    ``OutageGate``'s) if the block is still running ``after`` seconds on, and ``unless()`` (the
    worker stopping or stopped, ``core._stopping.RunEnd.over``) is not true by then: a worker stopped
    while the call hangs has said its last line, and its watch must not tell (log, count) an outage
    seconds after.

    A server that answers nothing (a frozen host, a ``SIGSTOP``ped server, a partition that drops
    packets) fails no call: no driver bounds a read on PostgreSQL, and the host's kernel answers TCP
    keepalives for it. The call just waits, and no outage was ever told. The first work begun after
    the outage was told that the server answers ends it (``OutageTracker.answered(started)``).
    """
    def tell() -> None:
        if unless is None or not unless():
            failed(why)

    timer = threading.Timer(after, tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# -- gating ------------------------------------------------------------------

class OutageGate:
    """A dependency that may be down, probed by one caller at a time while it is.

    Open while the dependency answers. ``failed`` (an outage, told to the
    ``tracker``: logged once, paced by its backoff) or ``close`` (a delay of
    the caller's choosing: tables found missing) closes it until a retry time.
    While it is closed, ``admit`` lets one caller through as the *probe* once
    that time has come and tells every other how long to put its work off (at
    least ``least`` seconds), instead of letting it wait on a database that
    may hang. ``answered`` opens it again. A probe that ends without a verdict
    calls ``probed`` so that the next caller may probe. Safe to call from
    several threads.
    """

    def __init__(self, tracker: OutageTracker | None = None, *, closed: bool = False,
                 least: float = 0.2) -> None:
        self.tracker = tracker
        self._least = least
        self._lock = threading.Lock()
        self._closed = closed
        self._closed_at = 0.0
        self._retry_at = 0.0
        self._probe: int | None = None
        """The thread probing now, if any."""

    @property
    def down(self) -> bool:
        """Closed: from a failure (or ``close``) until an answer."""
        return self._closed

    def admit(self) -> float | None:
        """None: go ahead (as the probe, when closed); else the seconds to put the work off."""
        if not self._closed:  # the common case: no lock
            return None
        with self._lock:
            if not self._closed:
                return None
            now = time.monotonic()
            if self._probe is not None or now < self._retry_at:
                return max(self._least, self._retry_at - now)
            self._probe = threading.get_ident()
            return None

    def failed(self, error: BaseException | str) -> float:
        """An outage: told to the tracker; closed for its backoff. The seconds until the next probe."""
        if self.tracker is None:
            raise ConfigurationError("OutageGate.failed needs a tracker: use close(delay)")
        return self.close(self.tracker.failed(error))

    def close(self, delay: float) -> float:
        """Closed for ``delay`` seconds at least (or longer, as an earlier close asked); the seconds left."""
        with self._lock:
            now = time.monotonic()
            self._closed, self._probe, self._closed_at = True, None, now
            self._retry_at = max(self._retry_at, now + delay)
            return max(0.0, self._retry_at - now)

    def answered(self, started: float | None = None) -> bool:
        """The dependency answered: open. True when this opened it (who put work off may resume now).

        ``started``: as ``OutageTracker.answered``'s; work that began before the
        gate was last closed opens nothing and tells the tracker nothing (a failure
        since closed it again: the dependency was still down after that work began).
        """
        if self._closed and started is not None and started < self._closed_at:
            return False
        if self.tracker is not None:
            self.tracker.answered(started)
        if not self._closed:
            return False
        with self._lock:
            if started is not None and started < self._closed_at:
                return False
            opened, self._closed, self._probe, self._retry_at = self._closed, False, None, 0.0
            return opened

    def probed(self) -> None:
        """The calling thread's probe ended without a verdict: the next caller may probe. Else nothing."""
        if self._probe is None:
            return
        with self._lock:
            if self._probe == threading.get_ident():
                self._probe = None
