"""Which relays are stale, judged by whether their heartbeat moves, not by comparing clocks.

A relay stamps its heartbeat with its own clock; the console reads it with
another. Comparing the two marks a live relay whose clock is two minutes
behind as stale, and never marks a dead one whose clock was ten minutes ahead
until those ten minutes pass. So the console remembers each relay's last
heartbeat and when (by its own monotonic clock) it saw that value appear: a
relay is stale when its heartbeat has not moved for ``stale_after`` seconds.
At first sight there is no history, and the clocks are all there is: the age
counts as how long the value has stood still (a heartbeat ahead of the
console, as zero). A heartbeat more than ``AHEAD_TOLERANCE`` ahead is shown
as such, with the skew, so nobody reads "-300 s".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

AHEAD_TOLERANCE = 5.0
MOVED = 1.0
"""A heartbeat that differs by more than this (seconds) has moved (ages are rounded to 0.1 s)."""


class Heartbeats:
    def __init__(self, stale_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self._clock = clock
        self._seen: dict[str, tuple[float, float]] = {}  # worker -> (heartbeat, since when by our clock)
        self._lock = threading.Lock()

    def judge(self, relays: list[dict[str, Any]], checked_at: datetime) -> list[dict[str, Any]]:
        """``relays`` (``gather``'s) each with ``stale`` and ``ahead_s`` (the relay clock's lead, or None)."""
        now = self._clock()
        judged = []
        with self._lock:
            for r in relays:
                age = r["heartbeat_age_s"]
                if age is None:
                    judged.append({**r, "stale": False, "ahead_s": None})
                    continue
                beat = checked_at.timestamp() - age
                seen = self._seen.get(r["worker_id"])
                if seen is None:
                    seen = (beat, now - max(age, 0.0))
                elif abs(seen[0] - beat) > MOVED:
                    seen = (beat, now)
                self._seen[r["worker_id"]] = seen
                judged.append({**r, "stale": now - seen[1] > self.stale_after,
                               "ahead_s": -age if age < -AHEAD_TOLERANCE else None})
            current = {r["worker_id"] for r in relays}
            for gone in [w for w in self._seen if w not in current]:  # forgotten relays: bounded memory
                del self._seen[gone]
        return judged
