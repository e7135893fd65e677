"""Outages of the relay's two dependencies: noticed, logged once per change of state, counted.

An outage is not a failure (DESIGN §9): while the database or the broker is
unreachable the relay keeps running, waits with capped backoff and resumes by
itself. What an operator needs is one line when a dependency goes away, one
when it is back (with how long it was gone), and a counter to alert on, not a
traceback per poll. Several threads of one relay (the loop, the lease thread,
the backlog gauges, the batch writer) report here; the first report of a
state change logs it, the others are silent.
"""

from __future__ import annotations

import enum
import threading
import time

from prometheus_client import Counter

from transports._logsafe import safe_logger

log = safe_logger("outbox.relay")

MAX_DATABASE_BACKOFF = 5.0
"""Seconds between attempts to reach a database that is down, at most."""


MAX_BROKER_OUTAGE_BACKOFF = 5.0
"""Seconds before a row is sent again while the broker is unreachable, at most."""


class Dependency(enum.Enum):
    """What the relay cannot work without."""

    DATABASE = "database"
    BROKER = "broker"


def database_backoff(failures: int, first: float) -> float:
    """Delay before attempt ``failures`` + 1 to reach the database: doubling, capped."""
    return min(MAX_DATABASE_BACKOFF, first * 2.0 ** min(failures, 16))


def broker_outage_backoff(batches: int) -> float:
    """Next attempt delay after ``batches`` consecutive batches the broker delivered nothing of."""
    return min(MAX_BROKER_OUTAGE_BACKOFF, 0.2 * 2.0 ** min(batches, 16))


class Outages:
    """Which dependencies one relay finds down; safe to call from any of its threads."""

    def __init__(self, worker_id: str, counter: Counter) -> None:
        self._worker_id = worker_id
        self._counter = counter
        self._down: dict[Dependency, float] = {}
        self._lock = threading.Lock()

    def down(self, dependency: Dependency, error: BaseException | str) -> None:
        """Record that ``dependency`` failed; logs and counts only the change from up to down."""
        with self._lock:
            if dependency in self._down:
                return
            self._down[dependency] = time.monotonic()
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        log.warning("relay %s: %s unreachable (%s); waiting with capped backoff",
                    self._worker_id, dependency.value, first_line[:300])
        self._counter.labels(dependency.value).inc()

    def up(self, dependency: Dependency) -> None:
        """Record that ``dependency`` worked; logs only the change from down to up."""
        if dependency not in self._down:  # the common case, without the lock
            return
        with self._lock:
            since = self._down.pop(dependency, None)
        if since is not None:
            log.warning("relay %s: %s reachable again after %.1f s", self._worker_id,
                        dependency.value, time.monotonic() - since)

    def is_down(self, dependency: Dependency) -> bool:
        return dependency in self._down
