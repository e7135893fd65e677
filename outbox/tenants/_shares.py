"""A tenant draining a backlog takes small batches while other tenants have live traffic.

On a host whose cores a backlog's drain keeps busy, each step of a quiet
tenant's message (the interpreter lock, the database's CPU, the broker's request
queue) waits behind whatever part of the backlog's batch holds it: a thousand rows
decoded and encoded, a mark of a thousand rows, a produce request of a thousand
records. Neither the lock nor the database nor the broker can be told that one
of them matters more; what a fleet can choose is how big those parts are. Traced
next to a 1,000,000-row backlog (docs/benchmarks.md, *Many tenants*), the quiet
tenant's fetch waited p99 8 ms and its acknowledgement 7 ms, against 1.5 and
1.2 ms alone; with every batch at 100 rows (one round) its p99 was 1.2x its p99
alone instead of 2.6-4.2x.

So while some tenant has live traffic (a turn that fetched rows, fewer than its
batch: it had all there was), a tenant going on with a backlog (its last batch
was full) fetches ``SHARED_BATCH`` rows at a time. Its backlog drains more
slowly while that lasts (about half as fast, measured), and at full batches
again ``LIVE_WINDOW`` after the last live turn. A fleet whose tenants all have
backlogs (a catch-up after an outage), or none, runs full batches.

The batch's size bounds how long one part of the backlog's work holds a
resource; it does not stop the backlog from starting its next part while a live
turn is under way. So the backlog's shared turn also yields: it starts only once
no live turn is running (a turn of a tenant without a backlog), waiting
``YIELD_AT_MOST`` seconds at most, so that live tenants following one another
cannot hold it off for ever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

SHARED_BATCH = 100
"""Rows a backlogged tenant's batch takes while another tenant has live traffic."""

LIVE_WINDOW = 1.0
"""Seconds after the last live turn that backlogs keep their small batches."""

YIELD_AT_MOST = 0.02
"""Seconds a backlog's shared turn waits at most for the live turns running to end."""


class Backlogged(Protocol):
    """What a share reads and writes of a tenant (``Unit.backlogged``)."""

    backlogged: bool


class BacklogShares:
    """How many rows a tenant's next batch takes; the time of the last live turn is its own."""

    def __init__(self, shared_batch: int | None = SHARED_BATCH) -> None:
        self.shared_batch = shared_batch
        self._live_at = float("-inf")
        self._running = threading.Condition()
        self._live_running = 0

    @contextmanager
    def turn(self, unit: Backlogged, *, shared: bool) -> Iterator[None]:
        """Around ``unit``'s turn (``shared``: its batch takes ``shared_batch`` rows, ``limit_for``):
        a turn of a tenant without a backlog counts as live while it runs; a backlog's shared
        turn first waits for the live turns running to end, ``YIELD_AT_MOST`` seconds at most."""
        if unit.backlogged:
            if shared:
                with self._running:
                    self._running.wait_for(lambda: not self._live_running, YIELD_AT_MOST)
            yield
            return
        with self._running:
            self._live_running += 1
        try:
            yield
        finally:
            with self._running:
                self._live_running -= 1
                if not self._live_running:
                    self._running.notify_all()

    def limit_for(self, unit: Backlogged) -> int | None:
        """``unit``'s next batch: ``shared_batch`` rows while it has a backlog and another tenant
        had live traffic lately; None (its batch size) otherwise."""
        if self.shared_batch and unit.backlogged and time.monotonic() - self._live_at < LIVE_WINDOW:
            return self.shared_batch
        return None

    def after_turn(self, unit: Backlogged, *, fetched: int, full: bool) -> None:
        """What ``unit``'s turn fetched, and whether it stopped at its limit of rows or bytes. The
        partial batch that ends a backlog is not live traffic: in a catch-up, the first backlog to
        drain would cut all the others to ``shared_batch`` rows for ``LIVE_WINDOW``."""
        if fetched and not full and not unit.backlogged:
            self._live_at = time.monotonic()
        unit.backlogged = full
