"""Sweeping every tenant's place in turn: held messages ready, stale gaps parked, parked keys counted.

The runner's consumer thread must never wait for a tenant's database: each
turn hands the places whose turn it is (``SWEEP_SLICE`` of them, round robin)
to a sweeper thread per database and takes what the finished sweeps found; a
database whose last sweep has not returned (a hung one) is skipped. An outage
closes the place's gate (``_places``) instead of failing the sweep; a gate closed
so is probed by the sweep in its turn, as by a worker (one a transaction closed
is its put-off deliveries' to probe).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from transports._logsafe import safe_logger

from ._delivery import Delivery, Named
from ._outage import BACKOFF, is_outage
from ._places import Place
from ._tenant_places import TenantPlaces

log = safe_logger("outbox.inbox")

SWEEP_SLICE = 50
"""Places swept per sweep turn (one a second): with many tenants, each is swept in its turn."""

T = TypeVar("T")


class TenantSweeps:
    """The gap sweeper's role over every tenant's place (``ready``, ``sweep``, ``parked_key_count``)."""

    def __init__(self, places: TenantPlaces) -> None:
        self.places = places
        self._lock = threading.Lock()
        self._sweep_from = 0
        self._sweeps: dict[object, Future[list[Delivery]]] = {}
        self._refreshing = threading.Lock()

    def _slice(self) -> list[Place]:
        """The places whose turn it is to be swept (``SWEEP_SLICE`` of them, round robin)."""
        places = self.places.all()
        if len(places) <= SWEEP_SLICE:
            return places
        start = self._sweep_from % len(places)
        self._sweep_from = start + SWEEP_SLICE
        return (places + places)[start:start + SWEEP_SLICE]

    def ready(self) -> list[Delivery]:
        """Held messages next in their key that the sweeps finished since the last call found.

        Called by the runner's consumer thread, which must never wait for a
        tenant's database: each turn hands the places whose turn it is to the
        sweeper threads, one per database (a database whose last sweep has
        not returned, a hung one, is skipped), and takes what the finished
        ones found. Reads the tenant source when due, on a thread of its own.
        """
        self._refresh_in_background()
        found: list[Delivery] = []
        by_pool: dict[object, list[Place]] = {}
        for place in self._slice():
            by_pool.setdefault(place.engine.pool, []).append(place)
        with self._lock:
            for pool, task in list(self._sweeps.items()):
                if task.done():
                    del self._sweeps[pool]
                    if task.exception() is None:
                        found.extend(task.result())
            for pool, places in by_pool.items():
                if pool not in self._sweeps:
                    self._sweeps[pool] = self._in_background(places)
        return found

    def _refresh_in_background(self) -> None:
        """``refresh()`` when due, on a daemon thread: a source whose database hangs holds up no poll."""
        if not self.places.due() or self._refreshing.locked():
            return

        def refresh() -> None:
            with self._refreshing:
                try:
                    self.places.refresh()
                except Exception:
                    log.exception("reading the tenant source failed")
        threading.Thread(target=refresh, name="outbox-inbox-tenants", daemon=True).start()

    def _in_background(self, places: list[Place]) -> Future[list[Delivery]]:
        """``sweep(places)`` on a daemon thread of its own: one that hangs never holds up an exit."""
        task: Future[list[Delivery]] = Future()

        def sweep() -> None:
            try:
                task.set_result(self.sweep(places))
            except BaseException as exc:
                log.exception("inbox sweep failed")
                task.set_exception(exc)
        threading.Thread(target=sweep, name="outbox-inbox-sweep", daemon=True).start()
        return task

    def park_stale(self) -> int:
        """Nothing to do here: ``ready``'s sweeps park the stale gaps of their places too."""
        return 0

    def sweep(self, places: list[Place] | None = None) -> list[Delivery]:
        """Sweep ``places`` (all, when None) in this thread: held messages ready, gaps to park, counts.

        Sweeping them all (``Inbox.sweep``) also reads the tenant source when due.
        """
        if places is None:
            self.places.refresh()
        found: list[Delivery] = []
        for place in self.places.all() if places is None else places:
            # A gate an outage of its own sweep closed is probed in its turn, as a worker probes it: a
            # tenant with no traffic has no worker to open it, and its gaps would never be parked again.
            # One a transaction closed is its put-off deliveries' to probe (reads that answer say nothing
            # of writes: a long writer's lock, a full disk); one closed until its tables are checked is a
            # worker's to open (the check, and its log line).
            shut = place.gate.down
            if (shut and not (place.checked and place.swept_shut)) or place.gate.admit() is not None:
                continue
            started = time.monotonic()
            failures: list[BaseException] = []
            try:
                found.extend(self._sweeping(place, lambda p: [
                    dataclasses.replace(d, tenant=Named(p.name or "")) for d in p.gaps.ready()], [],
                    failures))
                self._sweeping(place, lambda p: p.gaps.park_stale(), 0, failures)
                place.parked_keys = self._sweeping(place, lambda p: p.gaps.watched(p.admin.parked_key_count),
                                                   place.parked_keys, failures)
                if shut and not failures:  # a probe that failed closed the gate again: no answer
                    place.gate.answered(started)
            finally:
                place.gate.probed()
        return found

    def _sweeping(self, place: Place, fn: Callable[[Place], T], otherwise: T,
                  failures: list[BaseException]) -> T:
        """``fn(place)``; a failure goes to ``failures``, gives ``otherwise``; an outage closes the
        place's gate. Nothing after a failure that closed it: its probing went with that failure."""
        if any(isinstance(e, DBAPIError) or is_outage(e) for e in failures):
            return otherwise
        try:
            return fn(place)
        except Exception as exc:
            failures.append(exc)
            if is_outage(exc):
                place.gate.failed(exc)
                place.swept_shut = True
            elif isinstance(exc, DBAPIError):
                place.gate.close(BACKOFF.cap)
                place.checked = False
            else:
                log.exception("%s: inbox sweep failed", place.what)
            return otherwise

    def parked_key_count(self) -> int:
        """Parked keys of every tenant, as last counted by the sweep."""
        return sum(p.parked_keys for p in self.places.all())
