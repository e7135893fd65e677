"""The inbox's SQL, all of it: key state, dedup records, held and parked rows of one group.

Every method runs inside the caller's transaction and never commits. Ordering
rests on one rule: a transaction that reads or changes a key's state first
locks the key's ``inbox_keys`` row (``SELECT … FOR UPDATE`` on PostgreSQL and
MySQL/MariaDB; SQLite's ``BEGIN IMMEDIATE`` already serialises writers), so two consumers
that briefly both hold a partition during a rebalance still apply a key's
messages one at a time, in seq order.

``park`` is the one way a message enters ``inbox_parked``: with a reason that
stops the key it also marks the key parked and moves the key's held messages
behind it.

``InboxStore`` holds what every database shares; what differs is a subclass
per dialect, chosen once by ``store_for``: ``SQLiteStore`` (``_store_sqlite``),
``PostgresStore`` (``_store_pg``: one array per column, a stable plan) and
``MySQLStore`` (``_store_mysql``: no ``ON CONFLICT``, no ``RETURNING``).
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Insert,
    Row,
    Table,
    and_,
    bindparam,
    delete,
    func,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from .._envelope import Message, utcnow
from .._tables import MYSQL_FAMILY, InboxOutcome, OutboxTables
from ._delivery import Delivery, KeyId, OrderedDelivery, Origin, delivery
from ._kinds import Reason


@dataclass(slots=True)
class KeyState:
    last_seq: int
    parked: bool
    started_at_seq: int | None = None
    incarnation: str | None = None
    """The producer incarnation of the key's last applied message (None: not known)."""

    @property
    def untouched(self) -> bool:
        """Nothing of this key was applied yet, nor was a start point chosen."""
        return self.last_seq == 0 and self.started_at_seq is None


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


class InboxStore(abc.ABC):
    """Statements for one group on one dialect; safe to share between threads.

    The abstract methods are the ones whose SQL differs per dialect.
    """

    inserts_count_exactly = True
    """An INSERT that leaves an existing row alone reports 0 rows (not so on MySQL: ``_store_mysql``)."""

    def __init__(self, tables: OutboxTables, group: str) -> None:
        self.t = tables
        self.group = group
        k = tables.inbox_keys
        self._set_started = (
            update(k)
            .where(k.c.consumer_group == group, k.c.topic == bindparam("b_topic"),
                   k.c.key == bindparam("b_key"))
            .values(started_at_seq=bindparam("b_seq"))
        )

    # -- key state ------------------------------------------------------------

    @abc.abstractmethod
    def lock_keys(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        """Lock and read the state of ``keys``, creating missing ones at seq 0.

        Keys are locked in sorted order, so two transactions cannot deadlock on each other.
        """

    def key_states(self, session: Session, keys: Sequence[KeyId]) -> dict[KeyId, KeyState]:
        """Read (without locking) the state of those of ``keys`` that exist."""
        return self._select_keys(session, keys) if keys else {}

    def _select_keys(self, session: Session, keys: Sequence[KeyId]) -> dict[KeyId, KeyState]:
        k = self.t.inbox_keys
        stmt = (
            select(k.c.topic, k.c.key, k.c.last_seq, k.c.parked, k.c.started_at_seq, k.c.incarnation)
            .where(k.c.consumer_group == self.group, tuple_(k.c.topic, k.c.key).in_(keys))
            .order_by(k.c.topic, k.c.key)
        )
        return {(r.topic, r.key): KeyState(r.last_seq, r.parked, r.started_at_seq, r.incarnation)
                for r in session.execute(stmt)}

    @abc.abstractmethod
    def set_last_seq(self, session: Session, seqs: dict[KeyId, int],
                     incarnations: Mapping[KeyId, str] | None = None) -> None:
        """Advance keys (locked by the caller) to ``seqs``, in one statement.

        A key in ``incarnations`` also records the producer incarnation its
        message came from; the others keep theirs.
        """

    def set_started(self, session: Session, starts: dict[KeyId, int]) -> None:
        """Record the seq at which keys started (start policy ``first_seen``)."""
        if starts:
            session.execute(self._set_started, [
                {"b_topic": t, "b_key": key, "b_seq": seq} for (t, key), seq in starts.items()
            ])

    def unpark_key(self, session: Session, key: KeyId, *, last_seq: int) -> None:
        k = self.t.inbox_keys
        session.execute(
            update(k)
            .where(k.c.consumer_group == self.group, k.c.topic == key[0], k.c.key == key[1])
            .values(parked=False, parked_reason=None, parked_at=None, last_seq=last_seq)
        )

    def parked_key_count(self, session: Session) -> int:
        k = self.t.inbox_keys
        return session.scalar(select(func.count()).where(
            k.c.consumer_group == self.group, k.c.parked.is_(True))) or 0

    # -- dedup records ----------------------------------------------------------

    @abc.abstractmethod
    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """Insert the dedup rows; returns the ids that were new (the rest are duplicates).

        ``deliveries`` must not repeat a message id: two copies in one statement
        would both look new to the caller.
        """

    @abc.abstractmethod
    def _insert_new(self, table: Table) -> Insert:
        """An INSERT that leaves a row with the same unique key as it is."""

    @abc.abstractmethod
    def _record_done(self, session: Session, row: dict[str, Any], changes: dict[str, Any]) -> None:
        """Insert a dedup row, or apply ``changes`` to the one already there."""

    def known(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """The ids of ``deliveries`` this group recorded already (applied, skipped, discarded).

        One statement for the batch: the lookup of messages at or below their
        key's position, which only a recorded id makes duplicates.
        """
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

    def _done_row(self, d: Delivery, now: datetime, *, outcome: InboxOutcome = InboxOutcome.PROCESSED,
                  note: str | None = None) -> dict[str, Any]:
        msg = d.message
        return {
            "consumer_group": self.group, "message_id": msg.message_id, "topic": msg.topic,
            "key": msg.key, "seq": msg.seq, "kafka_partition": d.partition,
            "kafka_offset": d.offset, "created_at": msg.created_at,
            "received_at": d.received_at, "processed_at": now, "deliveries": 1,
            "outcome": outcome.value, "note": note,
        }

    def unclaim(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        self._delete_ids(session, self.t.inbox_messages, message_ids)

    def _delete_ids(self, session: Session, table: Table, message_ids: Iterable[uuid.UUID]) -> None:
        ids = list(message_ids)
        if ids:
            session.execute(delete(table).where(table.c.consumer_group == self.group,
                                                table.c.message_id.in_(ids)))

    def mark(self, session: Session, d: Delivery, outcome: InboxOutcome, note: str) -> None:
        """Record a message as done without its effects (skipped, discarded)."""
        row = self._done_row(d, utcnow(), outcome=outcome, note=note[:4000])
        self._record_done(session, row, {"outcome": outcome.value, "note": note[:4000]})

    def count_redelivery(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        """A duplicate arrived: count it on the original's row (the audit reads this)."""
        ids = list(message_ids)
        if ids:
            m = self.t.inbox_messages
            session.execute(
                update(m).where(m.c.consumer_group == self.group, m.c.message_id.in_(ids))
                .values(deliveries=m.c.deliveries + 1)
            )

    # -- held -------------------------------------------------------------------

    def hold(self, session: Session, d: Delivery) -> OrderedDelivery | None:
        """Store ``d`` in ``inbox_held``; the other message already held at its seq, if one is.

        A key holds one message per seq (the unique index the successor
        lookups read). A second copy of the held message is a redelivery and
        changes nothing; another id at that seq — the same seq sent twice, or a
        rebuilt producer's — is returned for the caller to settle, because the
        insert leaves it out and it would otherwise vanish. The caller holds
        the key's lock, so the held row cannot change under this check.
        """
        h = self.t.inbox_held
        row = {**self._stored(d), "received_at": d.received_at}
        result = cast(CursorResult[Any], session.execute(self._insert_new(h).values(row)))
        if result.rowcount == 1 and self.inserts_count_exactly:
            return None
        holder = session.execute(select(h).where(
            h.c.consumer_group == self.group, h.c.topic == d.message.topic,
            h.c.key == d.message.key, h.c.seq == d.message.seq)).one_or_none()
        if holder is None or holder.message_id == d.message.message_id:
            return None  # held already (None: its id is held at another seq: one id, one message)
        return held_from_row(holder)

    def successors(self, session: Session,
                   ranges: dict[KeyId, tuple[int, int]]) -> list[OrderedDelivery]:
        """Held messages of each key with ``first <= seq <= last``, in seq order.

        The caller asks from the first seq its transaction applied to the key's
        next one: a held copy of a message the transaction just applied from a
        fresh delivery must be deleted (it is a duplicate now), and the next one
        may be applied in the same transaction.
        """
        if not ranges:
            return []
        rows = self._held_rows(session, ranges)
        return sorted((held_from_row(r) for r in rows), key=lambda d: d.seq)

    @abc.abstractmethod
    def _held_rows(self, session: Session, ranges: dict[KeyId, tuple[int, int]]) -> Sequence[Row[Any]]:
        """``inbox_held`` rows of each key with ``first <= seq <= last``, in any order."""

    def ready_held(self, session: Session, limit: int) -> list[OrderedDelivery]:
        """Held messages whose gap has filled but that nobody picked up (e.g. filled elsewhere)."""
        h, k = self.t.inbox_held, self.t.inbox_keys
        rows = session.execute(
            select(h).join(k, and_(k.c.consumer_group == h.c.consumer_group,
                                   k.c.topic == h.c.topic, k.c.key == h.c.key))
            .where(h.c.consumer_group == self.group, h.c.seq == k.c.last_seq + 1,
                   k.c.parked.is_(False))
            .limit(limit)
        )
        return [held_from_row(r) for r in rows]

    def stale_gaps(self, session: Session, before: datetime) -> list[KeyId]:
        """Unparked keys whose oldest held message has waited since before ``before``."""
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

    def held_of(self, session: Session, key: KeyId) -> list[OrderedDelivery]:
        h = self.t.inbox_held
        rows = session.execute(select(h).where(
            h.c.consumer_group == self.group, h.c.topic == key[0], h.c.key == key[1]
        ).order_by(h.c.seq))
        return [held_from_row(r) for r in rows]

    def unhold(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        self._delete_ids(session, self.t.inbox_held, message_ids)

    # -- parked -----------------------------------------------------------------

    def park(self, session: Session, d: Delivery, reason: Reason, *, error: str | None = None,
             traceback: str | None = None, attempts: int = 0) -> bool:
        """Store ``d`` in ``inbox_parked``; True when this also parked its key.

        A keyed, ordered message parked for a reason that stops its key
        (``Reason.parks_key``) marks the key parked and moves the key's held
        messages behind it (reason ``KEY_PARKED``). The caller holds the key's
        lock. A second park of the same message is a no-op.
        """
        now = utcnow()
        p = self.t.inbox_parked
        row = {**self._stored(d), "reason": reason.value, "error": error, "traceback": traceback,
               "attempts": attempts, "first_failure_at": d.attempts.first_failure_at or now,
               "last_failure_at": now}
        session.execute(self._insert_new(p).values(row))
        if d.from_held:
            self.unhold(session, [d.message.message_id])
        if not (reason.parks_key and isinstance(d, OrderedDelivery)):
            return False
        key = d.lane
        k = self.t.inbox_keys
        note = f"{reason}: message {d.message.message_id} (seq {d.message.seq}): {error or ''}"
        session.execute(
            update(k)
            .where(k.c.consumer_group == self.group, k.c.topic == key[0], k.c.key == key[1])
            .values(parked=True, parked_reason=note[:2000], parked_at=now)
        )
        for held in self.held_of(session, key):
            if held.message.message_id != d.message.message_id:
                self.park(session, held, Reason.KEY_PARKED)
        return True

    def park_behind(self, session: Session, deliveries: Sequence[OrderedDelivery]) -> None:
        """Store arrivals of parked keys in ``inbox_parked`` (``KEY_PARKED``), one executemany.

        The flood of a parked key is parked at the rate its messages arrive:
        ``park`` for each would cost a statement per message. The caller holds
        the keys' locks; none of ``deliveries`` comes from ``inbox_held``
        (those go through ``park``, which also deletes their held row). A
        message parked already is left as it is.
        """
        if not deliveries:
            return
        now = utcnow()
        rows = [{**self._stored(d), "reason": Reason.KEY_PARKED.value, "error": None, "traceback": None,
                 "attempts": 0, "first_failure_at": d.attempts.first_failure_at or now,
                 "last_failure_at": now} for d in deliveries]
        session.execute(self._insert_new(self.t.inbox_parked), rows)

    def parked(self, session: Session, topic: str | None = None, key: str | None = None,
               *, replayable: bool = False, limit: int | None = None) -> list[ParkedRow]:
        """Parked messages of the group (one topic / key), per key in seq order.

        ``replayable`` with a ``topic`` selects one key's replayable rows, or
        the topic's unkeyed ones when ``key`` is None; foreign records are never
        replayable.
        """
        p = self.t.inbox_parked
        stmt = select(p).where(*self._parked_filter(topic, key, replayable=replayable))
        stmt = stmt.order_by(p.c.topic, p.c.key, p.c.seq, p.c.id)
        if limit is not None:
            stmt = stmt.limit(limit)
        return [parked_row(r) for r in session.execute(stmt).all()]

    def _parked_filter(self, topic: str | None, key: str | None, *,
                       replayable: bool) -> list[ColumnElement[bool]]:
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
        """How many of ``parked(session, topic, key, replayable=True)`` there are, counted by the database."""
        return session.scalar(select(func.count()).select_from(self.t.inbox_parked).where(
            *self._parked_filter(topic, key, replayable=True))) or 0

    def replay_page(self, session: Session, topic: str, key: str | None,
                    limit: int) -> list[ParkedRow]:
        """The first ``limit`` replayable rows of one key (or the topic's unkeyed ones), in replay order.

        What ``parked(…, replayable=True, limit=limit)`` returns. On SQLite the
        index on (group, topic, key, seq) ends with the rowid, which is the id,
        so the (seq, id) order is the index's. PostgreSQL's override bounds its
        sort. MySQL/MariaDB keep this query: InnoDB's secondary indexes end
        with the primary key too, but its plan for a long key was not measured.
        """
        return self.parked(session, topic, key, replayable=True, limit=limit)

    def parked_by_id(self, session: Session, message_id: uuid.UUID) -> ParkedRow | None:
        p = self.t.inbox_parked
        r = session.execute(select(p).where(p.c.consumer_group == self.group,
                                            p.c.message_id == message_id)).first()
        return None if r is None else parked_row(r)

    def parked_before(self, session: Session, key: KeyId, seq: int) -> int:
        """How many messages of ``key`` below ``seq`` are parked."""
        p = self.t.inbox_parked
        return session.scalar(select(func.count()).select_from(p).where(
            p.c.consumer_group == self.group, p.c.topic == key[0], p.c.key == key[1],
            p.c.seq < seq)) or 0

    def unpark(self, session: Session, row_id: int) -> None:
        p = self.t.inbox_parked
        session.execute(delete(p).where(p.c.id == row_id))

    def unpark_rows(self, session: Session, row_ids: Sequence[int]) -> None:
        """Delete the ``inbox_parked`` rows ``row_ids`` (a replayed run), one statement."""
        if row_ids:
            p = self.t.inbox_parked
            session.execute(delete(p).where(p.c.id.in_(row_ids)))

    def failed_again(self, session: Session, row_id: int, error: str, traceback: str) -> None:
        """A replayed message failed: count the attempt on its row."""
        p = self.t.inbox_parked
        session.execute(update(p).where(p.c.id == row_id).values(
            attempts=p.c.attempts + 1, error=error, traceback=traceback, last_failure_at=utcnow()))

    def _stored(self, d: Delivery) -> dict[str, Any]:
        msg = d.message
        return {
            "consumer_group": self.group, "message_id": msg.message_id, "topic": msg.topic,
            "key": msg.key, "seq": msg.seq, "payload": msg.payload,
            "content_type": msg.content_type, "headers": msg.headers,
            "created_at": msg.created_at, "kafka_partition": d.partition,
            "kafka_offset": d.offset, "incarnation": msg.incarnation, "event_type": msg.event_type,
        }


class OnConflictStore(InboxStore):
    """The databases with ``INSERT … ON CONFLICT`` (SQLite, PostgreSQL)."""

    @abc.abstractmethod
    def _insert(self, table: Table) -> postgresql.Insert | sqlite.Insert:
        """This dialect's INSERT, which has ``on_conflict_do_nothing``/``_do_update``."""

    def _insert_new(self, table: Table) -> Insert:
        return self._insert(table).on_conflict_do_nothing()

    def _record_done(self, session: Session, row: dict[str, Any], changes: dict[str, Any]) -> None:
        m = self.t.inbox_messages
        session.execute(self._insert(m).values(row)
                        .on_conflict_do_update(index_elements=[m.c.consumer_group, m.c.message_id],
                                               set_=changes))


def store_for(tables: OutboxTables, group: str, dialect: str) -> InboxStore:
    """The store of ``dialect`` (an engine's ``dialect.name``) for one group."""
    # Imported here: each dialect's module builds on the classes above.
    from ._store_mysql import MySQLStore
    from ._store_pg import PostgresStore
    from ._store_sqlite import SQLiteStore

    if dialect == "postgresql":
        return PostgresStore(tables, group)
    if dialect in MYSQL_FAMILY:
        return MySQLStore(tables, group)
    return SQLiteStore(tables, group)


def delivery_from_row(row: Row[Any], received_at: datetime | None, *,
                      origin: Origin = Origin.PARKED) -> Delivery:
    """Rebuild a delivery from an ``inbox_held`` or ``inbox_parked`` row (received now if None).

    ``received_at`` is passed rather than looked up: a row without the
    column (``inbox_parked``) made the lookup raise and catch, per row.
    """
    message = Message.model_construct(
        message_id=row.message_id, topic=row.topic, key=row.key, seq=row.seq,
        payload=row.payload, content_type=row.content_type, headers=row.headers or {},
        created_at=row.created_at, available_at=row.created_at, incarnation=row.incarnation,
        event_type=row.event_type,
    )
    return delivery(message, row.kafka_partition, row.kafka_offset, received_at, origin=origin)


def parked_row(row: Row[Any]) -> ParkedRow:
    """Rebuild an ``inbox_parked`` row: its message taken as received now."""
    return ParkedRow(row.id, delivery_from_row(row, None), Reason(row.reason), row.error, row.attempts,
                     row.first_failure_at, row.last_failure_at)


def held_from_row(row: Row[Any]) -> OrderedDelivery:
    """Rebuild a delivery from an ``inbox_held`` row: always keyed and numbered (only those are held)."""
    d = delivery_from_row(row, row.received_at, origin=Origin.HELD)
    if not isinstance(d, OrderedDelivery):
        raise AssertionError(f"inbox_held row {row.message_id} has no key or seq")
    return d
