"""``InboxStorage``: the inbox's four stores of one group, and the one way a message is parked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from ...core._envelope import utcnow
from ...core._tables import OutboxTables
from .._delivery import Delivery, KeyedDelivery
from .._kinds import Reason
from ._dedup import DedupRecords
from ._held import HeldMessages
from ._keys import KeyPositions
from ._parked import ParkedMessages


@dataclass(frozen=True, slots=True)
class InboxStorage:
    """The tables of one consumer group, a store per concern; safe to share between threads.

    Each store is a protocol with one class per dialect (``storage_for``
    picks them by the engine's dialect). Every method runs inside the
    caller's transaction and never commits. ``park`` is the one way a
    message enters ``inbox_parked``, so it lives here, where the stores it
    composes meet.
    """

    group: str
    dedup: DedupRecords
    """``inbox_messages``: the ids the group recorded."""
    keys: KeyPositions
    """``inbox_keys``: each key's position, start point, incarnation and parked flag."""
    held: HeldMessages
    """``inbox_held``: messages waiting behind a gap."""
    parked: ParkedMessages
    """``inbox_parked``: messages waiting for an operator."""

    def park(self, session: Session, d: Delivery, reason: Reason, *, error: str | None = None,
             traceback: str | None = None, attempts: int = 0) -> bool:
        """Store ``d`` in ``inbox_parked``; True when this also parked its key.

        A keyed message parked for a reason that stops its key
        (``Reason.parks_key``) marks the key parked and moves the key's held
        messages behind it (reason ``KEY_PARKED``). The caller holds the key's
        lock. A second park of the same message is a no-op.
        """
        now = utcnow()
        self.parked.add(session, d, reason, now, error=error, traceback=traceback, attempts=attempts)
        if d.from_held:
            self.held.remove(session, [d.message.message_id])
        if not (reason.parks_key and isinstance(d, KeyedDelivery)):
            return False
        key = d.lane
        self.keys.mark_parked(
            session, key, f"{reason}: message {d.message.message_id} (seq {d.message.seq}): {error or ''}",
            now)
        for held in self.held.of_key(session, key):
            if held.message.message_id != d.message.message_id:
                self.park(session, held, Reason.KEY_PARKED)
        return True

    def park_behind(self, session: Session, deliveries: Sequence[KeyedDelivery]) -> None:
        """Park arrivals of parked keys (``KEY_PARKED``) in one statement.

        The flood of a parked key is parked at the rate its messages arrive:
        ``park`` for each would cost a statement per message. The caller holds
        the keys' locks; none of ``deliveries`` comes from ``inbox_held``
        (those go through ``park``, which also deletes their held row), and
        their keys are parked already. A message parked already is left as it is.
        """
        self.parked.add_behind(session, deliveries)


StorageFactory = Callable[[OutboxTables, str], InboxStorage]
"""Builds the storage of one group on ``tables``: what ``Inbox(storage=…)`` takes.

The inbox calls it once for its own database and once per tenant (with the
tenant's unqualified tables), so a factory serves every place an inbox writes.
"""
