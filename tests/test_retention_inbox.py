"""Retention keeps the inbox's promises: a duplicate inside the dedup window is still dropped,
a key's position survives the deletion of its records, and a redelivery older than the window
is counted as expired, never parked (docs/guarantees.md)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY

from outbox import Disposition, Inbox, create_engine
from outbox.housekeeping import run_retention
from tests.inbox_support import AlertLog, record

TOPIC, WINDOW = "orders", timedelta(days=3)


@pytest.fixture
def inbox(proof_db_url: str):
    engine = create_engine(proof_db_url)
    inbox = Inbox(engine, group=f"g-{uuid.uuid4().hex[:8]}", retry_backoff=0, alert=AlertLog(),
                  dedup_window=WINDOW)
    inbox.create_tables()
    applied: list[tuple[str, int]] = []

    @inbox.handler(TOPIC)
    def handle(session, message):  # type: ignore[no-untyped-def]
        applied.append((message.key, message.seq))

    inbox.applied = applied  # type: ignore[attr-defined]
    yield inbox
    engine.dispose()


def expired(inbox: Inbox) -> float:
    return REGISTRY.get_sample_value("outbox_inbox_seq_conflicts_total", {
        "group": inbox.group, "topic": TOPIC, "verdict": "expired"}) or 0.0


def test_duplicates_inside_the_window_are_still_dropped_after_retention(inbox: Inbox) -> None:
    now = datetime.now(UTC)
    old = [record(TOPIC, "k", seq, created_at=now - timedelta(days=10)) for seq in (1, 2, 3)]
    recent = [record(TOPIC, "k", seq, created_at=now - timedelta(hours=1)) for seq in (4, 5)]
    assert [inbox.handle(r) for r in old + recent] == [Disposition.APPLIED] * 5
    m = inbox.tables.inbox_messages
    with inbox.engine.begin() as conn:  # type: ignore[union-attr]
        # They were processed long ago too: only the message's age may keep a record.
        conn.execute(sa.update(m).values(processed_at=now - timedelta(days=9)))

    result = run_retention(inbox.engine, tables=inbox.tables, dedup_window=WINDOW)  # type: ignore[arg-type]

    assert result.deleted == {"inbox_messages": 3}  # the old records went, the recent ones stayed
    assert [inbox.handle(r) for r in recent] == [Disposition.DUPLICATE] * 2
    before = expired(inbox)
    assert [inbox.handle(r) for r in old] == [Disposition.DUPLICATE] * 3  # expired redeliveries
    assert expired(inbox) == before + 3
    assert inbox.parked() == [] and list(inbox.alert) == []  # type: ignore[call-overload]
    assert inbox.applied == [("k", seq) for seq in range(1, 6)]  # type: ignore[attr-defined]
    # The key's position survived its records: seq 6 applies next, and a new id at seq 5 conflicts.
    assert inbox.handle(record(TOPIC, "k", 6, created_at=now)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "k", 5, created_at=now)) is Disposition.PARKED
