"""A seeded outbox/inbox scenario whose truth the Spark tests and benchmark know.

Rows go in fast: ``COPY`` on PostgreSQL, one ``executemany`` on SQLite.
Message ``i`` (0-based) is created ``i`` seconds after ``start``; even ``i`` go
to topic ``orders``, odd to ``payments``; keys cycle over ``k0..k{keys-1}``
with every 97th message unkeyed; seq counts per (topic, key) in ``i`` order.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox import Outbox, OutboxTables, create_engine

AS_OF = datetime(2026, 1, 10, 12, 0, tzinfo=UTC)
SLA = timedelta(minutes=10)


@dataclass
class Scenario:
    """The truth: which message ids the audit must report for what."""

    n: int
    start: datetime
    ids: list[uuid.UUID] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    window_start: int = 100  # messages before this index are outside the audit window
    pending: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    in_flight: set[int] = field(default_factory=set)
    lost: dict[str, set[int]] = field(default_factory=dict)
    parked: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)
    deliveries: dict[int, int] = field(default_factory=dict)
    out_of_order: int = -1  # index of the message billing processed after a later seq
    overtaken_by: int = -1  # index of the later message of that key processed before it

    def topic(self, i: int) -> str:
        return "orders" if i % 2 == 0 else "payments"


def build(n: int = 100_000, keys: int = 1000, seed: int = 7) -> Scenario:
    """Decide every message's fate; nothing is written yet."""
    rng = random.Random(seed)
    start = AS_OF - timedelta(seconds=n + 60)
    sc = Scenario(n=n, start=start)
    seqs: dict[tuple[str, str], int] = {}
    by_key: dict[tuple[str, str], list[int]] = {}
    for i in range(n):
        topic = sc.topic(i)
        key = None if i % 97 == 0 else f"k{(i // 2) % keys}"
        seq = None
        if key is not None:
            seq = seqs[(topic, key)] = seqs.get((topic, key), 0) + 1
            by_key.setdefault((topic, key), []).append(i)
        sc.ids.append(uuid.UUID(int=rng.getrandbits(128), version=4))
        sc.rows.append({"topic": topic, "key": key, "seq": seq})
    sc.pending = set(range(n - 200, n))
    sc.in_flight = set(range(n - 500, n - 490))  # published < SLA ago, not consumed yet
    middle = [i for i in range(sc.window_start, n - 1000)]
    special = set()
    sc.parked = set(by_key[("payments", "k5")][40:45])
    sc.held = set(by_key[("payments", "k6")][30:33])
    orders_k7 = by_key[("orders", "k7")]
    sc.out_of_order, sc.overtaken_by = orders_k7[10], orders_k7[12]  # seq 11 after seq 13
    special |= sc.parked | sc.held | set(orders_k7[9:13])
    pool = [i for i in middle if i not in special]
    picks = rng.sample(pool, 20 + 37 + 55)
    sc.failed = set(picks[:20])
    shipping = rng.sample([i for i in pool if i % 2 == 0 and i not in set(picks)], 5)
    sc.lost = {"billing": set(picks[20:57]), "shipping": set(shipping)}
    sc.deliveries = {i: 2 for i in picks[57:107]} | {i: 3 for i in picks[107:112]}
    return sc


def create(url: str) -> sa.Engine:
    engine = create_engine(url)
    Outbox(engine).create_tables()
    return engine


def outbox_rows(sc: Scenario) -> Iterable[dict[str, Any]]:
    for i, base in enumerate(sc.rows):
        created = sc.start + timedelta(seconds=i)
        status = "pending" if i in sc.pending else "failed" if i in sc.failed else "published"
        yield {
            "id": i + 1, "message_id": sc.ids[i], **base, "shard": i % 16,
            "payload": json.dumps({"n": i}).encode(), "content_type": "application/json",
            "headers": {"n": str(i)}, "created_at": created, "available_at": created,
            "attempts": 0 if status == "pending" else 1, "last_error": None, "status": status,
            "published_at": created + timedelta(milliseconds=20 + i % 50) if status == "published" else None,
            "kafka_partition": i % 8, "kafka_offset": i // 8,
        }


def inbox_rows(sc: Scenario) -> Iterable[dict[str, Any]]:
    """What each group processed: billing both topics, shipping only orders."""
    consumed = {"billing", "shipping"}
    for i, base in enumerate(sc.rows):
        if i in sc.pending or i in sc.failed or i in sc.in_flight:
            continue
        created = sc.start + timedelta(seconds=i)
        for group in consumed:
            if group == "shipping" and base["topic"] != "orders":
                continue
            if i in sc.lost[group] or (group == "billing" and i in sc.parked | sc.held):
                continue
            processed = created + timedelta(milliseconds=100 + i % 200)
            if group == "billing" and i == sc.out_of_order:
                processed = sc.start + timedelta(seconds=sc.overtaken_by, milliseconds=500)
            yield {
                "consumer_group": group, "message_id": sc.ids[i], **base,
                "kafka_partition": i % 8, "kafka_offset": i // 8, "created_at": created,
                "received_at": processed - timedelta(milliseconds=5), "processed_at": processed,
                "deliveries": sc.deliveries.get(i, 1) if group == "billing" else 1,
                "outcome": "processed", "note": None,
            }


def _stored(sc: Scenario, i: int) -> dict[str, Any]:
    """The columns parked and held rows share: the whole message, kept for a replay."""
    return {
        "consumer_group": "billing", "message_id": sc.ids[i], **sc.rows[i],
        "payload": b"{}", "content_type": "application/json", "headers": {},
        "created_at": sc.start + timedelta(seconds=i), "kafka_partition": 0, "kafka_offset": i,
    }


def parked_rows(sc: Scenario) -> Iterable[dict[str, Any]]:
    for i in sorted(sc.parked):
        failed = sc.start + timedelta(seconds=i + 1)
        yield _stored(sc, i) | {
            "reason": "failed", "error": "boom", "traceback": None, "attempts": 3,
            "first_failure_at": failed, "last_failure_at": failed + timedelta(seconds=1),
        }


def held_rows(sc: Scenario) -> Iterable[dict[str, Any]]:
    for i in sorted(sc.held):
        yield _stored(sc, i) | {"received_at": sc.start + timedelta(seconds=i + 1)}


def seed(sc: Scenario, outbox_url: str, inbox_url: str) -> None:
    """Write the scenario: outbox rows into one database, inbox rows into the other."""
    tables = OutboxTables()
    out, inbox = create(outbox_url), create(inbox_url)
    try:
        insert_rows(out, tables.messages, outbox_rows(sc))
        insert_rows(inbox, tables.inbox_messages, inbox_rows(sc))
        insert_rows(inbox, tables.inbox_parked, parked_rows(sc))
        insert_rows(inbox, tables.inbox_held, held_rows(sc))
    finally:
        out.dispose()
        inbox.dispose()


def insert_rows(engine: sa.Engine, table: sa.Table, rows: Iterable[dict[str, Any]],
                batch: int = 50_000) -> None:
    """Bulk insert: COPY on PostgreSQL, executemany elsewhere, in batches."""
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= batch:
            _write(engine, table, chunk)
            chunk = []
    if chunk:
        _write(engine, table, chunk)
    if engine.dialect.name == "postgresql" and "id" in table.c:
        with engine.begin() as conn:  # later inserts must not collide with the copied ids
            conn.execute(sa.text(
                f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                f"(SELECT coalesce(max(id), 1) FROM {table.name}))"
            ))


def _write(engine: sa.Engine, table: sa.Table, rows: Sequence[dict[str, Any]]) -> None:
    if engine.dialect.name != "postgresql":
        with engine.begin() as conn:
            conn.execute(sa.insert(table), list(rows))
        return
    names = list(rows[0])
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cur, cur.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([_pg(row[n]) for n in names])
        raw.commit()
    finally:
        raw.close()


def _pg(value: Any) -> Any:
    if isinstance(value, dict):
        return json.dumps(value)
    return value




def spark_for_tests():
    """One lean local session for the whole test run (UI off, few shuffle partitions).

    With Spark's Kafka source when scripts/setup fetched it: whichever test module starts
    the shared session first decides its class path, and the wire audit's tests need it.
    """
    from outbox.spark import spark_session

    spark = spark_session("local[2]", config={
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "2",
        "spark.driver.memory": "1g",
    })
    spark.sparkContext.setLogLevel("ERROR")
    return spark
