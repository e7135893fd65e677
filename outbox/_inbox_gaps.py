"""Held messages that need a nudge: gaps that filled elsewhere, and gaps that never fill.

A held message is normally applied right after its predecessor, in the same
transaction. Two cases need a periodic sweep instead: the predecessor was
applied by another consumer (a key whose records sit on two partitions owned
by different processes), and the predecessor never comes. After
``gap_timeout`` the key is parked with reason ``"gap"``: the first held
message carries the reason, the others are parked behind it, and the alert
sink hears of it once.
"""

from __future__ import annotations

from datetime import timedelta

from ._envelope import utcnow
from ._inbox_apply import park_key
from ._inbox_delivery import Delivery
from ._inbox_retry import Retrier
from ._inbox_store import GAP


class GapSweeper:
    """Finds and settles held messages for one group; safe to call from several threads."""

    def __init__(self, retrier: Retrier, gap_timeout: float) -> None:
        self.retrier = retrier
        self.applier = retrier.applier
        self.store = retrier.applier.store
        self.gap_timeout = gap_timeout

    def sweep(self) -> None:
        for d in self.ready():
            self.retrier.settle([d])
        self.park_stale()

    def ready(self, limit: int = 500) -> list[Delivery]:
        """Held messages that are next in their key; apply each through its key's lane."""
        with self.applier.sessions() as session:
            return self.store.ready_held(session, limit)

    def park_stale(self) -> int:
        """Park keys whose oldest held message waited longer than ``gap_timeout``; how many."""
        cutoff = utcnow() - timedelta(seconds=self.gap_timeout)
        with self.applier.sessions() as session:
            keys = self.store.stale_gaps(session, cutoff)
        parked = 0
        for key in keys:
            alerts = []
            with self.applier.sessions() as session, session.begin():
                state = self.store.lock_keys(session, [key])[key]
                held = self.store.held_of(session, key)
                if state.parked or not held or held[0].received_at >= cutoff:
                    continue  # settled meanwhile
                head = held[0]
                expected = state.last_seq + 1
                if head.message.seq == expected:
                    continue  # the gap filled: ready(), not parking
                last_missing = head.message.seq - 1  # type: ignore[operator]
                missing = f"seq {expected}" + (f" to {last_missing}" if last_missing > expected else "")
                error = (f"{missing} did not arrive within {self.gap_timeout:g}s "
                         f"(seq {head.message.seq} waiting since {head.received_at.isoformat()})")
                self.store.park(session, head, reason=GAP, error=error)
                alerts = park_key(self.store, session, head, GAP, error)
                parked += 1
            self.applier.metrics.parked(key[0], GAP)
            self.retrier.raise_alerts(alerts)
        return parked

