"""The storage's read-only listings for operators: a page at a time (the web console), and a summary.

Part of the storage (its SQL on the inbox tables), split out by role and
published as ``outbox.inbox.admin``: these run outside any consumer
transaction, on a plain connection. Every listing is keyset-paged on an
index, so a page costs the same with ten parked keys or ten thousand;
``stuck_by_group`` (``outbox status``) reads only the tables of what waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, func, select, tuple_

from ...core._tables import OutboxTables
from ...core._wire import MAX_SEQ
from .._delivery import KeyId


@dataclass(frozen=True, slots=True)
class ParkedLane:
    """One parked key of a group (or a topic's parked unkeyed messages, ``key`` None)."""

    topic: str
    key: str | None
    messages: int
    first_seq: int | None
    oldest_failure: datetime
    last_failure: datetime
    reason: str  # of the key's first parked message
    error: str | None


@dataclass(frozen=True, slots=True)
class HeldLane:
    """A key whose messages wait behind a gap: the key's ``last_seq`` and what arrived ahead of it."""

    topic: str
    key: str
    messages: int
    first_held_seq: int
    last_seq: int | None
    oldest_received: datetime


def parked_lanes(conn: Connection, tables: OutboxTables, group: str, *,
                 after: KeyId | None = None, limit: int = 50) -> list[ParkedLane]:
    """A page of the group's parked keys in (topic, key) order; ``after`` is the last key of the page before.

    Keyset paging on ``ix_inbox_parked_key`` (group, topic, key, seq): a page
    reads its own keys' rows and no others, however many keys are parked.
    Unkeyed parked messages are listed by ``parked_unkeyed`` (one lane per topic).
    """
    p = tables.inbox_parked
    head = p.alias("head")
    first = (select(head.c.id).where(head.c.consumer_group == group, head.c.topic == p.c.topic,
                                     head.c.key == p.c.key)
             .order_by(head.c.seq, head.c.id).limit(1).scalar_subquery())
    lanes = (select(p.c.topic, p.c.key, func.count().label("n"), func.min(p.c.seq).label("first_seq"),
                    func.min(p.c.first_failure_at).label("oldest"),
                    func.max(p.c.last_failure_at).label("last"), first.label("head_id"))
             .where(p.c.consumer_group == group, p.c.key.is_not(None))
             .group_by(p.c.topic, p.c.key).order_by(p.c.topic, p.c.key).limit(limit))
    if after is not None:
        lanes = lanes.where(tuple_(p.c.topic, p.c.key) > tuple_(*after))
    page = lanes.subquery()
    rows = conn.execute(select(page, p.c.reason, p.c.error).join(p, p.c.id == page.c.head_id)
                        .order_by(page.c.topic, page.c.key)).all()
    return [ParkedLane(r.topic, r.key, r.n, r.first_seq, r.oldest, r.last, r.reason, r.error)
            for r in rows]


def parked_unkeyed(conn: Connection, tables: OutboxTables, group: str) -> list[ParkedLane]:
    """Per topic, the group's parked unkeyed messages: one lane each, as ``replay(topic, None)`` sees them."""
    p = tables.inbox_parked
    rows = conn.execute(
        select(p.c.topic, func.count(), func.min(p.c.first_failure_at), func.max(p.c.last_failure_at))
        .where(p.c.consumer_group == group, p.c.key.is_(None))
        .group_by(p.c.topic).order_by(p.c.topic)).all()
    return [ParkedLane(t, None, n, None, oldest, last, "", None) for t, n, oldest, last in rows]


def parked_page(conn: Connection, tables: OutboxTables, group: str, topic: str, key: str | None, *,
                after: int | None = None, limit: int = 50) -> list[Row[Any]]:
    """One key's parked rows (all columns, traceback included) in replay order, from row ``after`` on.

    Replay order is seq order; ``after`` names the last row of the previous page
    by its ``inbox_parked.id`` and the page goes on from that row's (seq, id).
    A keyed message without a seq (a CloudEvent, a Debezium event) sorts after
    the seqs, in id order (arrival): compared as it is, a NULL seq matched no row
    after it, and a Debezium key's second page was empty. (A key with both
    lists ours first; its replay interleaves them by arrival, ``_merged_page``.)
    Unkeyed messages go in id order.
    """
    p = tables.inbox_parked
    query = select(p).where(p.c.consumer_group == group, p.c.topic == topic).limit(limit)
    if key is None:
        query = query.where(p.c.key.is_(None)).order_by(p.c.id)
        if after is not None:
            query = query.where(p.c.id > after)
        return list(conn.execute(query))
    place = func.coalesce(p.c.seq, MAX_SEQ)  # no seq: after every seq, the same on every database
    query = query.where(p.c.key == key).order_by(place, p.c.id)
    if after is not None:
        seq = select(place).where(p.c.id == after).scalar_subquery()
        query = query.where(tuple_(place, p.c.id) > tuple_(seq, after))
    return list(conn.execute(query))


def held_lanes(conn: Connection, tables: OutboxTables, group: str, *,
               after: KeyId | None = None, limit: int = 50) -> list[HeldLane]:
    """A page of the group's keys with held messages (gaps), in (topic, key) order, keyset-paged.

    Reads ``inbox_held`` on its (group, topic, key, seq) unique index, and each
    listed key's ``inbox_keys`` row by primary key.
    """
    h, k = tables.inbox_held, tables.inbox_keys
    last_seq = (select(k.c.last_seq).where(k.c.consumer_group == group, k.c.topic == h.c.topic,
                                           k.c.key == h.c.key).scalar_subquery())
    query = (select(h.c.topic, h.c.key, func.count(), func.min(h.c.seq), last_seq,
                    func.min(h.c.received_at))
             .where(h.c.consumer_group == group)
             .group_by(h.c.topic, h.c.key).order_by(h.c.topic, h.c.key).limit(limit))
    if after is not None:
        query = query.where(tuple_(h.c.topic, h.c.key) > tuple_(*after))
    return [HeldLane(*r) for r in conn.execute(query)]


@dataclass(frozen=True, slots=True)
class GroupBacklog:
    """What waits in one consumer group: parked keys and messages, held (gap) messages."""

    group: str
    parked_keys: int
    parked_messages: int
    oldest_parked: datetime | None  # first failure of the oldest parked message
    held_messages: int
    oldest_held: datetime | None  # when the oldest message held behind a gap arrived


def stuck_by_group(conn: Connection, tables: OutboxTables, group: str | None = None) -> list[GroupBacklog]:
    """Parked and held messages per consumer group (only ``group`` if given), for ``outbox status``.

    Reads ``inbox_parked`` and ``inbox_held`` only — both hold just what is
    waiting, so they stay small — and never ``inbox_keys`` (a row per key ever
    seen, with no index on ``parked``): a parked key is a distinct
    (topic, key) of ``inbox_parked``, on the ``ix_inbox_parked_key`` index (a
    topic's parked unkeyed messages count as one key, as ``replay`` treats them).
    """
    p, h = tables.inbox_parked, tables.inbox_held
    lanes = (select(p.c.consumer_group, p.c.topic, p.c.key, func.count().label("n"),
                    func.min(p.c.first_failure_at).label("first"))
             .group_by(p.c.consumer_group, p.c.topic, p.c.key))
    held = select(h.c.consumer_group, func.count(), func.min(h.c.received_at)).group_by(h.c.consumer_group)
    if group is not None:
        lanes = lanes.where(p.c.consumer_group == group)
        held = held.where(h.c.consumer_group == group)
    lane = lanes.subquery()
    per_group = select(lane.c.consumer_group, func.count(), func.sum(lane.c.n), func.min(lane.c.first))
    parked = conn.execute(per_group.group_by(lane.c.consumer_group)).all()
    groups = {g: [int(keys), int(n), first, 0, None] for g, keys, n, first in parked}
    for g, n, oldest in conn.execute(held):
        groups.setdefault(g, [0, 0, None, 0, None])[3:] = [int(n), oldest]
    return [GroupBacklog(g, *groups[g]) for g in sorted(groups)]
