"""The inbox's SQL: key state, dedup records, held and parked rows of one consumer group.

Every method runs inside the caller's transaction and never commits. Ordering
rests on one rule: a transaction that reads or changes a key's state first
locks the key's ``inbox_keys`` row (``SELECT … FOR UPDATE`` on PostgreSQL;
SQLite's ``BEGIN IMMEDIATE`` already serialises writers), so two consumers
that briefly both hold a partition during a rebalance still apply a key's
messages one at a time, in seq order.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Integer,
    Row,
    Table,
    Text,
    Uuid,
    and_,
    bindparam,
    delete,
    false,
    func,
    literal,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ._envelope import Message, utcnow
from ._inbox_delivery import Delivery
from ._pg_arrays import array_params, rows_of
from ._tables import PROCESSED, OutboxTables

KeyId = tuple[str, str]

GAP, FAILED, KEY_PARKED = "gap", "failed", "key_parked"

# Per-batch statements on PostgreSQL take one array per column (see _pg_arrays).
_KEYS = {"topic": Text(), "key": Text()}
_SEQS = {**_KEYS, "seq": BigInteger()}
_CLAIMS = {"message_id": Uuid(), **_SEQS, "kafka_partition": Integer(), "kafka_offset": BigInteger(),
           "created_at": DateTime(timezone=True), "received_at": DateTime(timezone=True)}


@dataclass(slots=True)
class KeyState:
    last_seq: int
    parked: bool


class InboxStore:
    """Statements for one group on one dialect; safe to share between threads."""

    def __init__(self, tables: OutboxTables, group: str, dialect: str) -> None:
        self.t = tables
        self.group = group
        self._postgres = dialect == "postgresql"
        self._insert = (postgresql if self._postgres else sqlite).insert
        k, m, h = tables.inbox_keys, tables.inbox_messages, tables.inbox_held
        if not self._postgres:
            self._set_last_seq = (
                update(k)
                .where(k.c.consumer_group == group, k.c.topic == bindparam("b_topic"),
                       k.c.key == bindparam("b_key"))
                .values(last_seq=bindparam("b_seq"))
            )
            return
        # Each per-batch statement walks the batch's rows and probes a unique index
        # per row (a LATERAL subquery, or an INSERT's conflict check), so its plan
        # does not depend on table statistics: a join the planner may order either
        # way scanned every key of the group per batch while the statistics of a
        # young table said it was empty.
        keys, seqs, claims = rows_of(_KEYS), rows_of(_SEQS), rows_of(_CLAIMS)
        locked = (
            select(k.c.topic, k.c.key, k.c.last_seq, k.c.parked)
            .where(k.c.consumer_group == group, k.c.topic == keys.c.topic, k.c.key == keys.c.key)
            .with_for_update()
            .lateral("locked")
        )
        self._lock_keys = select(locked).select_from(keys.join(locked, true()))
        self._create_keys = self._insert(k).from_select(
            ["consumer_group", "topic", "key", "last_seq", "parked"],
            select(literal(group), keys.c.topic, keys.c.key, literal(0, BigInteger), false()),
        ).on_conflict_do_nothing()
        claimed = ["message_id", "topic", "key", "seq", "kafka_partition", "kafka_offset",
                   "created_at", "received_at"]
        self._claim = self._insert(m).from_select(
            ["consumer_group", *claimed, "processed_at", "deliveries", "outcome"],
            select(literal(group), *[claims.c[c] for c in claimed],
                   bindparam("now", type_=DateTime(timezone=True)), literal(1), literal(PROCESSED)),
        ).on_conflict_do_nothing().returning(m.c.message_id)
        # The rows exist and are locked (lock_keys ran first): the upsert only updates.
        upsert = self._insert(k).from_select(
            ["consumer_group", "topic", "key", "last_seq", "parked"],
            select(literal(group), seqs.c.topic, seqs.c.key, seqs.c.seq, false()),
        )
        self._set_last_seq = upsert.on_conflict_do_update(
            index_elements=[k.c.consumer_group, k.c.topic, k.c.key],
            set_={"last_seq": upsert.excluded.last_seq},
        )
        successor = select(h).where(
            h.c.consumer_group == group, h.c.topic == seqs.c.topic, h.c.key == seqs.c.key,
            h.c.seq == seqs.c.seq,
        ).lateral("successor")
        self._successors = select(successor).select_from(seqs.join(successor, true()))

    # -- key state ------------------------------------------------------------

    def lock_keys(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        """Lock and read the state of ``keys``, creating missing ones at seq 0."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        if self._postgres:
            return self._lock_keys_pg(session, wanted)
        states = self._select_keys(session, wanted)
        missing = [key for key in wanted if key not in states]
        if missing:
            k = self.t.inbox_keys
            session.execute(
                self._insert(k).on_conflict_do_nothing(),
                [{"consumer_group": self.group, "topic": t, "key": key, "last_seq": 0,
                  "parked": False} for t, key in missing],
            )
            states |= self._select_keys(session, missing)
        return states

    def _lock_keys_pg(self, session: Session, wanted: list[KeyId]) -> dict[KeyId, KeyState]:
        """One round trip when every key exists (the steady state), three when some are new.

        Keys are locked in the order given (sorted), so two consumers that
        briefly share a partition cannot deadlock on them.
        """
        params = _key_params(wanted)
        states = {(r.topic, r.key): KeyState(r.last_seq, r.parked)
                  for r in session.execute(self._lock_keys, params)}
        if len(states) < len(wanted):
            missing = [key for key in wanted if key not in states]
            session.execute(self._create_keys, _key_params(missing))
            states |= {(r.topic, r.key): KeyState(r.last_seq, r.parked)
                       for r in session.execute(self._lock_keys, _key_params(missing))}
        return states

    def _select_keys(self, session: Session, keys: Sequence[KeyId]) -> dict[KeyId, KeyState]:
        k = self.t.inbox_keys
        stmt = (
            select(k.c.topic, k.c.key, k.c.last_seq, k.c.parked)
            .where(k.c.consumer_group == self.group, tuple_(k.c.topic, k.c.key).in_(keys))
            .order_by(k.c.topic, k.c.key)
        )
        return {(r.topic, r.key): KeyState(r.last_seq, r.parked) for r in session.execute(stmt)}

    def set_last_seq(self, session: Session, seqs: dict[KeyId, int]) -> None:
        if not seqs:
            return
        if self._postgres:
            session.execute(self._set_last_seq, _seq_params(seqs))
            return
        session.execute(self._set_last_seq, [
            {"b_topic": t, "b_key": key, "b_seq": seq} for (t, key), seq in seqs.items()
        ])

    def park_key(self, session: Session, key: KeyId, reason: str) -> None:
        k = self.t.inbox_keys
        session.execute(
            update(k)
            .where(k.c.consumer_group == self.group, k.c.topic == key[0], k.c.key == key[1])
            .values(parked=True, parked_reason=reason[:2000], parked_at=utcnow())
        )

    def unpark_key(self, session: Session, key: KeyId, *, last_seq: int) -> None:
        k = self.t.inbox_keys
        session.execute(
            update(k)
            .where(k.c.consumer_group == self.group, k.c.topic == key[0], k.c.key == key[1])
            .values(parked=False, parked_reason=None, parked_at=None, last_seq=last_seq)
        )

    # -- dedup records ----------------------------------------------------------

    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        """Insert the dedup rows; returns the ids that were new (the rest are duplicates)."""
        if not deliveries:
            return set()
        m = self.t.inbox_messages
        now = utcnow()
        if self._postgres:
            messages = [d.message for d in deliveries]
            params = array_params(_CLAIMS, {
                "message_id": [msg.message_id for msg in messages],
                "topic": [msg.topic for msg in messages], "key": [msg.key for msg in messages],
                "seq": [msg.seq for msg in messages],
                "kafka_partition": [d.partition for d in deliveries],
                "kafka_offset": [d.offset for d in deliveries],
                "created_at": [msg.created_at for msg in messages],
                "received_at": [d.received_at for d in deliveries],
            })
            return set(session.scalars(self._claim, {**params, "now": now}))
        rows = [self._done_row(d, now) for d in deliveries]
        stmt = self._insert(m).on_conflict_do_nothing().returning(m.c.message_id)
        return set(session.scalars(stmt, rows))

    def _done_row(self, d: Delivery, now: datetime, *, outcome: str = PROCESSED,
                  note: str | None = None) -> dict[str, Any]:
        msg = d.message
        return {
            "consumer_group": self.group, "message_id": msg.message_id, "topic": msg.topic,
            "key": msg.key, "seq": msg.seq, "kafka_partition": d.partition,
            "kafka_offset": d.offset, "created_at": msg.created_at,
            "received_at": d.received_at, "processed_at": now, "deliveries": 1,
            "outcome": outcome, "note": note,
        }

    def unclaim(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        self._delete_ids(session, self.t.inbox_messages, message_ids)

    def _delete_ids(self, session: Session, table: Table, message_ids: Iterable[uuid.UUID]) -> None:
        ids = list(message_ids)
        if ids:
            session.execute(delete(table).where(table.c.consumer_group == self.group,
                                                table.c.message_id.in_(ids)))

    def mark(self, session: Session, d: Delivery, outcome: str, note: str) -> None:
        """Record a message as done without its effects (skipped, discarded)."""
        m = self.t.inbox_messages
        session.execute(self._insert(m).values(self._done_row(d, utcnow(), outcome=outcome,
                                                              note=note[:4000]))
                        .on_conflict_do_update(index_elements=[m.c.consumer_group, m.c.message_id],
                                               set_={"outcome": outcome, "note": note[:4000]}))

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

    def hold(self, session: Session, d: Delivery) -> None:
        h = self.t.inbox_held
        row = {**self._stored(d), "received_at": d.received_at}
        session.execute(self._insert(h).values(row).on_conflict_do_nothing())

    def successors(self, session: Session, next_seqs: dict[KeyId, int]) -> list[Delivery]:
        """Held messages that are now next in their key (``seq == last_seq + 1``)."""
        if not next_seqs:
            return []
        if self._postgres:
            rows = session.execute(self._successors, _seq_params(next_seqs))
            return [delivery_from_row(r, from_held=True) for r in rows]
        h = self.t.inbox_held
        wanted = [(t, key, seq) for (t, key), seq in next_seqs.items()]
        rows = session.execute(select(h).where(
            h.c.consumer_group == self.group, tuple_(h.c.topic, h.c.key, h.c.seq).in_(wanted)))
        return [delivery_from_row(r, from_held=True) for r in rows]

    def ready_held(self, session: Session, limit: int) -> list[Delivery]:
        """Held messages whose gap has filled but that nobody picked up (e.g. filled elsewhere)."""
        h, k = self.t.inbox_held, self.t.inbox_keys
        rows = session.execute(
            select(h).join(k, and_(k.c.consumer_group == h.c.consumer_group,
                                   k.c.topic == h.c.topic, k.c.key == h.c.key))
            .where(h.c.consumer_group == self.group, h.c.seq == k.c.last_seq + 1,
                   k.c.parked.is_(False))
            .limit(limit)
        )
        return [delivery_from_row(r, from_held=True) for r in rows]

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

    def held_of(self, session: Session, key: KeyId) -> list[Delivery]:
        h = self.t.inbox_held
        rows = session.execute(select(h).where(
            h.c.consumer_group == self.group, h.c.topic == key[0], h.c.key == key[1]
        ).order_by(h.c.seq))
        return [delivery_from_row(r, from_held=True) for r in rows]

    def unhold(self, session: Session, message_ids: Iterable[uuid.UUID]) -> None:
        self._delete_ids(session, self.t.inbox_held, message_ids)

    # -- parked -----------------------------------------------------------------

    def park(self, session: Session, d: Delivery, *, reason: str, error: str | None = None,
             traceback: str | None = None, attempts: int = 0,
             first_failure_at: datetime | None = None) -> None:
        """Store ``d`` in ``inbox_parked`` (a second park of the same message is a no-op)."""
        now = utcnow()
        p = self.t.inbox_parked
        row = {**self._stored(d), "reason": reason, "error": error, "traceback": traceback,
               "attempts": attempts, "first_failure_at": first_failure_at or now,
               "last_failure_at": now}
        session.execute(self._insert(p).values(row).on_conflict_do_nothing())
        if d.from_held:
            self.unhold(session, [d.message.message_id])

    def _stored(self, d: Delivery) -> dict[str, Any]:
        msg = d.message
        return {
            "consumer_group": self.group, "message_id": msg.message_id, "topic": msg.topic,
            "key": msg.key, "seq": msg.seq, "payload": msg.payload,
            "content_type": msg.content_type, "headers": msg.headers,
            "created_at": msg.created_at, "kafka_partition": d.partition,
            "kafka_offset": d.offset,
        }


def _key_params(keys: Sequence[KeyId]) -> dict[str, Any]:
    return array_params(_KEYS, {"topic": [t for t, _ in keys], "key": [key for _, key in keys]})


def _seq_params(seqs: dict[KeyId, int]) -> dict[str, Any]:
    return array_params(_SEQS, {"topic": [t for t, _ in seqs], "key": [key for _, key in seqs],
                                "seq": list(seqs.values())})


def delivery_from_row(row: Row[Any], *, from_held: bool = False) -> Delivery:
    """Rebuild a delivery from an ``inbox_held`` or ``inbox_parked`` row."""
    message = Message.model_construct(
        message_id=row.message_id, topic=row.topic, key=row.key, seq=row.seq,
        payload=row.payload, content_type=row.content_type, headers=row.headers or {},
        created_at=row.created_at, available_at=row.created_at,
    )
    received = getattr(row, "received_at", None) or utcnow()
    return Delivery(message, row.kafka_partition, row.kafka_offset, received_at=received,
                    from_held=from_held)

