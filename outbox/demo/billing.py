"""The billing service: an inbox consumer that enforces each order's state machine.

Run by the demo as ``outbox inbox run outbox.demo.billing:inbox``; the database
comes from ``OUTBOX_DEMO_BILLING_DB``. The handler *fails* when an event comes
out of order (``paid`` before ``created``), so the demo proves ordering instead
of assuming it. Orders listed in ``billing_faults`` are rejected by the "card
processor" until the row is deleted: that is the poisoned order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import sqlalchemy as sa

from .. import Alert, Inbox, Message, create_engine

NEXT_STATE = {"created": None, "paid": "created", "shipped": "paid"}

metadata = sa.MetaData()
invoices = sa.Table(
    "invoices", metadata,
    sa.Column("order_id", sa.Integer, primary_key=True),
    sa.Column("state", sa.String(10), nullable=False),
    sa.Column("last_seq", sa.Integer, nullable=False),
)
faults = sa.Table("billing_faults", metadata, sa.Column("order_id", sa.Integer, primary_key=True))
violations = sa.Table(
    "order_violations", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("order_id", sa.Integer, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)


class OrderOutOfSequence(Exception):
    """An event arrived before the one it follows: an ordering bug upstream."""


class CardDeclined(Exception):
    """The demo's poison: the payment processor rejects this order."""


def record_violation(engine: sa.Engine, order_id: int, detail: str) -> None:
    """Violations are written outside the handler's transaction so a rollback keeps them."""
    with engine.begin() as conn:
        conn.execute(violations.insert().values(order_id=order_id, detail=detail))


def build_inbox(url: str, alerts_file: Path) -> Inbox:
    engine = create_engine(url)
    inbox = Inbox(engine, group="billing", alert=lambda alert: _write_alert(alerts_file, alert))
    inbox.create_tables()
    metadata.create_all(engine)

    @inbox.handler("orders")
    def on_order_event(session: sa.orm.Session, message: Message) -> None:
        event = message.json()
        order_id, name = event["order_id"], event["event"]
        row = session.execute(sa.select(invoices).where(invoices.c.order_id == order_id)).one_or_none()
        expected_before = NEXT_STATE[name]
        if (row.state if row else None) != expected_before:
            detail = f"{name} (seq {message.seq}) after {row.state if row else 'nothing'}"
            record_violation(engine, order_id, detail)
            raise OrderOutOfSequence(f"order {order_id}: {detail}")
        if name == "paid" and session.execute(
                sa.select(faults.c.order_id).where(faults.c.order_id == order_id)).first():
            raise CardDeclined(f"card processor declined order {order_id}")
        if row is None:
            session.execute(invoices.insert().values(order_id=order_id, state=name,
                                                     last_seq=message.seq))
        else:
            session.execute(invoices.update().where(invoices.c.order_id == order_id)
                            .values(state=name, last_seq=message.seq))

    return inbox


def _write_alert(path: Path, alert: Alert) -> None:
    with path.open("a") as f:
        f.write(json.dumps(alert.to_json()) + "\n")


def _from_environment() -> Inbox:
    url = os.environ.get("OUTBOX_DEMO_BILLING_DB")
    if not url:
        raise RuntimeError("OUTBOX_DEMO_BILLING_DB is not set: run this through `outbox demo`")
    return build_inbox(url, Path(os.environ.get("OUTBOX_DEMO_ALERTS", "alerts.jsonl")))


def __getattr__(name: str) -> Inbox:
    # `outbox inbox run outbox.demo.billing:inbox` builds the inbox on first access,
    # so importing this module (e.g. for build_inbox) needs no environment.
    if name == "inbox":
        globals()["inbox"] = value = _from_environment()
        return value
    raise AttributeError(name)
