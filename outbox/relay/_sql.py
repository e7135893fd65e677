"""The relay's SQL: one fetch and at most three bulk updates per batch.

Every update is fenced: it touches a row only while the row is still pending
and the row's shard lease still names this relay with the epoch it fetched
under. A relay that lost a lease (paused, partitioned, too slow) therefore
changes nothing; what it sent becomes a duplicate, which at-least-once allows.

On PostgreSQL each bulk update is one ``UPDATE … FROM unnest(...)`` statement;
on MySQL and MariaDB one multi-table ``UPDATE`` joined to ``JSON_TABLE(:rows)``
(both have it: MySQL 8.0.4+, MariaDB 10.6+), whose one parameter is the batch as
a JSON array — an executemany of UPDATEs is one round trip per row there;
elsewhere (SQLite, in process) it is one executemany.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    DateTime,
    Integer,
    Select,
    Text,
    and_,
    bindparam,
    cast,
    exists,
    func,
    literal_column,
    or_,
    select,
    union_all,
    update,
)

from .._mysql import MAY_BLOCK, json_rows, json_table
from .._pg_arrays import array_params, rows_of
from .._tables import MYSQL_FAMILY, OutboxStatus, OutboxTables

ROW_COLUMNS = (
    "id", "message_id", "topic", "key", "seq", "shard", "payload", "content_type", "headers",
    "created_at", "available_at", "attempts", "event_type",
)


@dataclass(slots=True)
class Marks:
    """Per-row values of one bulk update, as parallel lists (ids[i] goes with epochs[i] …)."""

    ids: list[int]
    shards: list[int]
    epochs: list[int]
    values: dict[str, list[Any]]


@functools.lru_cache(maxsize=64)
def statements_for(tables: OutboxTables, dialect: str) -> RelayStatements:
    """The statements of ``tables`` on ``dialect``, built once and shared by every relay of them.

    They hold no state of a relay (the fetches built per shard set are the same
    for all), so the relays of a ``TenantRelay``, whose tenants share one
    schema-less ``OutboxTables`` under their own ``schema_translate_map``, share
    one set of statement objects and, per database, one compiled form.
    """
    return RelayStatements(tables, dialect)


class RelayStatements:
    """Statements for one ``OutboxTables`` and dialect (``statements_for`` shares them)."""

    def __init__(self, tables: OutboxTables, dialect: str) -> None:
        self.postgres = dialect == "postgresql"
        self.mysql = dialect in MYSQL_FAMILY
        m, leases = tables.messages, tables.leases
        self._m, self._leases = m, leases
        now = bindparam("now", type_=m.c.available_at.type)
        prior = m.alias("prior")
        # An earlier row of the key that must go first and cannot go now: the key waits.
        # The first two conditions repeat the predicate of ix_outbox_key_waits (only
        # failed, delayed or retried rows), so the probe reads that tiny index.
        blocks_now = or_(prior.c.status == OutboxStatus.FAILED,
                         and_(prior.c.status == OutboxStatus.PENDING, prior.c.available_at > now))
        same_key_before = (prior.c.topic == m.c.topic, prior.c.key == m.c.key, prior.c.seq < m.c.seq)
        if self.mysql:
            # There the index's predicate is its generated column (``_mysql``), which the
            # probe names; forced, as the planner prefers ix_outbox_open_key's shorter
            # prefix and would walk every earlier row of the key.
            key_waits = exists(
                select(literal_column("1")).select_from(prior)
                .with_hint(prior, f"FORCE INDEX ({tables.key_waits_index})")
                .where(literal_column(f"prior.{MAY_BLOCK}") == 1, *same_key_before, blocks_now))
        else:
            key_waits = exists().where(
                prior.c.status != OutboxStatus.PUBLISHED,
                or_(prior.c.status == OutboxStatus.FAILED, prior.c.available_at > prior.c.created_at),
                *same_key_before, blocks_now)
        # Due: asked for no delay and never pushed back (both timestamps were written by
        # one host in one statement, so no clock is compared with another), or the time
        # has come. A row that is not due therefore has available_at > created_at and is
        # in ix_outbox_key_waits, where key_waits finds it: whatever the clocks of
        # publishers and relays, a row is fetched only together with (or after) every
        # earlier unpublished row of its key. See "Clocks" in docs/relay.md.
        due = or_(m.c.available_at <= m.c.created_at, m.c.available_at <= now)
        # Headers come as JSON text and are decoded only when not empty (most are):
        # decoding "{}" 5,000 times a batch is measurable. On PostgreSQL the message id
        # comes as its text too, the form the record header carries: the driver's
        # uuid.UUID and str() of it cost a microsecond and a half per row. (Elsewhere
        # the column's text is not that form: SQLite stores 32 hex digits.)
        as_text = {"headers"} | ({"message_id"} if self.postgres else set())
        columns = [cast(m.c[name], Text).label(name) if name in as_text else m.c[name]
                   for name in ROW_COLUMNS]
        if self.mysql:  # 32 hex digits there: dashed in the statement, as cheap as the cast
            parts = [func.substr(m.c.message_id, start, length)
                     for start, length in ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))]
            columns[ROW_COLUMNS.index("message_id")] = func.concat_ws("-", *parts).label("message_id")
        self._columns = columns
        self._due = select(*columns).where(
            m.c.status == OutboxStatus.PENDING, due, or_(m.c.key.is_(None), ~key_waits),
        )
        self._fetch_by_shards: dict[tuple[int, ...], Select[Any]] = {}

    def fetch(self, shards: Iterable[int]) -> Select[Any]:
        """Due rows of ``shards`` in id order; params ``now`` and ``limit``.

        On PostgreSQL one index range scan per shard on the pending index, merged in
        id order, so the scan never walks published rows and stops at ``limit``
        (a single scan in id order filtered by shard walks every published row
        below the first pending one). Elsewhere one filtered scan.
        """
        key = tuple(sorted(shards))
        found = self._fetch_by_shards.get(key)
        if found is not None:
            return found
        m, limit = self._m, bindparam("limit", type_=Integer())
        if self.postgres:
            # "busy": ids whose outcome is still being written (pipelined batches).
            # NOT IN (SELECT …) becomes a hashed subplan; "<> ALL(array)" compared every
            # row with every busy id.
            busy_ids = select(func.unnest(cast(bindparam("busy", type_=Text()), ARRAY(BigInteger))))
            busy = m.c.id.not_in(busy_ids.scalar_subquery())
            parts = [self._due.where(m.c.shard == shard, busy).order_by(m.c.id).limit(limit)
                     for shard in key]
            merged = union_all(*parts).subquery("due")
            found = select(merged).order_by(merged.c.id).limit(limit)
        else:
            found = self._due.where(m.c.shard.in_(key)).order_by(m.c.id).limit(limit)
        if len(self._fetch_by_shards) > 64:
            self._fetch_by_shards.clear()
        self._fetch_by_shards[key] = found
        return found

    # -- rows the fetch cannot read (``_unreadable``) ---------------------------

    def due_ids(self, shards: Iterable[int]) -> Select[Any]:
        """The ids and shards of what ``fetch`` returns (same params): integers always read."""
        due = self.fetch(shards).subquery("due_rows")
        return select(due.c.id, due.c.shard).order_by(due.c.id)

    def row(self) -> Select[Any]:
        """One row by ``id``, with ``fetch``'s columns."""
        return select(*self._columns).where(self._m.c.id == bindparam("id"))

    def row_field(self, name: str) -> Select[Any]:
        """One column of one row by ``id``, as text where the fetch reads it so."""
        column = self._columns[ROW_COLUMNS.index(name)]
        return select(column).where(self._m.c.id == bindparam("id"))

    # -- bulk, fenced updates ----------------------------------------------

    def mark(self, conn: Connection, owner: str, marks: Marks, set_: dict[str, Any],
             *, per_row: dict[str, Any]) -> int:
        """Apply ``set_`` (constants) and ``per_row`` (column -> type) to the fenced rows.

        Returns how many rows changed; rows whose lease moved on are left alone.
        """
        if not marks.ids:
            return 0
        m, leases = self._m, self._leases
        if self.postgres:
            arrays = {"id": BigInteger(), "shard": Integer(), "epoch": BigInteger(), **per_row}
            rows = rows_of(arrays)
            # The fence names only v's columns, so PostgreSQL checks it per incoming row
            # and then finds each row by primary key (a fence on m.shard made it scan
            # every pending row of the owned shards).
            fenced = exists().where(
                leases.c.shard == rows.c.shard, leases.c.owner == owner, leases.c.epoch == rows.c.epoch
            )
            stmt = (
                update(m)
                .where(m.c.id == rows.c.id, m.c.shard == rows.c.shard,
                       m.c.status == OutboxStatus.PENDING, fenced)
                .values(**set_, **{name: rows.c[name] for name in per_row})
            )
            params = array_params(arrays, {"id": marks.ids, "shard": marks.shards,
                                           "epoch": marks.epochs, **marks.values})
            return conn.execute(stmt, params).rowcount
        if self.mysql:
            return self._mark_mysql(conn, owner, marks, set_, per_row)
        fenced = exists().where(
            leases.c.shard == m.c.shard, leases.c.owner == owner,
            leases.c.epoch == bindparam("b_epoch"),
        )
        stmt = (
            update(m)
            .where(m.c.id == bindparam("b_id"), m.c.status == OutboxStatus.PENDING, fenced)
            .values(**set_, **{name: bindparam(f"b_{name}") for name in per_row})
        )
        rows_params = [
            {"b_id": row_id, "b_epoch": epoch,
             **{f"b_{name}": values[i] for name, values in marks.values.items()}}
            for i, (row_id, epoch) in enumerate(zip(marks.ids, marks.epochs, strict=True))
        ]
        return conn.execute(stmt, rows_params).rowcount

    def _mark_mysql(self, conn: Connection, owner: str, marks: Marks, set_: dict[str, Any],
                    per_row: dict[str, Any]) -> int:
        m, leases = self._m, self._leases
        rows = json_table("rows", {"id": BigInteger(), "shard": Integer(), "epoch": BigInteger(), **per_row},
                          name="v")
        fenced = exists().where(
            leases.c.shard == rows.c.shard, leases.c.owner == owner, leases.c.epoch == rows.c.epoch
        )
        stmt = (
            update(m)
            .where(m.c.id == rows.c.id, m.c.status == OutboxStatus.PENDING, fenced)
            .values(**set_, **{name: rows.c[name] for name in per_row})
        )
        values = [marks.ids, marks.shards, marks.epochs, *(marks.values[name] for name in per_row)]
        return conn.execute(stmt, {"rows": json_rows(zip(*values, strict=True))}).rowcount

    def published(self, conn: Connection, owner: str, marks: Marks, now: datetime) -> int:
        m = self._m
        return self.mark(
            conn, owner, marks,
            {"status": OutboxStatus.PUBLISHED, "published_at": now, "attempts": m.c.attempts + 1},
            per_row={"kafka_partition": Integer(), "kafka_offset": BigInteger()},
        )

    def retried(self, conn: Connection, owner: str, marks: Marks) -> int:
        m = self._m
        return self.mark(
            conn, owner, marks, {"attempts": m.c.attempts + 1},
            per_row={"available_at": DateTime(timezone=True), "last_error": Text()},
        )

    def postponed(self, conn: Connection, owner: str, marks: Marks) -> int:
        """Like ``retried`` without counting an attempt: the broker was unreachable (an outage)."""
        return self.mark(
            conn, owner, marks, {},
            per_row={"available_at": DateTime(timezone=True), "last_error": Text()},
        )

    def failed(self, conn: Connection, owner: str, marks: Marks) -> int:
        m = self._m
        return self.mark(
            conn, owner, marks, {"status": OutboxStatus.FAILED, "attempts": m.c.attempts + 1},
            per_row={"last_error": Text()},
        )


def empty_marks() -> Marks:
    return Marks([], [], [], {})


def add_mark(marks: Marks, row_id: int, shard: int, epoch: int, **values: Any) -> None:
    marks.ids.append(row_id)
    marks.shards.append(shard)
    marks.epochs.append(epoch)
    for name, value in values.items():
        marks.values.setdefault(name, []).append(value)
