"""Held messages that need a nudge: gaps that filled elsewhere, and gaps that never fill.

A held message is normally applied right after its predecessor, in the same
transaction. Two cases need a periodic sweep instead: the predecessor was
applied by another consumer (a key whose records sit on two partitions owned
by different processes), and the predecessor never comes. After
``gap_timeout`` the key is parked with reason ``gap``: the first held message
carries the reason, the others are parked behind it, and the alert sink hears
of it once.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from .._envelope import utcnow
from ._alerting import Alerter
from ._delivery import Delivery
from ._kinds import Reason
from ._store import InboxStore
from ._transaction import Parked


class GapSweeper:
    """Finds and settles held messages for one group; safe to call from several threads.

    Database errors propagate: the caller decides whether to wait (an outage).
    """

    def __init__(self, sessions: sessionmaker[Session], store: InboxStore, alerter: Alerter,
                 gap_timeout: float) -> None:
        self.sessions = sessions
        self.store = store
        self.alerter = alerter
        self.gap_timeout = gap_timeout

    def ready(self, limit: int = 500) -> list[Delivery]:
        """Held messages that are next in their key; apply each through its key's lane."""
        with self.sessions() as session:
            return self.store.ready_held(session, limit)

    def park_stale(self) -> int:
        """Park keys whose oldest held message waited longer than ``gap_timeout``; how many."""
        cutoff = utcnow() - timedelta(seconds=self.gap_timeout)
        with self.sessions() as session:
            keys = self.store.stale_gaps(session, cutoff)
        parked = 0
        for key in keys:
            with self.sessions() as session, session.begin():
                state = self.store.lock_keys(session, [key])[key]
                held = self.store.held_of(session, key)
                # A held copy of a seq applied meanwhile (it came again on another path) is a duplicate.
                stale = [d for d in held if d.message.seq <= state.last_seq]  # type: ignore[operator]
                self.store.unhold(session, (d.message.message_id for d in stale))
                held = held[len(stale):]
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
                key_parked = self.store.park(session, head, Reason.GAP, error=error)
            parked += 1
            self.alerter.parked([Parked(head, Reason.GAP, error, key_parked)])
        return parked
