"""Operating the relay's table: failed rows (list, retry, skip) and backlog statistics.

A failed row blocks its key: the relay sends nothing of that key until the row
is retried (back to pending, sent again in its place) or skipped (never sent;
the key's later rows flow). Both are explicit operator decisions, recorded in
the row's status and ``last_error``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, case, func, literal, select, update

from ..core._envelope import utcnow
from ..core._errors import ConfigurationError
from ..core._notify import notified, notify_payload
from ..core._tables import OutboxStatus
from ..producer import Outbox


def _engine(outbox: Outbox) -> Engine:
    if not isinstance(outbox.engine, Engine):
        raise ConfigurationError("the relay admin commands need a sync Engine")
    return outbox.engine


def failed_rows(outbox: Outbox, *, topic: str | None = None, limit: int = 1000,
                after: int | None = None) -> list[Any]:
    """Failed rows, oldest first; ``after`` (a row ``id``) pages on from the previous page's last row.

    Read through ``ix_outbox_key_waits`` (failed, delayed and retrying rows: a tiny
    set), whose predicate the first two terms repeat so SQLite uses it too. Order
    and page bound say ``id + 0``: on the bare ``id`` PostgreSQL walks the primary
    key through every pending row looking for failed ones (50 ms at 1M pending).
    """
    m = outbox.tables.messages
    query = (select(m.c.id, m.c.message_id, m.c.topic, m.c.key, m.c.seq, m.c.attempts,
                    m.c.last_error, m.c.created_at, m.c.event_type)
             .where(m.c.status != OutboxStatus.PUBLISHED,
                    (m.c.status == OutboxStatus.FAILED) | (m.c.available_at > m.c.created_at),
                    m.c.status == OutboxStatus.FAILED)
             .order_by(m.c.id + 0).limit(limit))
    if topic is not None:
        query = query.where(m.c.topic == topic)
    if after is not None:
        query = query.where(m.c.id + 0 > after)
    with _engine(outbox).connect() as conn:
        return list(conn.execute(query))


def _change_failed(outbox: Outbox, message_ids: Sequence[uuid.UUID | str] | None,
                   topic: str | None, values: dict[str, Any]) -> int:
    if message_ids is not None and not message_ids:
        return 0
    m = outbox.tables.messages
    stmt = update(m).where(m.c.status == OutboxStatus.FAILED).values(**values)
    if topic is not None:
        stmt = stmt.where(m.c.topic == topic)
    with _engine(outbox).begin() as conn:
        if message_ids is not None:
            ids = _message_ids(message_ids)
            stmt = stmt.where(m.c.message_id.in_(ids))
            _refuse_unknown(conn, outbox, ids, topic)
        if conn.dialect.name != "postgresql" or outbox.notify_channel is None:
            return conn.execute(stmt).rowcount
        shards = list(conn.scalars(stmt.returning(m.c.shard)))
        _notify(conn, outbox.notify_channel, sorted(set(shards)), conn.schema_for_object(m))
        return len(shards)


def _notify(conn: Any, channel: str, shards: list[int], schema: str | None) -> None:
    """Wake the relays of ``shards`` when this transaction commits, as ``publish()`` does.

    A row made pending (or a key unblocked by a skip) is work a relay would
    otherwise find only at its next poll: a fleet's idle tenant polls rarely
    (up to a minute apart) while notifications can reach it.
    """
    for shard in shards:
        conn.execute(select(notified(channel, literal(notify_payload(shard, schema)))))


def _message_ids(message_ids: Sequence[uuid.UUID | str]) -> list[uuid.UUID]:
    try:
        return [i if isinstance(i, uuid.UUID) else uuid.UUID(str(i)) for i in message_ids]
    except ValueError:
        bad = [str(i) for i in message_ids if not _is_uuid(i)]
        raise ConfigurationError(f"not a message id: {', '.join(bad)} (ids are UUIDs, "
                                 "as `outbox failed list` shows them)") from None


def _is_uuid(value: object) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _refuse_unknown(conn: Any, outbox: Outbox, ids: list[uuid.UUID], topic: str | None) -> None:
    """Naming a row that is not failed is a mistake to report, not a silent 0: change nothing."""
    m = outbox.tables.messages
    query = select(m.c.message_id).where(m.c.status == OutboxStatus.FAILED, m.c.message_id.in_(ids))
    if topic is not None:
        query = query.where(m.c.topic == topic)
    found = {uuid.UUID(str(i)) for i in conn.execute(query).scalars()}
    unknown = [str(i) for i in ids if i not in found]
    if unknown:
        where = f" of topic {topic}" if topic else ""
        raise ConfigurationError(f"no failed row{where} with message id {', '.join(unknown)} "
                                 "(see `outbox failed list`); nothing changed")


def _note(outbox: Outbox, action: str, by: str | None, reason: str | None) -> Any:
    """``last_error`` with the operator's decision appended: the row keeps who and why."""
    m = outbox.tables.messages
    who = f" by {by.strip()}" if by and by.strip() else " by operator"
    why = f": {reason.strip()}" if reason and reason.strip() else ""
    return func.coalesce(m.c.last_error, "") + f" [{action}{who} at {utcnow().isoformat()}{why}]"


def retry_failed(outbox: Outbox, message_ids: Sequence[uuid.UUID | str] | None = None, *,
                 topic: str | None = None, by: str | None = None, reason: str | None = None) -> int:
    """Make failed rows pending again, due now; ``None`` ids means every failed row (of ``topic``).

    An id that names no failed row raises ``ConfigurationError`` and changes nothing.
    ``by``/``reason``, when given, are appended to the row's ``last_error``.
    """
    values: dict[str, Any] = {"status": OutboxStatus.PENDING, "available_at": utcnow()}
    if by or reason:
        values["last_error"] = _note(outbox, "retried", by, reason)
    return _change_failed(outbox, message_ids, topic, values)


def skip_failed(outbox: Outbox, message_ids: Sequence[uuid.UUID | str] | None = None, *,
                topic: str | None = None, by: str | None = None, reason: str | None = None) -> int:
    """Mark failed rows skipped (never sent), unblocking the later rows of their keys.

    The row's ``last_error`` keeps the decision: ``[skipped by <by> at <time>: <reason>]``.
    """
    return _change_failed(outbox, message_ids, topic,
                          {"status": OutboxStatus.SKIPPED,
                           "last_error": _note(outbox, "skipped", by, reason)})


@dataclass(frozen=True, slots=True)
class BacklogRow:
    topic: str
    shard: int
    pending: int
    failed: int
    oldest_pending: datetime | None


def backlog(outbox: Outbox) -> list[BacklogRow]:
    """Pending and failed counts and the oldest pending row, per topic and shard."""
    m = outbox.tables.messages
    query = (
        # CASE, not FILTER (WHERE …): MySQL and MariaDB have no FILTER clause.
        select(m.c.topic, m.c.shard,
               func.count(case((m.c.status == OutboxStatus.PENDING, 1))),
               func.count(case((m.c.status == OutboxStatus.FAILED, 1))),
               func.min(case((m.c.status == OutboxStatus.PENDING, m.c.created_at))))
        # The != term is implied by the IN; it lets SQLite use the partial index on
        # unpublished rows too (PostgreSQL infers it), so published rows are never read.
        .where(m.c.status != OutboxStatus.PUBLISHED,
               m.c.status.in_([OutboxStatus.PENDING, OutboxStatus.FAILED]))
        .group_by(m.c.topic, m.c.shard).order_by(m.c.topic, m.c.shard)
    )
    with _engine(outbox).connect() as conn:
        result = conn.execute(query).all()
    return [BacklogRow(*row) for row in result]


@dataclass(frozen=True, slots=True)
class RetryingHead:
    """The earliest unpublished row of a key, which the relay is retrying; the key waits for it."""

    topic: str
    key: str | None
    seq: int | None
    message_id: uuid.UUID
    attempts: int
    created_at: datetime
    available_at: datetime
    last_error: str | None
    waiting: int  # pending rows of the same key behind it


def retrying_heads(outbox: Outbox, *, limit: int = 50, shards: Sequence[int] | None = None,
                   engine: Engine | None = None, conn: Connection | None = None) -> list[RetryingHead]:
    """Pending rows being retried (attempts > 0, due later), oldest first, one per key.

    ``shards`` limits it to those shards (a relay watching its own keys);
    ``engine`` overrides the outbox's (a relay given its own sync engine);
    ``conn``: read on it, in the caller's transaction (a fleet's idle poll).

    The filter repeats the predicate of the ``ix_outbox_key_waits`` partial index
    (failed, delayed or retrying rows: a tiny set), so this stays cheap however
    big the table; the rows waiting behind each head are counted on
    ``ix_outbox_open_key``. A delayed publish (attempts 0) is not a retry.
    """
    m = outbox.tables.messages
    behind = m.alias("behind")
    waiting = (select(func.count()).where(
        behind.c.topic == m.c.topic, behind.c.key == m.c.key, behind.c.seq > m.c.seq,
        behind.c.status != OutboxStatus.PUBLISHED,  # ix_outbox_open_key's predicate, for SQLite
        behind.c.status == OutboxStatus.PENDING).scalar_subquery())
    query = (select(m.c.topic, m.c.key, m.c.seq, m.c.message_id, m.c.attempts, m.c.created_at,
                    m.c.available_at, m.c.last_error, waiting)
             .where(m.c.status != OutboxStatus.PUBLISHED, m.c.available_at > m.c.created_at,
                    # "pending", said without naming it: ``status = 'pending'`` would let
                    # SQLite pick ix_outbox_pending, a scan of the whole backlog.
                    m.c.status.not_in([OutboxStatus.FAILED, OutboxStatus.SKIPPED]),
                    m.c.attempts > 0)
             .order_by(m.c.created_at, m.c.id).limit(limit))
    if shards is not None:
        query = query.where(m.c.shard.in_(list(shards)))
    if conn is not None:
        return _heads(conn.execute(query))
    with (engine or _engine(outbox)).connect() as own:
        return _heads(own.execute(query))


def _heads(rows: Iterable[Sequence[Any]]) -> list[RetryingHead]:
    """The earliest retrying row of each key, oldest first."""
    heads: dict[tuple[str, str | None], RetryingHead] = {}
    for row in rows:
        topic, key, seq, message_id, attempts, created_at, available_at, last_error, waiting = row
        head = RetryingHead(topic, key, seq, message_id, attempts, created_at, available_at, last_error,
                            waiting=waiting or 0)
        lane = (head.topic, head.key if head.key is not None else str(head.message_id))
        earlier = heads.get(lane)
        if earlier is None or (head.seq or 0) < (earlier.seq or 0):
            heads[lane] = head
    return sorted(heads.values(), key=lambda h: h.created_at)


@dataclass(frozen=True, slots=True)
class ShardLease:
    shard: int
    owner: str | None
    epoch: int
    expires_at: datetime | None  # None: no lease row yet (no relay has started)


@dataclass(frozen=True, slots=True)
class RelayHeartbeat:
    worker_id: str
    heartbeat_at: datetime


def shard_leases(outbox: Outbox, shards: int) -> tuple[list[ShardLease], list[RelayHeartbeat]]:
    """Every shard's lease (one row per shard, ``shards`` rows at most) and the relays' heartbeats.

    Both tables are as small as the shard count and the number of relays; a shard
    without a lease row is listed unowned, as a relay that never started leaves it.
    """
    leases, relays = outbox.tables.leases, outbox.tables.relays
    with _engine(outbox).connect() as conn:
        rows = {r.shard: ShardLease(r.shard, r.owner, r.epoch, r.expires_at) for r in conn.execute(
            select(leases.c.shard, leases.c.owner, leases.c.epoch, leases.c.expires_at))}
        beats = [RelayHeartbeat(*r) for r in conn.execute(
            select(relays.c.worker_id, relays.c.heartbeat_at).order_by(relays.c.worker_id))]
    # Rows past the count are shards a reshard removed (kept for their transactional ids): no lease.
    return [rows.get(s, ShardLease(s, None, 0, None)) for s in range(shards)], beats
