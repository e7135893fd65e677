"""Held messages (``inbox_held``): messages that arrived ahead of a gap in their key's seqs.

A key holds one message per seq (the unique index the successor lookups
read). A held message is applied right after its predecessor, in the same
transaction (``successors``), or found by the gap sweeper (``ready``,
``stale``), which joins each held row to its key's ``inbox_keys`` row (owned
by ``KeyPositions``) to read the key's position and parked flag in the same
statement.

``successors``' lookup is the per-batch statement, spelled per dialect
(``_sqlite``, ``_pg``, ``_mysql``); the rest is ``HeldTable``'s, shared.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Protocol, cast

from sqlalchemy import Row, and_, delete, func, select
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from ...core._engine import EACH_RUN
from .._delivery import Delivery, KeyId, OrderedDelivery
from ._inserts import GroupStore
from ._rows import held_from_row, stored_row


class HeldMessages(Protocol):
    """The held messages of one group; every method runs in the caller's transaction."""

    def hold(self, session: Session, d: Delivery) -> OrderedDelivery | None:
        """Store ``d``; the other message already held at its seq, if one is.

        A second copy of the held message is a redelivery and changes nothing;
        another id at that seq — the same seq sent twice, or a rebuilt
        producer's — is returned for the caller to settle, because the insert
        leaves it out and it would otherwise vanish. The caller holds the
        key's lock, so the held row cannot change under this check.
        """
        ...

    def successors(self, session: Session,
                   ranges: dict[KeyId, tuple[int, int]]) -> list[OrderedDelivery]:
        """Held messages of each key with ``first <= seq <= last``, in seq order.

        The caller asks from the first seq its transaction applied to the key's
        next one: a held copy of a message the transaction just applied from a
        fresh delivery must be deleted (it is a duplicate now), and the next one
        may be applied in the same transaction.
        """
        ...

    def ready(self, session: Session, limit: int) -> list[OrderedDelivery]:
        """Held messages whose gap has filled but that nobody picked up (e.g. filled elsewhere)."""
        ...

    def stale(self, session: Session, before: datetime) -> list[KeyId]:
        """Unparked keys whose oldest held message has waited since before ``before``."""
        ...

    def of_key(self, session: Session, key: KeyId) -> list[OrderedDelivery]:
        """The held messages of ``key``, in seq order."""
        ...

    def remove(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        """Delete the held rows of ``message_ids`` (applied, duplicates, or parked)."""
        ...


class HeldTable(GroupStore, abc.ABC):
    """``HeldMessages`` on ``inbox_held``: what every dialect shares; safe to share between threads."""

    @abc.abstractmethod
    def _rows(self, session: Session, ranges: dict[KeyId, tuple[int, int]]) -> Sequence[Row[Any]]:
        """``inbox_held`` rows of each key with ``first <= seq <= last``, in any order."""

    def hold(self, session: Session, d: Delivery) -> OrderedDelivery | None:
        h = self.t.inbox_held
        row = {**stored_row(d, self.group), "received_at": d.received_at}
        result = cast(CursorResult[Any], session.execute(self.inserts.new(h).values(row)))
        if result.rowcount == 1 and self.inserts.counts_exactly:
            return None
        # inbox_held is mostly empty, and VACUUM cuts it to no page: planned at every run
        # (``PLANNED_EACH_RUN``), as the delete in ``remove`` and PostgreSQL's successors.
        holder = session.execute(select(h).where(
            h.c.consumer_group == self.group, h.c.topic == d.message.topic,
            h.c.key == d.message.key, h.c.seq == d.message.seq).execution_options(**EACH_RUN)).one_or_none()
        if holder is None or holder.message_id == d.message.message_id:
            return None  # held already (None: its id is held at another seq: one id, one message)
        return held_from_row(holder)

    def successors(self, session: Session,
                   ranges: dict[KeyId, tuple[int, int]]) -> list[OrderedDelivery]:
        if not ranges:
            return []
        rows = self._rows(session, ranges)
        return sorted((held_from_row(r) for r in rows), key=lambda d: d.seq)

    def ready(self, session: Session, limit: int) -> list[OrderedDelivery]:
        h, k = self.t.inbox_held, self.t.inbox_keys
        rows = session.execute(
            select(h).join(k, and_(k.c.consumer_group == h.c.consumer_group,
                                   k.c.topic == h.c.topic, k.c.key == h.c.key))
            .where(h.c.consumer_group == self.group, h.c.seq == k.c.last_seq + 1,
                   k.c.parked.is_(False))
            .limit(limit)
        )
        return [held_from_row(r) for r in rows]

    def stale(self, session: Session, before: datetime) -> list[KeyId]:
        h, k = self.t.inbox_held, self.t.inbox_keys
        rows = session.execute(
            select(h.c.topic, h.c.key)
            .join(k, and_(k.c.consumer_group == h.c.consumer_group,
                          k.c.topic == h.c.topic, k.c.key == h.c.key))
            .where(h.c.consumer_group == self.group, k.c.parked.is_(False))
            .group_by(h.c.topic, h.c.key)
            .having(func.min(h.c.received_at) < before)
        )
        return [(r.topic, r.key) for r in rows]

    def of_key(self, session: Session, key: KeyId) -> list[OrderedDelivery]:
        h = self.t.inbox_held
        rows = session.execute(select(h).where(
            h.c.consumer_group == self.group, h.c.topic == key[0], h.c.key == key[1]
        ).order_by(h.c.seq))
        return [held_from_row(r) for r in rows]

    def remove(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        ids = list(message_ids)
        if ids:
            h = self.t.inbox_held
            session.execute(delete(h).where(h.c.consumer_group == self.group, h.c.message_id.in_(ids))
                            .execution_options(**EACH_RUN))
