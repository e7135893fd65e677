"""Prometheus metrics: defined once per process, labelled per group, counting committed outcomes."""

from __future__ import annotations

import sqlalchemy as sa
from prometheus_client import REGISTRY

from outbox import Inbox
from tests.inbox_support import AlertLog, apply_effect, business, record


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_counters_follow_what_happened_per_group(sqlite_db: str) -> None:
    from outbox import create_engine

    engine = create_engine(sqlite_db)
    first = Inbox(engine, group="metrics-a", alert=AlertLog(), retry_backoff=0.001)
    second = Inbox(engine, group="metrics-b")  # a second Inbox in the process must not collide
    first.create_tables()
    business.create_all(engine)

    def handler(session: sa.orm.Session, message) -> None:  # type: ignore[no-untyped-def]
        if message.key == "bad":
            raise RuntimeError("no")
        apply_effect(session, message)

    first.handler("orders")(handler)
    second.handler("orders")(handler)
    labels = {"group": "metrics-a", "topic": "orders"}
    one = record("orders", "k", 1)
    for r in (one, one, record("orders", "k", 3), record("orders", "bad", 1)):
        first.handle(r)

    assert sample("outbox_inbox_consumed_total", **labels) == 4
    assert sample("outbox_inbox_handled_total", **labels) == 1
    assert sample("outbox_inbox_duplicates_dropped_total", **labels) == 1
    assert sample("outbox_inbox_held_total", **labels) == 1
    assert sample("outbox_inbox_failed_attempts_total", **labels) == 3
    assert sample("outbox_inbox_parked_total", reason="failed", **labels) == 1
    assert sample("outbox_inbox_handler_seconds_count", **labels) == 4
    assert sample("outbox_inbox_consumed_total", group="metrics-b", topic="orders") == 0
    first.metrics.parked_keys(first.admin.parked_key_count())
    assert sample("outbox_inbox_parked_keys", group="metrics-a") == 1
