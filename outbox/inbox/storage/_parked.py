"""Parked messages (``inbox_parked``): what waits for an operator, per key in seq order.

A message gets here only through ``InboxStorage.park`` (or its batch form
``park_behind``, for the flood of a key parked already), which also marks the
key parked and moves its held messages behind it: ``add`` and ``add_behind``
are the inserts those two compose. An operator's replay reads a page at a
time (``replay_page``) and removes what applied; a discard removes one.

``ParkedTable`` is the store on SQLite and MySQL/MariaDB; PostgreSQL's
(``_pg.PostgresParked``) replaces three statements with faster ones.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Row, delete, func, select, update
from sqlalchemy.orm import Session

from ...core._envelope import utcnow
from .._delivery import Delivery, KeyedDelivery, KeyId
from .._kinds import Reason
from ._inserts import GroupStore
from ._rows import delivery_from_row, stored_row


@dataclass(frozen=True, slots=True)
class ParkedRow:
    """One ``inbox_parked`` row: the message and why it is there."""

    id: int
    delivery: Delivery
    reason: Reason
    error: str | None
    attempts: int
    first_failure_at: datetime
    last_failure_at: datetime


def parked_row(row: Row[Any]) -> ParkedRow:
    """Rebuild an ``inbox_parked`` row: its message taken as received now."""
    return ParkedRow(row.id, delivery_from_row(row, None), Reason(row.reason), row.error, row.attempts,
                     row.first_failure_at, row.last_failure_at)


class ParkedMessages(Protocol):
    """The parked messages of one group; every method runs in the caller's transaction."""

    def add(self, session: Session, d: Delivery, reason: Reason, at: datetime, *,
            error: str | None = None, traceback: str | None = None, attempts: int = 0) -> None:
        """Store ``d`` (``InboxStorage.park``'s insert: call that); one parked already stays as it is."""
        ...

    def add_behind(self, session: Session, deliveries: Sequence[KeyedDelivery]) -> None:
        """Store arrivals of parked keys (``KEY_PARKED``) in one statement (``InboxStorage.park_behind``)."""
        ...

    def rows(self, session: Session, topic: str | None = None, key: str | None = None,
             *, replayable: bool = False, limit: int | None = None) -> list[ParkedRow]:
        """Parked messages of the group (one topic / key), per key in seq order.

        ``replayable`` with a ``topic`` selects one key's replayable rows, or
        the topic's unkeyed ones when ``key`` is None; foreign records are never
        replayable.
        """
        ...

    def replayable_count(self, session: Session, topic: str, key: str | None) -> int:
        """How many of ``rows(session, topic, key, replayable=True)`` there are, counted by the database."""
        ...

    def replay_page(self, session: Session, topic: str, key: str | None, limit: int) -> list[ParkedRow]:
        """The first ``limit`` replayable rows of one key (or the topic's unkeyed ones), in replay order."""
        ...

    def by_id(self, session: Session, message_id: uuid.UUID) -> ParkedRow | None:
        """The parked row of ``message_id``, if it is parked."""
        ...

    def count_before(self, session: Session, key: KeyId, seq: int) -> int:
        """How many messages of ``key`` below ``seq`` are parked."""
        ...

    def remove(self, session: Session, row_id: int) -> None:
        """Delete one ``inbox_parked`` row (applied, recorded meanwhile, or discarded)."""
        ...

    def remove_run(self, session: Session, row_ids: Sequence[int]) -> None:
        """Delete the ``inbox_parked`` rows ``row_ids`` (a replayed run), one statement."""
        ...

    def failed_again(self, session: Session, row_id: int, error: str, traceback: str) -> None:
        """A replayed message failed: count the attempt on its row."""
        ...


class ParkedTable(GroupStore):
    """``ParkedMessages`` on ``inbox_parked`` (SQLite, MySQL/MariaDB); safe to share between threads."""

    def add(self, session: Session, d: Delivery, reason: Reason, at: datetime, *,
            error: str | None = None, traceback: str | None = None, attempts: int = 0) -> None:
        row = {**stored_row(d, self.group), "reason": reason.value, "error": error, "traceback": traceback,
               "attempts": attempts, "first_failure_at": d.attempts.first_failure_at or at,
               "last_failure_at": at}
        session.execute(self.inserts.new(self.t.inbox_parked).values(row))

    def add_behind(self, session: Session, deliveries: Sequence[KeyedDelivery]) -> None:
        """One executemany: ``add`` for each would cost a statement per message."""
        if not deliveries:
            return
        now = utcnow()
        rows = [{**stored_row(d, self.group), "reason": Reason.KEY_PARKED.value, "error": None,
                 "traceback": None, "attempts": 0, "first_failure_at": d.attempts.first_failure_at or now,
                 "last_failure_at": now} for d in deliveries]
        session.execute(self.inserts.new(self.t.inbox_parked), rows)

    def rows(self, session: Session, topic: str | None = None, key: str | None = None,
             *, replayable: bool = False, limit: int | None = None) -> list[ParkedRow]:
        p = self.t.inbox_parked
        stmt = select(p).where(*self._filter(topic, key, replayable=replayable))
        stmt = stmt.order_by(p.c.topic, p.c.key, p.c.seq, p.c.id)
        if limit is not None:
            stmt = stmt.limit(limit)
        return [parked_row(r) for r in session.execute(stmt).all()]

    def _filter(self, topic: str | None, key: str | None, *, replayable: bool) -> list[ColumnElement[bool]]:
        p = self.t.inbox_parked
        where = [p.c.consumer_group == self.group]
        if topic is not None:
            where.append(p.c.topic == topic)
        if replayable:
            where += [p.c.key.is_(None) if key is None else p.c.key == key,
                      p.c.reason != Reason.FOREIGN.value]
        elif key is not None:
            where.append(p.c.key == key)
        return where

    def replayable_count(self, session: Session, topic: str, key: str | None) -> int:
        return session.scalar(select(func.count()).select_from(self.t.inbox_parked).where(
            *self._filter(topic, key, replayable=True))) or 0

    def replay_page(self, session: Session, topic: str, key: str | None, limit: int) -> list[ParkedRow]:
        """The first ``limit`` replayable rows of one key, in replay order: seq order, or, on a key
        whose rows have seqs and rows have none, arrival order (``_merged_page``)."""
        if key is not None and self._mixed(session, topic, key):
            return self._merged_page(session, topic, key, limit)
        return self._seq_page(session, topic, key, limit)

    def _seq_page(self, session: Session, topic: str, key: str | None, limit: int) -> list[ParkedRow]:
        """What ``rows(…, replayable=True, limit=limit)`` returns.

        On SQLite the index on (group, topic, key, seq) ends with the rowid,
        which is the id, so the (seq, id) order is the index's. MySQL/MariaDB
        keep this query: InnoDB's secondary indexes end with the primary key
        too, but its plan for a long key was not measured.
        """
        return self.rows(session, topic, key, replayable=True, limit=limit)

    def _mixed(self, session: Session, topic: str, key: str) -> bool:
        """Whether the key's replayable rows have seqs (ours) and rows have none (a Debezium event,
        a CloudEvent): one key string written by two producers.

        The first seq in each direction of the key's index: every database puts
        NULLs at one end (PostgreSQL last, SQLite and MySQL first), so on a mixed
        key exactly one of the two is NULL. Two index probes of a row each.
        """
        p = self.t.inbox_parked
        where = self._filter(topic, key, replayable=True)
        ends = [session.execute(select(p.c.seq).where(*where).order_by(order).limit(1)).first()
                for order in (p.c.seq.asc(), p.c.seq.desc())]
        return None not in ends and sum(end[0] is None for end in ends if end is not None) == 1

    def _merged_page(self, session: Session, topic: str, key: str, limit: int) -> list[ParkedRow]:
        """A mixed key's first ``limit`` rows in arrival (id) order, each seq'd place taken by the
        key's seq'd rows in seq order.

        Sorted by (seq, id) instead, the databases put the rows without a seq
        apart (SQLite and MySQL before every seq, PostgreSQL after): an event
        parked behind our failed head replayed before it. In id order alone,
        a seq parked for a gap would go before the missing one that came later.
        """
        p = self.t.inbox_parked
        where = self._filter(topic, key, replayable=True)
        arrived = [parked_row(r) for r in session.execute(select(p).where(*where).order_by(p.c.id)
                                                          .limit(limit)).all()]
        places = sum(1 for row in arrived if row.delivery.message.seq is not None)
        numbered = iter([parked_row(r) for r in session.execute(
            select(p).where(*where, p.c.seq.is_not(None)).order_by(p.c.seq, p.c.id).limit(places)).all()])
        return [next(numbered) if row.delivery.message.seq is not None else row for row in arrived]

    def by_id(self, session: Session, message_id: uuid.UUID) -> ParkedRow | None:
        p = self.t.inbox_parked
        r = session.execute(select(p).where(p.c.consumer_group == self.group,
                                            p.c.message_id == message_id)).first()
        return None if r is None else parked_row(r)

    def count_before(self, session: Session, key: KeyId, seq: int) -> int:
        p = self.t.inbox_parked
        return session.scalar(select(func.count()).select_from(p).where(
            p.c.consumer_group == self.group, p.c.topic == key[0], p.c.key == key[1],
            p.c.seq < seq)) or 0

    def remove(self, session: Session, row_id: int) -> None:
        p = self.t.inbox_parked
        session.execute(delete(p).where(p.c.id == row_id))

    def remove_run(self, session: Session, row_ids: Sequence[int]) -> None:
        if row_ids:
            p = self.t.inbox_parked
            session.execute(delete(p).where(p.c.id.in_(row_ids)))

    def failed_again(self, session: Session, row_id: int, error: str, traceback: str) -> None:
        p = self.t.inbox_parked
        session.execute(update(p).where(p.c.id == row_id).values(
            attempts=p.c.attempts + 1, error=error, traceback=traceback, last_failure_at=utcnow()))
