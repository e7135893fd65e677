"""Reaching the console's databases: off the event loop, within a deadline, and one answer when one cannot.

Every page and action reaches its database through ``Reader.run(work)``:
``work`` (sync SQLAlchemy code) runs on a thread of its own — a daemon, so a
thread stuck in a frozen database never delays the process's exit — and the
page waits at most ``timeout`` seconds for it. A database that is down,
refuses the password, lacks the tables (the driver's error or the library's
``SchemaError``) or does not answer in time raises ``Unreadable``: the
console's 503 page of its own, naming the database and the driver's first line
without the database's credentials (``_app``), or one line on a page that
shows several databases (the overview, the trace, the navigation's counts).
Never a 500, never a traceback, and the connection stays open for the next
request. A value the database answers it refuses (a ``DataError``: PostgreSQL
takes no NUL in a name a URL gave) is the request's fault, not an outage: a 400.

A frozen server (SIGSTOP, a hung host, a partition) answers no socket, and no
driver bounds a read on PostgreSQL; the thread in it stays until it answers.
So that such threads stay few: while a read of a database is past its
deadline, the next reads of it are answered at once ("still waiting for an
earlier read") instead of sending another thread after it; and at most
``MAX_CALLS`` calls run on one database at once. An action (``write=True``:
retry, skip, replay, discard) gets the same deadline, is not refused for a slow
read, and, when its deadline passes, goes on: its audit line says how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import DataError, SQLAlchemyError

from ..core._errors import SchemaError
from ..core._secrets import database_secrets, scrub
from ..ops import Database
from ._refused import Refused

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT = 10.0
"""Seconds a page waits for one database (``create_app(database_timeout=)``, ``--database-timeout``)."""
MAX_CALLS = 16
"""Calls running on one database at once; more are answered 503 at once (the threads stay bounded)."""
UNREADABLE = (SQLAlchemyError, SchemaError, OSError)
"""What a database that cannot be read raises: the driver's errors (wrapped by SQLAlchemy), the
library's ``SchemaError`` (tables missing or of another release), the socket's own."""


class Unreadable(Exception):
    """A database that could not serve a page or an action; the console answers 503 with ``str(self)``."""

    def __init__(self, database: str, reason: str, *, late: bool = False) -> None:
        super().__init__(f"{database}: could not be read ({reason})")
        self.database, self.reason = database, reason
        self.late = late
        """The deadline passed: the work may still be under way (and an action may still be done)."""


def reason_of(db: Database, exc: BaseException) -> str:
    """The driver's first line about ``exc``, without ``db``'s credentials."""
    first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]
    return scrub(first[:300], database_secrets(db.engine.url.render_as_string(hide_password=False)))


class Reader:
    """One database's calls for the pages and actions of one console; safe from any event loop."""

    def __init__(self, db: Database, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.db, self.timeout = db, timeout
        self._lock = threading.Lock()
        self._running = 0
        self._overdue = 0  # reads past their deadline whose thread has not come back

    @property
    def answering(self) -> bool:
        """False while a read of this database is past its deadline (it is frozen, or very slow)."""
        return self._overdue == 0

    async def run(self, work: Callable[[], T], *, write: bool = False) -> T:
        """``work()`` on a thread, its result within ``timeout``, or ``Unreadable``.

        Errors of ``UNREADABLE`` kinds become ``Unreadable``, but for a ``DataError``: the database
        answered and refused a value of the request (PostgreSQL a NUL in a name), a 400 ``Refused``.
        Any other error is ``work``'s own (a refusal, a bad id) and is raised as it is.
        """
        with self._lock:
            if not write and self._overdue:
                raise Unreadable(self.db.name, f"did not answer within {self.timeout:g} s; still waiting "
                                               f"for an earlier read")
            if self._running >= MAX_CALLS:
                raise Unreadable(self.db.name, f"{MAX_CALLS} calls to it are still waiting for it")
            self._running += 1
        call = _Call(work)
        call.start(self._finished)
        try:
            return await call.result(self.timeout)
        except TimeoutError:
            with self._lock:
                if not call.finished:
                    call.overdue = not write
                    self._overdue += call.overdue
            raise Unreadable(self.db.name, f"did not answer within {self.timeout:g} s", late=True) from None
        except DataError as exc:
            raise Refused(400, f"{self.db.name} refused a value of this request "
                               f"({reason_of(self.db, exc)})") from None
        except UNREADABLE as exc:
            raise Unreadable(self.db.name, reason_of(self.db, exc)) from None

    def _finished(self, call: _Call[Any]) -> None:
        with self._lock:
            call.finished = True
            self._running -= 1
            self._overdue -= call.overdue


async def within(timeout: float, what: str, work: Callable[[], T]) -> T:
    """``work()`` on a thread, within ``timeout``; for work over several databases at once (the
    trace), whose readers each answered just before. ``what`` names them in ``Unreadable``."""
    call = _Call(work)
    call.start(lambda _: None)
    try:
        return await call.result(timeout)
    except TimeoutError:
        raise Unreadable(what, f"did not answer within {timeout:g} s", late=True) from None


class _Call(Generic[R]):
    """``work`` on a daemon thread, its outcome handed to the event loop that waits for it."""

    def __init__(self, work: Callable[[], R]) -> None:
        self.work = work
        self.finished = False
        self.overdue = False
        self._loop = asyncio.get_running_loop()
        self._outcome: asyncio.Future[R] = self._loop.create_future()

    def start(self, finished: Callable[[_Call[R]], None]) -> None:
        def call() -> None:
            try:
                value = self.work()
            except BaseException as exc:
                error = exc
                finished(self)
                self._hand(lambda: self._fail(error))
            else:
                finished(self)
                self._hand(lambda: self._succeed(value))

        threading.Thread(target=call, name="outbox-console-db", daemon=True).start()

    # On the event loop. Done already when its waiter was cancelled (the client left).
    def _succeed(self, value: R) -> None:
        if not self._outcome.done():
            self._outcome.set_result(value)

    def _fail(self, error: BaseException) -> None:
        if not self._outcome.done():
            self._outcome.set_exception(error)

    def _hand(self, settle: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (its request gave up long ago)
            self._loop.call_soon_threadsafe(settle)

    async def result(self, timeout: float) -> R:
        try:
            return await asyncio.wait_for(asyncio.shield(self._outcome), timeout)
        except (TimeoutError, asyncio.CancelledError):
            # Nobody waits any more: its error, when it comes, is not asyncio's to report.
            self._outcome.add_done_callback(lambda outcome: outcome.cancelled() or outcome.exception())
            raise
