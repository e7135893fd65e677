"""Rows written straight into the outbox and inbox tables, for the retention proofs.

Retention reads only status and timestamps, so the proofs set those directly
instead of publishing and relaying (which could not make a row 20 days old).
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox import Outbox, OutboxTables
from outbox.housekeeping import run_retention

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
"""The passes' ``now`` in the unlocked-batch proofs; ``OLD`` rows are past any of their cutoffs."""
OLD = NOW - timedelta(days=30)


def outbox_row(status: str, created_at: datetime, *, topic: str = "t") -> dict:
    return {"message_id": uuid.uuid4(), "topic": topic, "key": None, "seq": None, "shard": 0,
            "payload": b"x", "content_type": "application/octet-stream", "headers": {},
            "created_at": created_at, "available_at": created_at, "attempts": 0, "status": status,
            "published_at": created_at if status == "published" else None}


def inbox_row(group: str, processed_at: datetime, created_at: datetime | None, outcome: str = "processed",
              *, key: str | None = None, seq: int | None = None, message_id: uuid.UUID | None = None) -> dict:
    return {"consumer_group": group, "message_id": message_id or uuid.uuid4(), "topic": "t", "key": key,
            "seq": seq, "kafka_partition": 0, "kafka_offset": 0, "created_at": created_at,
            "received_at": processed_at, "processed_at": processed_at, "deliveries": 1, "outcome": outcome,
            "note": None}


def snapshot(engine: sa.Engine, tables: OutboxTables) -> dict[str, set]:
    """Every row's identity in every table retention might touch, to compare before and after."""
    with engine.connect() as conn:
        return {
            "messages": set(conn.execute(sa.select(tables.messages.c.message_id)).scalars()),
            "inbox": set(conn.execute(sa.select(tables.inbox_messages.c.consumer_group,
                                                tables.inbox_messages.c.message_id)).all()),
            "outbox_keys": set(conn.execute(sa.select(tables.keys)).all()),
            "inbox_keys": set(conn.execute(sa.select(tables.inbox_keys.c.consumer_group,
                                                     tables.inbox_keys.c.topic, tables.inbox_keys.c.key,
                                                     tables.inbox_keys.c.last_seq)).all()),
            "held": set(conn.execute(sa.select(tables.inbox_held.c.message_id)).scalars()),
            "parked": set(conn.execute(sa.select(tables.inbox_parked.c.message_id)).scalars()),
        }


def filled(engine: sa.Engine, rows: int, **outbox_options: Any) -> tuple[Outbox, list[int]]:
    """An outbox on ``engine`` with ``rows`` published ``OLD`` rows, and their ids in order."""
    outbox = Outbox(engine, **outbox_options)
    outbox.create_tables()
    with outbox.engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages), [outbox_row("published", OLD) for _ in range(rows)])
        ids = conn.execute(sa.select(outbox.tables.messages.c.id).order_by("id")).scalars().all()
    return outbox, list(ids)


def passes_at_once(outbox: Outbox, passes: int, batch_size: int) -> list[int]:
    """What each of ``passes`` retention passes run at once (cutoff 7 days before ``NOW``) counted."""
    results: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        done = run_retention(outbox, older_than="7d", now=NOW, duty=1.0, batch_size=batch_size).total
        with lock:
            results.append(done)

    threads = [threading.Thread(target=run) for _ in range(passes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results
