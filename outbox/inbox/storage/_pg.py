"""The inbox's stores on PostgreSQL: per-batch statements with a constant text and a stable plan.

Each statement takes one array per column (``_pg_arrays``), so its text does
not change with the batch size: psycopg caches it and prepares it after a few
runs. Each walks the batch's rows and probes a unique index per row (a
LATERAL subquery, or an INSERT's conflict check), so its plan does not depend
on table statistics: the IN-list join it replaces scanned every key of the
group for every batch while the statistics of a young table said it was
empty.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    ARRAY,
    JSON,
    BigInteger,
    DateTime,
    Integer,
    LargeBinary,
    Row,
    Text,
    Uuid,
    any_,
    bindparam,
    cast,
    delete,
    false,
    func,
    literal,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeEngine

from ...core._engine import EACH_RUN
from ...core._envelope import utcnow
from ...core._pg_arrays import array_params, int_array, rows_of
from ...core._tables import InboxOutcome, OutboxTables
from .._delivery import Delivery, KeyedDelivery, KeyId
from .._kinds import Reason
from ._dedup import DedupTable
from ._held import HeldTable
from ._inserts import POSTGRES_INSERTS
from ._keys import KeysTable, KeyState
from ._parked import ParkedRow, ParkedTable, parked_row
from ._storage import InboxStorage

_KEYS: dict[str, TypeEngine[Any]] = {"topic": Text(), "key": Text()}
_SEQS: dict[str, TypeEngine[Any]] = {**_KEYS, "seq": BigInteger()}
_ADVANCES: dict[str, TypeEngine[Any]] = {**_SEQS, "incarnation": Text()}
_RANGES: dict[str, TypeEngine[Any]] = {**_KEYS, "first": BigInteger(), "last": BigInteger()}
_CLAIMS: dict[str, TypeEngine[Any]] = {
    "message_id": Uuid(), **_SEQS, "kafka_partition": Integer(), "kafka_offset": BigInteger(),
    "created_at": DateTime(timezone=True), "received_at": DateTime(timezone=True),
}

_PARKED_BEHIND: dict[str, TypeEngine[Any]] = {
    "message_id": Uuid(), **_SEQS, "payload": LargeBinary(), "content_type": Text(), "headers": JSON(),
    "created_at": DateTime(timezone=True), "kafka_partition": Integer(), "kafka_offset": BigInteger(),
    "incarnation": Text(), "event_type": Text(), "first_failure_at": DateTime(timezone=True),
}


class PostgresKeys(KeysTable):
    """Locking a batch's keys is one round trip when every key exists (the steady state), three when not."""

    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, POSTGRES_INSERTS)
        k = tables.inbox_keys
        keys, advances = rows_of(_KEYS), rows_of(_ADVANCES)
        locked = (
            select(k.c.topic, k.c.key, k.c.last_seq, k.c.parked, k.c.started_at_seq, k.c.incarnation)
            .where(k.c.consumer_group == group, k.c.topic == keys.c.topic, k.c.key == keys.c.key)
            .with_for_update()
            .lateral("locked")
        )
        # Planned at every run: a plan kept from an empty inbox_keys (new tables ANALYZEd, as
        # after a migration) locked each key through a Seq Scan until autovacuum's ANALYZE.
        self._lock = select(locked).select_from(keys.join(locked, true())).execution_options(**EACH_RUN)
        self._create_keys = insert(k).from_select(
            ["consumer_group", "topic", "key", "last_seq", "parked"],
            select(literal(group), keys.c.topic, keys.c.key, literal(0, BigInteger), false()),
        ).on_conflict_do_nothing()
        # The rows exist and are locked (lock ran first): the upsert only updates.
        upsert = insert(k).from_select(
            ["consumer_group", "topic", "key", "last_seq", "parked", "incarnation"],
            select(literal(group), advances.c.topic, advances.c.key, advances.c.seq, false(),
                   advances.c.incarnation),
        )
        self._advance = upsert.on_conflict_do_update(
            index_elements=[k.c.consumer_group, k.c.topic, k.c.key],
            set_={"last_seq": upsert.excluded.last_seq,
                  "incarnation": func.coalesce(upsert.excluded.incarnation, k.c.incarnation)},
        )

    def lock(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        rows = list(session.execute(self._lock, _key_params(wanted)).all())
        if len(rows) < len(wanted):
            found = {(r.topic, r.key) for r in rows}
            missing = [key for key in wanted if key not in found]
            session.execute(self._create_keys, _key_params(missing))
            rows.extend(session.execute(self._lock, _key_params(missing)).all())
        return {(r.topic, r.key): KeyState(r.last_seq, r.parked, r.started_at_seq, r.incarnation)
                for r in rows}

    def advance(self, session: Session, seqs: dict[KeyId, int],
                incarnations: Mapping[KeyId, str] | None = None) -> None:
        if not seqs:
            return
        incarnations = incarnations or {}
        session.execute(self._advance, array_params(_ADVANCES, {
            "topic": [t for t, _ in seqs], "key": [key for _, key in seqs],
            "seq": list(seqs.values()), "incarnation": [incarnations.get(key) for key in seqs]}))


class PostgresDedup(DedupTable):
    """``claim`` is one INSERT of one array per column, ``RETURNING`` the ids that were new."""

    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, POSTGRES_INSERTS)
        m, claims, claimed = tables.inbox_messages, rows_of(_CLAIMS), list(_CLAIMS)
        self._claim = insert(m).from_select(
            ["consumer_group", *claimed, "processed_at", "deliveries", "outcome"],
            select(literal(group), *[claims.c[c] for c in claimed],
                   bindparam("now", type_=DateTime(timezone=True)), literal(1),
                   literal(InboxOutcome.PROCESSED.value)),
        ).on_conflict_do_nothing().returning(m.c.message_id)

    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        if not deliveries:
            return set()
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
        return set(session.scalars(self._claim, {**params, "now": utcnow()}))


class PostgresHeld(HeldTable):
    """A batch's successors through one LATERAL probe of the held index per key."""

    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, POSTGRES_INSERTS)
        h, ranges = tables.inbox_held, rows_of(_RANGES)
        successor = select(h).where(
            h.c.consumer_group == group, h.c.topic == ranges.c.topic, h.c.key == ranges.c.key,
            h.c.seq >= ranges.c["first"], h.c.seq <= ranges.c["last"],
        ).lateral("successor")
        self._successors = (select(successor).select_from(ranges.join(successor, true()))
                            .execution_options(**EACH_RUN))

    def _rows(self, session: Session, ranges: dict[KeyId, tuple[int, int]]) -> Sequence[Row[Any]]:
        params = array_params(_RANGES, {
            "topic": [t for t, _ in ranges], "key": [key for _, key in ranges],
            "first": [first for first, _ in ranges.values()],
            "last": [last for _, last in ranges.values()]})
        return session.execute(self._successors, params).all()


class PostgresParked(ParkedTable):
    """A parked key's flood, a replayed run's delete and a replay's page, each bounded on PostgreSQL."""

    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, POSTGRES_INSERTS)
        parked = tables.inbox_parked
        behind, columns = rows_of(_PARKED_BEHIND), list(_PARKED_BEHIND)
        self._add_behind = insert(parked).from_select(
            ["consumer_group", *columns, "reason", "attempts", "last_failure_at"],
            select(literal(group), *[behind.c[c] for c in columns], literal(Reason.KEY_PARKED.value),
                   literal(0), bindparam("now", type_=DateTime(timezone=True))),
        ).on_conflict_do_nothing()
        self._remove_run = delete(parked).where(
            parked.c.id == any_(cast(bindparam("ids", type_=Text()), ARRAY(BigInteger))))

    def add_behind(self, session: Session, deliveries: Sequence[KeyedDelivery]) -> None:
        """One INSERT of one array per column: an executemany sent a statement per message."""
        if not deliveries:
            return
        now = utcnow()
        messages = [d.message for d in deliveries]
        session.execute(self._add_behind, {**array_params(_PARKED_BEHIND, {
            "message_id": [m.message_id for m in messages], "topic": [m.topic for m in messages],
            "key": [m.key for m in messages], "seq": [m.seq for m in messages],
            "payload": ["\\x" + m.payload.hex() for m in messages],
            "content_type": [m.content_type for m in messages],
            "headers": [json.dumps(m.headers) for m in messages],
            "created_at": [m.created_at for m in messages],
            "kafka_partition": [d.partition for d in deliveries],
            "kafka_offset": [d.offset for d in deliveries],
            "incarnation": [m.incarnation for m in messages],
            "event_type": [m.event_type for m in messages],
            "first_failure_at": [d.attempts.first_failure_at or now for d in deliveries],
        }), "now": now})

    def remove_run(self, session: Session, row_ids: Sequence[int]) -> None:
        """One array parameter: the text stays the same whatever the count (an IN list of 500 did not)."""
        if row_ids:
            session.execute(self._remove_run, {"ids": int_array(row_ids)})

    def _seq_page(self, session: Session, topic: str, key: str | None, limit: int) -> list[ParkedRow]:
        """The first ``limit`` replayable rows of one key, in (seq, id) order, sorting about ``limit`` rows.

        PostgreSQL's index on (group, topic, key, seq) gives the seq order but
        not the id that breaks its ties, so ``ORDER BY seq, id LIMIT n`` read
        and sorted every parked row of the key, for every batch: a 200,000-row
        key cost 70 ms a batch. The ``limit``-th smallest seq, read from the
        index in its order, bounds the rows to sort: every row of the first
        ``limit`` has a seq at or below it. A NULL seq (a keyed message without
        one, sorted last) among them falls back to the whole sort.
        """
        if key is None:
            return self.rows(session, topic, key, replayable=True, limit=limit)
        p = self.t.inbox_parked
        mine = (p.c.consumer_group == self.group, p.c.topic == topic, p.c.key == key,
                p.c.reason != Reason.FOREIGN.value)
        seqs = session.scalars(select(p.c.seq).where(*mine).order_by(p.c.seq).limit(limit)).all()
        if len(seqs) < limit or seqs[-1] is None:
            return self.rows(session, topic, key, replayable=True, limit=limit)
        rows = session.execute(select(p).where(*mine, p.c.seq <= seqs[-1])
                               .order_by(p.c.seq, p.c.id).limit(limit)).all()
        return [parked_row(r) for r in rows]


def postgres_storage(tables: OutboxTables, group: str) -> InboxStorage:
    """The inbox's storage of ``group`` on PostgreSQL."""
    return InboxStorage(group, PostgresDedup(tables, group), PostgresKeys(tables, group),
                        PostgresHeld(tables, group), PostgresParked(tables, group))


def _key_params(keys: Sequence[KeyId]) -> dict[str, Any]:
    return array_params(_KEYS, {"topic": [t for t, _ in keys], "key": [key for _, key in keys]})
