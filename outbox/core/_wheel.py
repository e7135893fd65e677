"""A hashed timing wheel: where failed sends wait for their next attempt.

Timers hash into ``slots`` buckets by deadline tick; a timer further away than
one revolution carries a ``rounds`` count that each pass of its slot
decrements. Scheduling and cancelling are O(1); ``advance`` costs the slots it
passes plus the timers it fires. Memory holds only what waits, and the database
row holds the same next-attempt time, so losing the wheel on restart loses
nothing.

Not thread-safe: the relay's worker thread owns its wheel.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ._errors import ConfigurationError

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Timer(Generic[K]):
    item: K
    deadline: float
    rounds: int
    slot: int
    order: int = field(default=0)
    tick: int = field(default=0)
    """The tick whose passing fires it."""


class TimingWheel(Generic[K]):
    """Holds items until their deadline (seconds on any monotonic clock).

    ``tick`` is the resolution: an item fires on the first ``advance`` at or
    after the end of the tick holding its deadline, never before the deadline.
    One timer per item: scheduling an item again replaces its timer.
    """

    def __init__(self, *, tick: float = 0.05, slots: int = 512, start: float = 0.0) -> None:
        if not (isinstance(tick, int | float) and tick > 0):
            raise ConfigurationError(f"tick must be positive seconds, got {tick!r}")
        if not (isinstance(slots, int) and slots >= 1):
            raise ConfigurationError(f"slots must be a positive int, got {slots!r}")
        self.tick = float(tick)
        self.slots = slots
        self._buckets: list[dict[K, _Timer[K]]] = [{} for _ in range(slots)]
        self._timers: dict[K, _Timer[K]] = {}
        self._current = math.floor(start / self.tick)  # next tick to process
        self._order = 0

    def __len__(self) -> int:
        return len(self._timers)

    def __contains__(self, item: object) -> bool:
        return item in self._timers

    def schedule(self, item: K, deadline: float) -> None:
        """Fire ``item`` at ``deadline``; a past deadline fires with the next tick."""
        self.cancel(item)
        tick = max(math.ceil(deadline / self.tick), self._current)
        ahead = tick - self._current
        slot = tick % self.slots
        self._order += 1
        timer = _Timer(item, deadline, ahead // self.slots, slot, self._order, tick)
        self._buckets[slot][item] = timer
        self._timers[item] = timer

    def cancel(self, item: K) -> bool:
        """Forget ``item``'s timer; True if there was one."""
        timer = self._timers.pop(item, None)
        if timer is None:
            return False
        del self._buckets[timer.slot][item]
        return True

    def deadline(self, item: K) -> float | None:
        timer = self._timers.get(item)
        return None if timer is None else timer.deadline

    def next_due(self) -> float | None:
        """When ``advance`` fires the earliest timer (on the clock of the deadlines); None when empty.

        What a scheduler waits for instead of calling ``advance`` every tick.
        Costs one pass over the timers.
        """
        if not self._timers:
            return None
        first = min(timer.tick for timer in self._timers.values())
        # A hair past the tick's start: ``advance`` at that time fires it, whatever the rounding.
        return (first + 1e-6) * self.tick

    def advance(self, now: float) -> list[K]:
        """Fire every timer whose tick has passed by ``now``; items in deadline order."""
        last = math.floor(now / self.tick)
        fired: list[_Timer[K]] = []
        if not self._timers:
            self._current = max(self._current, last + 1)
            return []
        # Passing more than a revolution visits each slot once, decrementing rounds
        # by the revolutions passed, so a long sleep does not loop tick by tick.
        passed = last + 1 - self._current
        if passed <= 0:
            return []
        revolutions, rest = divmod(passed, self.slots)
        span = self.slots if revolutions else rest
        for step in range(span):
            tick = self._current + step
            bucket = self._buckets[tick % self.slots]
            if not bucket:
                continue
            # Ticks of this slot passed in this advance: revolutions (+1 when inside `rest`).
            visits = revolutions + (1 if step < rest else 0)
            for item, timer in list(bucket.items()):
                if timer.rounds < visits:
                    del bucket[item]
                    del self._timers[item]
                    fired.append(timer)
                else:
                    timer.rounds -= visits
        self._current = last + 1
        fired.sort(key=lambda t: (t.deadline, t.order))
        return [t.item for t in fired]
