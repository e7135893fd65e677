"""What one inbox transaction decided, gathered over its rounds and written when it ends.

``_phases.Transaction`` decides what becomes of each delivery; the ledger is
where every decision lands, and the one owner of what the rounds gathered:
the outcome handed to the settle stage (``Committed``), the duplicates whose
redelivery is counted, the held messages settled (their held rows go), a
parked key's flood (parked behind it in one statement), and the keys' new
positions and start points. ``write`` puts all of it into the database once,
at the end of the transaction, a statement per kind rather than one per
message.

A park is the exception: ``InboxStorage.park`` writes it at once, as it
decides whether the key parks with it, which the rounds after it must see.
"""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session

from ._committed import Committed, Failure, Parked
from ._conflicts import Verdict
from ._delivery import Delivery, KeyedDelivery, KeyId, OrderedDelivery
from ._kinds import Reason
from ._signals import Disposition
from .storage import InboxStorage


class Ledger:
    """The outcomes of one transaction over ``session``; for one thread, as its ``Transaction``."""

    def __init__(self, storage: InboxStorage, session: Session) -> None:
        self.storage = storage
        self.session = session
        self.committed = Committed()
        self._duplicates: list[Delivery] = []
        self._unhold: dict[uuid.UUID, Delivery] = {}
        """Held messages this transaction settled: their held rows go in ``write``."""
        self._behind_parked: list[KeyedDelivery] = []
        """Arrivals of parked keys, parked behind them by ``write`` in one statement."""
        self._new_seqs: dict[KeyId, int] = {}
        self._incarnations: dict[KeyId, str] = {}  # keys whose applied message changed their incarnation
        self._starts: dict[KeyId, int] = {}

    # -- what the rounds decide ---------------------------------------------------

    def applied(self, d: Delivery, disposition: Disposition) -> None:
        """``d``'s handler returned (``APPLIED``) or skipped it (``SKIPPED``)."""
        self.committed.done.append((d, disposition))
        if d.from_held:
            self._unhold[d.message.message_id] = d

    def held(self, d: Delivery) -> None:
        """``d`` waits for its predecessor in the held table (its caller wrote the row)."""
        self.committed.done.append((d, Disposition.HELD))

    def duplicate(self, d: Delivery) -> None:
        """``d`` was applied before: its redelivery is counted, its held row (if any) goes."""
        self._duplicates.append(d)
        if d.from_held:
            self._unhold[d.message.message_id] = d

    def park(self, d: Delivery, reason: Reason, error: str) -> None:
        """Park ``d`` now (``InboxStorage.park``, the one way into the parked table)."""
        key_parked = self.storage.park(self.session, d, reason, error=error or None)
        self.committed.parked.append(Parked(d, reason, error, key_parked))
        self.committed.done.append((d, Disposition.PARKED))

    def park_behind(self, d: KeyedDelivery) -> None:
        """Park ``d`` behind its parked key (``KEY_PARKED``)."""
        if d.from_held:
            self.park(d, Reason.KEY_PARKED, "")
        else:  # a parked key's flood: written in one statement by ``write``
            self._behind_parked.append(d)
            self.committed.parked.append(Parked(d, Reason.KEY_PARKED, "", False))
            self.committed.done.append((d, Disposition.PARKED))

    def conflict(self, d: OrderedDelivery, verdict: Verdict) -> None:
        """A new id met at or below its key's position, or at a held message's seq: counted, logged."""
        self.committed.conflicts.append((d, verdict))

    def failed(self, failure: Failure, blocked: list[Delivery]) -> None:
        """A handler failed; ``blocked``, the rest of its key, was not run and waits for it."""
        self.committed.failed.append(failure)
        self.committed.blocked.extend(blocked)

    def deferred(self, deliveries: list[Delivery]) -> None:
        """``deliveries`` were not run, the budget being spent: the next transaction takes them."""
        self.committed.deferred.extend(deliveries)

    def advanced(self, lane: KeyId, last_seq: int, incarnation: str | None) -> None:
        """The key applied up to ``last_seq``; ``incarnation`` when its producer's changed."""
        self._new_seqs[lane] = last_seq
        if incarnation is not None:
            self._incarnations[lane] = incarnation

    def started(self, lane: KeyId, seq: int) -> None:
        """The key starts at ``seq`` (first seen past seq 1, or started again), once it applies."""
        self._starts[lane] = seq

    def settled_held(self, message_id: uuid.UUID) -> bool:
        """Whether this transaction settled the held message ``message_id`` already."""
        return message_id in self._unhold

    # -- the end ------------------------------------------------------------------

    def write(self) -> None:
        """Write what the rounds gathered: redeliveries, held rows settled, the keys' new positions."""
        storage, session = self.storage, self.session
        storage.park_behind(session, self._behind_parked)
        storage.dedup.count_redelivery(session, (d.message.message_id for d in self._duplicates))
        storage.held.remove(session, self._unhold)
        storage.keys.advance(session, self._new_seqs, self._incarnations)
        # A key starts where its first message applied; if that one failed, its retry starts it.
        storage.keys.set_started(session, {lane: seq for lane, seq in self._starts.items()
                                           if lane in self._new_seqs})
        self.committed.done.extend((d, Disposition.DUPLICATE) for d in self._duplicates)
