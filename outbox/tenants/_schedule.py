"""Which tenant a fleet's worker serves next: a queue of woken tenants, a queue of polls, timers.

``Schedule`` holds the fleet's two queues of ``Unit``s (``_units``) and their
timers, under one lock its workers wait on:

- **woken** tenants (a notification, a retry timer of its wheel, a full batch)
  are served first, in turn;
- tenants whose **poll** is due (or woken after an outage) take every
  ``POLL_SHARE``-th turn when woken tenants wait too, so 500 idle tenants'
  polls never queue ahead of a notified one, and a busy fleet still polls (and
  renews the leases of) its idle tenants;
- **timers** put a tenant in a queue later: its next poll (rare for an idle
  tenant while notifications can wake it: ``_idle_polls``), its retry after a
  failure, or the moment its wheel lets a key go again (``Step.due``). A
  tenant has one pending timer at a time; a newer one makes the older moot.

A unit is run by at most one worker at a time (``TurnState``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

from ._turn_state import TurnState
from ._units import Unit

POLL_SHARE = 4
"""One turn in this many serves a polled tenant when woken tenants wait too."""


@dataclass(frozen=True, slots=True)
class Turn:
    """What a tenant's turn on a worker says about its next one."""

    again: bool = False
    """More may be waiting: back in the queue at once."""
    retry: float | None = None
    """Seconds until it is tried again (its failure, or its database is down)."""
    due: float | None = None
    """When its wheel lets a key go again (``Step.due``)."""
    poll_in: float | None = None
    """Seconds until its next poll (``_idle_polls``); None: the poll interval."""


class Schedule:
    """The fleet's queues and timers; ``lock`` guards them and every unit's state. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._ready: deque[Unit] = deque()
        self._polls: deque[Unit] = deque()
        self._turn = 0
        self._timers: list[tuple[float, int, Unit, int, bool]] = []
        self._order = itertools.count()
        self.timer_added = threading.Event()
        """Set when a timer earlier than every other is added: the clock waits for it."""

    # -- queues -------------------------------------------------------------------------

    def wake(self, unit: Unit, *, poll: bool = False) -> None:
        with self.lock:
            self.wake_locked(unit, poll=poll)

    def wake_locked(self, unit: Unit, *, poll: bool = False) -> None:
        """Queue ``unit``: a poll behind the woken tenants, anything else among them.

        A tenant queued for a poll and then woken moves up to the woken ones;
        one running is queued again when its step ends.
        """
        if unit.step is None or unit.removed:
            return
        if unit.state is TurnState.QUEUED and unit.polled and not poll:
            self._polls.remove(unit)
            unit.state = TurnState.IDLE
        if unit.state is TurnState.IDLE:
            unit.state = TurnState.QUEUED
            unit.polled = poll
            unit.generation += 1  # its pending timer is moot
            (self._polls if poll else self._ready).append(unit)
            self.lock.notify()
        elif unit.state is TurnState.RUNNING:
            unit.again = True

    def unqueue_locked(self, unit: Unit) -> None:
        """Take a queued ``unit`` out of its queue: no worker starts it (it is being closed)."""
        if unit.state is TurnState.QUEUED:
            (self._polls if unit.polled else self._ready).remove(unit)
            unit.state = TurnState.IDLE

    def take(self, stopping: threading.Event) -> Unit | None:
        """The next unit to serve, now running; waits for one. None once ``stopping`` is set.

        The woken ones in turn, with every ``POLL_SHARE``-th turn a poll: polls of
        idle tenants never delay a woken tenant by more than a turn in ``POLL_SHARE``.
        """
        with self.lock:
            while not self._ready and not self._polls and not stopping.is_set():
                self.lock.wait(0.5)
            if stopping.is_set():
                return None
            self._turn += 1
            if self._polls and (not self._ready or self._turn % POLL_SHARE == 0):
                unit = self._polls.popleft()
            else:
                unit = self._ready.popleft()
            unit.state = TurnState.RUNNING
            unit.again = False
            return unit

    def next_turn_locked(self, unit: Unit, turn: Turn, poll_every: float) -> None:
        """Queue ``unit`` after its turn: now (more may be waiting), at its retry, wheel timer or poll.

        Its poll comes ``turn.poll_in`` seconds later (``poll_every`` when the turn does not say).
        """
        poll_in = turn.poll_in if turn.poll_in is not None else poll_every
        if turn.again or unit.again:
            self.wake_locked(unit)
        elif turn.retry is not None:
            self.later_locked(unit, turn.retry)
        elif turn.due is not None and turn.due - time.monotonic() < poll_in:
            self.later_locked(unit, max(0.0, turn.due - time.monotonic()), poll=False)
        else:
            self.later_locked(unit, poll_in)

    # -- timers -------------------------------------------------------------------------

    def later_locked(self, unit: Unit, delay: float, *, poll: bool = True) -> None:
        """Queue ``unit`` in ``delay`` seconds (as a poll, or woken); replaces its pending timer."""
        unit.generation += 1
        at = time.monotonic() + delay
        if not self._timers or at < self._timers[0][0]:
            self.timer_added.set()
        heapq.heappush(self._timers, (at, next(self._order), unit, unit.generation, poll))

    def fire_due(self) -> float | None:
        """Queue the units whose timer is due; when the next timer is due (None: no timer)."""
        now = time.monotonic()
        with self.lock:
            while self._timers and self._timers[0][0] <= now:
                _, _, unit, generation, poll = heapq.heappop(self._timers)
                if generation == unit.generation:
                    self.wake_locked(unit, poll=poll)
            return self._timers[0][0] if self._timers else None

    def notify_all(self) -> None:
        """Wake every worker waiting for a unit (the fleet stops)."""
        with self.lock:
            self.lock.notify_all()
