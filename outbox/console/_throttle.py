"""Backoff against guessing: wrong credentials lock out their client address and user name.

Each wrong credential (a ``/login`` token, a bearer token, a basic-auth
password) counts against the client's address and, for basic auth, against
the configured user it named. The first ``free`` failures cost nothing; each
further one locks that subject out for twice as long as the one before (1 s,
2 s, 4 s … up to ``lock_max``). While a subject is locked, every attempt is
answered 429 before its credential is compared, the right credential too: a
guesser learns nothing from the answers and gets a few hundred tries a day.
A success clears the counts; a subject with no failure for ``forget`` seconds
is forgotten. At most ``max_tracked`` subjects are kept (the stalest dropped
first), so a flood of addresses cannot exhaust memory. Each lock is one
WARNING on ``outbox.console.audit`` naming the subject, never a credential.

State lives in this process; several console processes each keep their own.
Safe to call from several threads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from transports._logsafe import safe_logger

audit = safe_logger("outbox.console.audit")


@dataclass
class _Count:
    failures: int
    last_failure: float
    locked_until: float


class Throttle:
    def __init__(self, *, free: int = 5, lock_max: float = 900.0, forget: float = 3600.0,
                 max_tracked: int = 10_000) -> None:
        self.free, self.lock_max, self.forget, self.max_tracked = free, lock_max, forget, max_tracked
        self._counts: dict[str, _Count] = {}
        self._lock = threading.Lock()

    def wait(self, *subjects: str) -> float:
        """Seconds until every one of ``subjects`` may try again (0: they may now)."""
        now = time.monotonic()
        with self._lock:
            counts = [self._counts.get(s) for s in subjects]
            return max([c.locked_until - now for c in counts if c is not None] + [0.0])

    def failed(self, *subjects: str) -> None:
        """A wrong credential from ``subjects``: count it, and lock those past their free tries."""
        now = time.monotonic()
        with self._lock:
            for subject in subjects:
                count = self._counts.pop(subject, None)
                if count is None or now - count.last_failure > self.forget:
                    count = _Count(0, now, now)
                count.failures += 1
                count.last_failure = now
                beyond = count.failures - self.free
                if beyond > 0:
                    lock = min(self.lock_max, 2.0 ** min(beyond - 1, 30))
                    count.locked_until = now + lock
                    audit.warning("sign-in locked for %s after %d wrong credentials: next try in %.0f s",
                                  subject, count.failures, lock)
                self._counts[subject] = count  # re-inserted: the dict's order is staleness
            while len(self._counts) > self.max_tracked:
                del self._counts[next(iter(self._counts))]

    def succeeded(self, *subjects: str) -> None:
        with self._lock:
            for subject in subjects:
                self._counts.pop(subject, None)
