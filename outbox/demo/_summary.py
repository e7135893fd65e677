"""What the demo measured, read back from both databases, and the checks it must pass."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import sqlalchemy as sa
from rich.table import Table
from rich.text import Text

from .. import OutboxTables
from .billing import invoices, violations


@dataclass
class Summary:
    orders: int
    events_written: int = 0
    published: int = 0
    consumed: int = 0
    duplicates_dropped: int = 0
    orders_completed: int = 0
    parked_messages: int = 0
    replayed_orders: int = 0
    order_violations: int = 0
    lost: int = 0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    relay_kills: int = 0
    alerts: int = 0
    spark_verdict: str | None = None
    failures: list[str] = field(default_factory=list)

    def check(self, expected_events: int) -> None:
        rules = [
            (self.events_written == expected_events,
             f"events written {self.events_written} != {expected_events}"),
            (self.published == expected_events,
             f"published {self.published} != {expected_events}"),
            (self.lost == 0, f"{self.lost} events lost"),
            (self.order_violations == 0, f"{self.order_violations} per-key order violations"),
            (self.orders_completed == self.orders, f"{self.orders_completed}/{self.orders} orders completed"),
            (self.parked_messages >= 1, "the poisoned order never parked"),
            (self.replayed_orders == 1, "the poisoned order was not replayed to completion"),
            (self.alerts == 1, f"{self.alerts} alerts raised for the one poisoned order, expected 1"),
            (self.relay_kills >= 1, "the relay was never killed"),
            (self.spark_verdict is None or self.spark_verdict.startswith("OK"),
             f"Spark audit: {self.spark_verdict}"),
        ]
        self.failures = [message for ok, message in rules if not ok]

    def table(self) -> Table:
        table = Table(title="transactional-outbox demo", show_header=True)
        table.add_column("measure")
        table.add_column("value", justify="right", overflow="fold")  # folds a long path, never cuts it
        rows = [
            ("orders placed (created → paid → shipped)", self.orders),
            ("events written in business transactions", self.events_written),
            ("events published by the relay", self.published),
            ("relay SIGKILLed and restarted", self.relay_kills),
            ("events consumed by billing (unique)", self.consumed),
            ("duplicate deliveries dropped", self.duplicates_dropped),
            ("lost events", self.lost),
            ("per-key order violations", self.order_violations),
            ("messages parked (poisoned order)", self.parked_messages),
            ("alerts raised", self.alerts),
            ("parked orders replayed to completion", self.replayed_orders),
            ("orders completed in billing", self.orders_completed),
            ("latency commit → applied p50", f"{self.latency_p50_ms:.0f} ms"),
            ("latency commit → applied p99 (incl. the kill gap)", f"{self.latency_p99_ms:.0f} ms"),
        ]
        if self.spark_verdict:
            rows.append(("Spark audit", self.spark_verdict))
        for name, value in rows:
            table.add_row(name, Text(str(value)))
        return table


def read_back(summary: Summary, orders_url: str, billing_url: str) -> None:
    tables = OutboxTables()
    with sa.create_engine(orders_url).connect() as conn:
        m = tables.messages
        summary.events_written = conn.scalar(sa.select(sa.func.count()).select_from(m)) or 0
        summary.published = conn.scalar(
            sa.select(sa.func.count()).select_from(m).where(m.c.status == "published")) or 0
        sent = set(conn.scalars(sa.select(m.c.message_id)))
    with sa.create_engine(billing_url).connect() as conn:
        i = tables.inbox_messages
        rows = conn.execute(sa.select(i.c.message_id, i.c.deliveries, i.c.created_at,
                                      i.c.processed_at)).all()
        summary.orders_completed = conn.scalar(
            sa.select(sa.func.count()).select_from(invoices).where(invoices.c.state == "shipped")) or 0
        summary.order_violations = conn.scalar(
            sa.select(sa.func.count()).select_from(violations)) or 0
    summary.consumed = len(rows)
    summary.lost = len(sent - {r.message_id for r in rows})
    summary.duplicates_dropped = sum(max(0, (r.deliveries or 1) - 1) for r in rows)
    latencies = sorted((r.processed_at - r.created_at).total_seconds() * 1000
                       for r in rows if r.created_at and r.processed_at)
    if len(latencies) >= 2:
        cuts = statistics.quantiles(latencies, n=100)
        summary.latency_p50_ms, summary.latency_p99_ms = cuts[49], cuts[98]
