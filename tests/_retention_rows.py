"""Rows written straight into the outbox and inbox tables, for the retention proofs.

Retention reads only status and timestamps, so the proofs set those directly
instead of publishing and relaying (which could not make a row 20 days old).
"""

from __future__ import annotations

import uuid
from datetime import datetime

import sqlalchemy as sa

from outbox import OutboxTables


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
