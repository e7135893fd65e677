"""The relay's SQL: one fetch and at most three bulk updates per batch.

Every update is fenced: it touches a row only while the row is still pending
and the row's shard lease still names this relay with the epoch it fetched
under. A relay that lost a lease (paused, partitioned, too slow) therefore
changes nothing; what it sent becomes a duplicate, which at-least-once allows.

On PostgreSQL each bulk update is one ``UPDATE … FROM unnest(...)`` statement;
elsewhere it is one executemany.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    DateTime,
    Integer,
    Text,
    and_,
    bindparam,
    exists,
    func,
    or_,
    select,
    update,
)

from ._tables import FAILED, PENDING, PUBLISHED, OutboxTables

ROW_COLUMNS = (
    "id", "message_id", "topic", "key", "seq", "shard", "payload", "content_type", "headers",
    "created_at", "available_at", "attempts",
)


@dataclass(slots=True)
class Marks:
    """Per-row values of one bulk update, as parallel lists (ids[i] goes with epochs[i] …)."""

    ids: list[int]
    epochs: list[int]
    values: dict[str, list[Any]]


class RelayStatements:
    """Statements for one ``OutboxTables`` and dialect, built once per relay."""

    def __init__(self, tables: OutboxTables, dialect: str) -> None:
        self.postgres = dialect == "postgresql"
        m, leases = tables.messages, tables.leases
        self._m, self._leases = m, leases
        now = bindparam("now", type_=m.c.available_at.type)
        prior = m.alias("prior")
        # An earlier row of the key that must go first and cannot go now: the key waits.
        key_waits = exists().where(
            prior.c.topic == m.c.topic,
            prior.c.key == m.c.key,
            prior.c.seq < m.c.seq,
            prior.c.status != PUBLISHED,
            or_(prior.c.status == FAILED,
                and_(prior.c.status == PENDING, prior.c.available_at > now)),
        )
        self.fetch = (
            select(*(m.c[name] for name in ROW_COLUMNS))
            .where(
                m.c.status == PENDING,
                m.c.shard.in_(bindparam("shards", expanding=True)),
                m.c.available_at <= now,
                or_(m.c.key.is_(None), ~key_waits),
            )
            .order_by(m.c.id)
            .limit(bindparam("limit"))
        )

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
            arrays = {"id": BigInteger(), "epoch": BigInteger(), **per_row}
            columns = [
                func.unnest(bindparam(f"a_{name}", type_=ARRAY(kind))).label(name)
                for name, kind in arrays.items()
            ]
            rows = select(*columns).subquery("v")
            fenced = exists().where(
                leases.c.shard == m.c.shard, leases.c.owner == owner, leases.c.epoch == rows.c.epoch
            )
            stmt = (
                update(m)
                .where(m.c.id == rows.c.id, m.c.status == PENDING, fenced)
                .values(**set_, **{name: rows.c[name] for name in per_row})
            )
            params = {"a_id": marks.ids, "a_epoch": marks.epochs,
                      **{f"a_{name}": values for name, values in marks.values.items()}}
            return conn.execute(stmt, params).rowcount
        fenced = exists().where(
            leases.c.shard == m.c.shard, leases.c.owner == owner,
            leases.c.epoch == bindparam("b_epoch"),
        )
        stmt = (
            update(m)
            .where(m.c.id == bindparam("b_id"), m.c.status == PENDING, fenced)
            .values(**set_, **{name: bindparam(f"b_{name}") for name in per_row})
        )
        params = [
            {"b_id": row_id, "b_epoch": epoch,
             **{f"b_{name}": values[i] for name, values in marks.values.items()}}
            for i, (row_id, epoch) in enumerate(zip(marks.ids, marks.epochs, strict=True))
        ]
        return conn.execute(stmt, params).rowcount

    def published(self, conn: Connection, owner: str, marks: Marks, now: datetime) -> int:
        m = self._m
        return self.mark(
            conn, owner, marks,
            {"status": PUBLISHED, "published_at": now, "attempts": m.c.attempts + 1},
            per_row={"kafka_partition": Integer(), "kafka_offset": BigInteger()},
        )

    def retried(self, conn: Connection, owner: str, marks: Marks) -> int:
        m = self._m
        return self.mark(
            conn, owner, marks, {"attempts": m.c.attempts + 1},
            per_row={"available_at": DateTime(timezone=True), "last_error": Text()},
        )

    def failed(self, conn: Connection, owner: str, marks: Marks) -> int:
        m = self._m
        return self.mark(
            conn, owner, marks, {"status": FAILED, "attempts": m.c.attempts + 1},
            per_row={"last_error": Text()},
        )


def empty_marks() -> Marks:
    return Marks([], [], {})


def add_mark(marks: Marks, row_id: int, epoch: int, **values: Any) -> None:
    marks.ids.append(row_id)
    marks.epochs.append(epoch)
    for name, value in values.items():
        marks.values.setdefault(name, []).append(value)
