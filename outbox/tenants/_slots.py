"""What one database server may hold of a fleet's threads: a server that hangs keeps the rest free.

A server that hangs (a frozen host, a partition that drops packets) answers
nothing and fails nothing: a fetch or a write on a connection it holds waits as
long as the driver does, and its gate (``_databases``) never closes. The
fleet's workers and writers are shared by every database's tenants, so
without a bound its tenants' steps took every worker, or their pipelined
writes every writer (a tenant has two in flight; the next batch of a tenant
elsewhere then waits for a write that never runs), and nobody was published.

``ServerSlots`` bounds both with ``core._slots.Slots``, keyed by the server
(``FleetDatabase.server``: what it says it is, not its URL's spelling; the
schemas and databases of one server hang together):

- a tenant's **step** takes a slot of its server before it runs; a worker
  that gets none puts the tenant's turn off (its rows wait in its tables) and
  serves another tenant. The tenant is woken when a step of that server gives
  its slot back (a timer, ``SLOT_RETRY``, is the fallback);
- a pipelined **write** takes a writers' slot of its server when it is
  handed to the writers, and gives it back when it has run. A write that gets
  none runs on the worker itself, inside its step's slot: the worker waits for
  it as a step without pipelining does. One pool of writers, counted, rather
  than a pool per database: as many threads whatever the number of databases
  (one per tenant is common), and a write of any database runs on any free one.

With one server nothing is kept free from it: its tenants may take every
worker and writer. With several each takes at most half (at least one), so a
hung one holds at most half the workers and half the writers; two hanging at
once may hold them all.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..core._slots import Slots
from ..relay._writer import Writer
from ._schedule import Schedule
from ._units import FleetDatabase, Unit

T = TypeVar("T")

SLOT_RETRY = 1.0
"""Seconds after which a tenant put off for want of a slot is tried again, if no slot was given back
meanwhile (one given back wakes it at once)."""


def server_of(db: FleetDatabase) -> Hashable:
    """What ``db``'s slots are counted by: its server, or ``db`` itself until the server is known."""
    return db.server if db.server is not None else db


class ServerSlots:
    """The fleet's slots per server, for its workers' steps and its writers' writes. Thread-safe."""

    def __init__(self, workers: int, schedule: Schedule) -> None:
        self.steps = Slots(workers)
        self.writes = Slots(workers)
        self._schedule = schedule
        self._lock = threading.Lock()
        self._waiting: dict[Hashable, dict[Unit, None]] = {}
        """The tenants put off for want of a slot, by server, oldest first: woken one per slot given back.
        One served since, or removed, waits no more (a wake-up spent on it would be lost)."""

    def span(self, servers: int) -> None:
        """The fleet's tenants are on ``servers`` servers (``Slots.span``)."""
        self.steps.span(servers)
        self.writes.span(servers)

    def take(self, unit: Unit) -> bool:
        """A step slot of ``unit``'s server, or False: then it is woken when one is given back."""
        server = server_of(unit.db)
        with self._lock:
            waiting = self._waiting.setdefault(server, {})
            if self.steps.take(server):
                # It waits no more (woken by its timer or a notification): a slot given back
                # wakes one still waiting, not this one.
                waiting.pop(unit, None)
                if not waiting:
                    del self._waiting[server]
                return True
            waiting[unit] = None
            return False

    def give_back(self, unit: Unit) -> None:
        """``unit``'s step slot back; the tenant that waits longest for one on its server is woken."""
        server = server_of(unit.db)
        with self._lock:
            self.steps.give_back(server)
            woken, waiting = None, self._waiting.get(server)
            while waiting and woken is None:
                woken = next(iter(waiting))
                del waiting[woken]
                if woken.removed:  # waking it would wake nobody
                    woken = None
            if waiting is not None and not waiting:
                del self._waiting[server]
        if woken is not None:
            self._schedule.wake(woken)

    def writer(self, db: FleetDatabase, writers: Writer, failed: Callable[[], None], every: float) -> Writer:
        """Where a tenant of ``db`` writes its pipelined batches: ``writers``, in a slot of its server;
        ``failed`` is called when a write raised, once in ``every`` seconds at most (its tenant then
        steps again, ``_SlottedWriter``)."""
        return _SlottedWriter(self.writes, db, writers, failed, every)


class _SlottedWriter:
    """A tenant's pipelined writes: on the shared writers in a slot of its server, else on the worker.

    A write that raised (an outage is no raise: ``BatchRunner._write_behind``) left its rows
    pending, and only the tenant's next step reports it and fetches them again; while
    notifications wake it, that step may be a minute away (``_idle_polls``), so the
    failure calls ``failed``, which wakes the tenant; once in ``every`` seconds at most, a
    failure sooner than that calling it when they have passed: a write that fails every time
    (a grant revoked, a trigger) would otherwise send its rows again and again, as fast as the
    broker answers. So its rows go again every ``every`` seconds, as a poll would send them.
    """

    def __init__(self, slots: Slots, db: FleetDatabase, writers: Writer, failed: Callable[[], None],
                 every: float) -> None:
        self._slots, self._db, self._writers, self._failed = slots, db, writers, failed
        self._every = every
        self._lock = threading.Lock()
        self._told_at = -math.inf
        self._later = False  # a call is waiting for its turn

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future = self._submitted(call)
        future.add_done_callback(self._told)
        return future

    def _told(self, future: Future[Any]) -> None:
        if future.cancelled() or future.exception() is None:
            return
        with self._lock:
            if self._later:
                return
            wait = self._told_at + self._every - time.monotonic()
            if wait > 0:
                self._later = True
                timer = threading.Timer(wait, self._tell_later)
                timer.daemon = True  # a stopped fleet's wake is moot
                timer.start()
                return
            self._told_at = time.monotonic()
        self._failed()

    def _tell_later(self) -> None:
        with self._lock:
            self._later = False
            self._told_at = time.monotonic()
        self._failed()

    def _submitted(self, call: Callable[[], T]) -> Future[T]:
        server = server_of(self._db)
        if not self._slots.take(server):
            # The worker writes it, in its step's slot: the server's writes hold no more writers.
            done: Future[T] = Future()
            done.set_running_or_notify_cancel()
            try:
                done.set_result(call())
            except BaseException as exc:  # handed to whoever waits on the future, as a writer's is
                done.set_exception(exc)
            return done

        def written() -> T:
            try:
                return call()
            finally:
                self._slots.give_back(server)
        return self._writers.submit(written)
