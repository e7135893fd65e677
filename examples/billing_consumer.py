"""A billing consumer: the inbox around a handler, alerts to a webhook.

Each order event is applied once, in per-order sequence; a message that fails
three times parks its order (and only its order) and POSTs one alert.

    OUTBOX_INBOX_DB=postgresql+psycopg://billing@db/billing \\
    OUTBOX_ALERT_WEBHOOK=https://hooks.example/outbox OUTBOX_BOOTSTRAP_SERVERS=broker-1:9092 \\
    outbox inbox run examples.billing_consumer:inbox
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Inbox, Message, WebhookAlertSink, create_engine

metadata = sa.MetaData()
ledger = sa.Table(
    "ledger", metadata,
    sa.Column("order_id", sa.Integer, primary_key=True),
    sa.Column("state", sa.String(10), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
)


def build_inbox(db_url: str, alert_webhook: str) -> Inbox:
    engine = create_engine(db_url)
    inbox = Inbox(engine, group="billing", alert=WebhookAlertSink(alert_webhook),
                  concurrency=16, batch_size=50)
    inbox.create_tables()
    metadata.create_all(engine)

    @inbox.handler("orders")
    def apply_order_event(session: Session, message: Message) -> None:
        event = message.json()
        if event["event"] == "created":
            session.execute(ledger.insert().values(order_id=event["order_id"], state="open",
                                                   amount_cents=event.get("total_cents", 0)))
        elif event["event"] == "paid":
            updated = session.execute(ledger.update()
                                      .where(ledger.c.order_id == event["order_id"])
                                      .values(state="paid")).rowcount
            if updated != 1:  # cannot happen in seq order; fail loudly if it ever does
                raise LookupError(f"paid before created for order {event['order_id']}")

    return inbox


def __getattr__(name: str) -> Inbox:
    if name == "inbox":  # built on first use, from the environment (see the docstring)
        globals()["inbox"] = value = build_inbox(os.environ["OUTBOX_INBOX_DB"],
                                                 os.environ["OUTBOX_ALERT_WEBHOOK"])
        return value
    raise AttributeError(name)
