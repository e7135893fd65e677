"""Dropping a client library's repeated log lines: each kind at most once per ``every`` seconds.

A Kafka client logs every failed connection attempt, several lines a second
while a broker is down; the relay and the inbox say "broker unreachable" once
themselves. Two lines of one *kind* differ only in their numbers (timings,
counts, ports of the same host), so the kind is the text with digits masked.
The next line of a kind after a quiet spell says how many were dropped.
"""

from __future__ import annotations

import re
import threading
import time

_NUMBERS = re.compile(r"\d+")


class Repeats:
    """Decides which lines to let through; safe to call from several threads."""

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # kind -> (last let through, dropped since)

    def admit(self, text: str) -> str | None:
        """``text`` to log (with the count of dropped look-alikes appended), or None to drop it."""
        kind = _NUMBERS.sub("#", text)
        now = time.monotonic()
        with self._lock:
            last, dropped = self._seen.get(kind, (None, 0))
            if last is not None and now - last < self.every:
                self._seen[kind] = (last, dropped + 1)
                return None
            self._seen[kind] = (now, 0)
        return text + f" ({dropped} more like it in the last {self.every:.0f} s)" if dropped else text
