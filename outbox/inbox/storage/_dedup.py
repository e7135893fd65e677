"""Dedup records (``inbox_messages``): the ids one group has recorded, and how each ended.

Eventuate Tram's duplicate detector, with the outcome kept: a row per message
id the group applied (``processed``), skipped or discarded. ``claim`` inserts
a batch's rows in the transaction that applies them, so the record and the
handler's writes commit together; an id that was there already is a
duplicate. Only a recorded id is a duplicate: the inbox looks ids up
(``known``) before it calls anything below a key's position one.

``claim`` is the per-batch statement, spelled per dialect (``_sqlite``,
``_pg``, ``_mysql``); the rest is ``DedupTable``'s, shared.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ...core._envelope import utcnow
from ...core._tables import InboxOutcome
from .._delivery import Delivery
from ._inserts import GroupStore


class DedupRecords(Protocol):
    """The dedup records of one group; every method runs in the caller's transaction."""

    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """Insert the dedup rows; returns the ids that were new (the rest are duplicates).

        ``deliveries`` must not repeat a message id: two copies in one statement
        would both look new to the caller.
        """
        ...

    def unclaim(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        """Give back claims of messages that did not apply after all (the transaction goes on)."""
        ...

    def known(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """The ids of ``deliveries`` this group recorded already (applied, skipped, discarded)."""
        ...

    def is_recorded(self, session: Session, message_id: uuid.UUID) -> bool:
        """Whether this group recorded ``message_id``."""
        ...

    def mark(self, session: Session, d: Delivery, outcome: InboxOutcome, note: str) -> None:
        """Record a message as done without its effects (skipped, discarded)."""
        ...

    def count_redelivery(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        """A duplicate arrived: count it on the original's row (the audit reads this)."""
        ...


class DedupTable(GroupStore, abc.ABC):
    """``DedupRecords`` on ``inbox_messages``: what every dialect shares; safe to share between threads."""

    @abc.abstractmethod
    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """See ``DedupRecords.claim``."""

    def known(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """One statement for the batch: the lookup of messages at or below their key's position."""
        if not deliveries:
            return set()
        m = self.t.inbox_messages
        return set(session.scalars(select(m.c.message_id).where(
            m.c.consumer_group == self.group,
            m.c.message_id.in_([d.message.message_id for d in deliveries]))))

    def is_recorded(self, session: Session, message_id: uuid.UUID) -> bool:
        m = self.t.inbox_messages
        return session.scalar(select(m.c.message_id).where(
            m.c.consumer_group == self.group, m.c.message_id == message_id)) is not None

    def done_row(self, d: Delivery, now: datetime, *, outcome: InboxOutcome = InboxOutcome.PROCESSED,
                 note: str | None = None) -> dict[str, Any]:
        """``d``'s ``inbox_messages`` row, recorded at ``now``."""
        msg = d.message
        return {
            "consumer_group": self.group, "message_id": msg.message_id, "topic": msg.topic,
            "key": msg.key, "seq": msg.seq, "kafka_partition": d.partition,
            "kafka_offset": d.offset, "created_at": msg.created_at,
            "received_at": d.received_at, "processed_at": now, "deliveries": 1,
            "outcome": outcome.value, "note": note,
        }

    def unclaim(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        ids = list(message_ids)
        if ids:
            m = self.t.inbox_messages
            session.execute(delete(m).where(m.c.consumer_group == self.group, m.c.message_id.in_(ids)))

    def mark(self, session: Session, d: Delivery, outcome: InboxOutcome, note: str) -> None:
        m = self.t.inbox_messages
        row = self.done_row(d, utcnow(), outcome=outcome, note=note[:4000])
        session.execute(self.inserts.upsert(m, row, {"outcome": outcome.value, "note": note[:4000]},
                                            [m.c.consumer_group, m.c.message_id]))

    def count_redelivery(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        ids = list(message_ids)
        if ids:
            m = self.t.inbox_messages
            session.execute(
                update(m).where(m.c.consumer_group == self.group, m.c.message_id.in_(ids))
                .values(deliveries=m.c.deliveries + 1)
            )
