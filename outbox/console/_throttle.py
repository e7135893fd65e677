"""Backoff against guessing: a budget of wrong credentials that no choice of addresses escapes.

Each wrong credential (a ``/login`` token, a bearer token, a basic-auth
password) is one ``Attempt``: from a client address, at a credential (the
token, or a configured basic-auth user; ``None`` for a user name that is not
configured, which can never succeed), maybe from a *known browser* — one that
holds a device cookie proving it signed in here with that credential before
(``_devices``).

An attempt from a browser that is not known counts against

- its **address** and the **credential** it aimed at: the first ``free``
  failures cost nothing; each further one locks that subject for twice as long
  as the one before (1 s, 2 s, 4 s … up to ``lock_max``); a subject with no
  failure for ``forget`` seconds starts again;
- **every unknown browser together**: at most ``daily`` failures in any 24
  hours; once they are used, every unknown browser waits until the oldest is a
  day old.

While any of those is locked, the attempt is answered 429 before its
credential is compared — the right credential too — so the answers teach a
guesser nothing and ``daily`` bounds what all of them learn in a day, however
many addresses, forwarding headers or user names they use.

That budget is also a lever: anyone can spend it and lock every unknown
browser out (a denial of service). A known browser is therefore judged by its
own count only (the same ``free`` and doubling, per device, forgotten only a
day after its last failure), so an operator
who signed in before keeps signing in while strangers guess; a stolen device
cookie buys its thief that device's own ~100 guesses a day, nothing more. This
is OWASP's "Slow Down Online Guessing Attacks with Device Cookies".

A success clears its device's count (from an unknown browser: its
address's), never the credential's or the shared budget (a guesser must not win them back through
someone else's sign-in). Memory is bounded: at most ``max_tracked`` addresses,
devices and credentials each (the stalest dropped first), and ``daily``
timestamps; a flood of addresses can push out other addresses only, never a
credential's count or the shared budget. Each lock is one WARNING on
``outbox.console.audit`` naming the subject, never a credential or a cookie.

State lives in this process; several console processes each keep their own.
Safe to call from several threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from transports._logsafe import safe_logger

audit = safe_logger("outbox.console.audit")

DAY = 86400.0


@dataclass(frozen=True)
class Attempt:
    """One try of a credential: from where, at which credential, from which known browser."""

    address: str
    """The client as ``_authenticator.client_of`` names it (an IPv6 client by its /64)."""
    credential: str | None
    """``"the token"`` or ``"user 'NAME'"`` of a configured user; ``None`` for any other user name."""
    device: str | None = None
    """The known browser's device id, when it proved ``credential`` here before; else ``None``."""


@dataclass
class _Count:
    failures: int
    last_failure: float
    locked_until: float


class _Backoff:
    """Failures per subject, each further one past ``free`` locking twice as long; LRU-bounded."""

    def __init__(self, free: int, lock_max: float, forget: float, max_tracked: int) -> None:
        self.free, self.lock_max, self.forget, self.max_tracked = free, lock_max, forget, max_tracked
        self._counts: OrderedDict[str, _Count] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def wait(self, subject: str, now: float) -> float:
        count = self._counts.get(subject)
        return 0.0 if count is None else max(0.0, count.locked_until - now)

    def failed(self, subject: str, now: float) -> tuple[int, float] | None:
        """Count a failure; returns (failures, lock seconds) when it locked the subject."""
        count = self._counts.pop(subject, None)
        if count is None or now - count.last_failure > self.forget:
            count = _Count(0, now, now)
        count.failures += 1
        count.last_failure = now
        self._counts[subject] = count  # (re-)inserted last: the order is staleness
        while len(self._counts) > self.max_tracked:
            self._counts.popitem(last=False)
        beyond = count.failures - self.free
        if beyond <= 0:
            return None
        lock = min(self.lock_max, 2.0 ** min(beyond - 1, 30))
        count.locked_until = now + lock
        return count.failures, lock

    def clear(self, subject: str) -> None:
        self._counts.pop(subject, None)


class _Window:
    """At most ``limit`` failures in any ``span`` seconds."""

    def __init__(self, limit: int, span: float) -> None:
        self.limit, self.span = limit, span
        # Beyond ``limit`` only if two failures raced past one check: kept, so none goes uncounted.
        self._times: deque[float] = deque(maxlen=2 * limit)

    def wait(self, now: float) -> float:
        while self._times and now - self._times[0] >= self.span:
            self._times.popleft()
        over = len(self._times) - self.limit
        return 0.0 if over < 0 else self._times[over] + self.span - now

    def failed(self, now: float) -> bool:
        """Count a failure; True when it used the last of the budget."""
        self.wait(now)
        self._times.append(now)
        return len(self._times) >= self.limit


def _monotonic() -> float:
    return time.monotonic()  # looked up at each call, so a test may replace the module's ``time``


class Throttle:
    def __init__(self, *, free: int = 5, lock_max: float = 900.0, forget: float = 3600.0,
                 daily: int = 100, max_tracked: int = 10_000,
                 clock: Callable[[], float] | None = None) -> None:
        self.free, self.lock_max, self.forget, self.daily = free, lock_max, forget, daily
        self._clock = clock or _monotonic
        self._addresses = _Backoff(free, lock_max, forget, max_tracked)
        self._credentials = _Backoff(free, lock_max, forget, max_tracked)
        # A known browser escapes the day's budget; its own count must not be escaped by pausing
        # (an hour's pause would start the doubling again: ~300 a day). Forgotten after a day, it
        # allows ``free`` + the doubling + one per ``lock_max``: ~110 in any day.
        self._devices = _Backoff(free, lock_max, max(forget, DAY), max_tracked)
        self._unknown = _Window(daily, DAY)
        self._lock = threading.Lock()

    def tracked(self) -> int:
        """How many subjects are remembered now (bounded: see the module docstring)."""
        with self._lock:
            return len(self._addresses) + len(self._credentials) + len(self._devices)

    def wait(self, attempt: Attempt) -> float:
        """Seconds until ``attempt`` may be compared (0: now)."""
        now = self._clock()
        with self._lock:
            if attempt.device is not None:
                return self._devices.wait(attempt.device, now)
            waits = [self._addresses.wait(attempt.address, now), self._unknown.wait(now)]
            if attempt.credential is not None:
                waits.append(self._credentials.wait(attempt.credential, now))
            return max(waits)

    def failed(self, attempt: Attempt) -> None:
        """``attempt`` was compared and wrong: count it, and lock what is past its free tries."""
        now = self._clock()
        with self._lock:
            if attempt.device is not None:
                self._warn(self._devices.failed(attempt.device, now),
                           f"a known browser (device {attempt.device})")
                return
            self._warn(self._addresses.failed(attempt.address, now), attempt.address)
            if attempt.credential is not None:
                self._warn(self._credentials.failed(attempt.credential, now),
                           f"{attempt.credential} from every browser not known here")
            if self._unknown.failed(now):
                audit.warning("sign-in locked for every browser not known here: %d wrong credentials "
                              "in 24 h; next try in %.0f s (a browser that signed in before is not held up)",
                              self.daily, self._unknown.wait(now))

    def succeeded(self, attempt: Attempt) -> None:
        """``attempt`` was right: its device's count (from an unknown browser: its address's) is cleared."""
        with self._lock:
            if attempt.device is not None:
                self._devices.clear(attempt.device)
            else:
                self._addresses.clear(attempt.address)

    @staticmethod
    def _warn(locked: tuple[int, float] | None, subject: str) -> None:
        if locked is not None:
            audit.warning("sign-in locked for %s after %d wrong credentials: next try in %.0f s",
                          subject, *locked)
