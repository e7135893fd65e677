"""A billing service on FastStream: the orders example's events, each applied once, per order in seq order.

It consumes the ``orders`` events that examples/fastapi_orders.py publishes
(through a relay) into an ``invoices`` table of the same database, with an
async inbox and one typed handler per event (examples/order_events.py):
``OrderCreated`` opens an invoice, ``OrderPaid`` marks it paid; any other event
type on the topic parks its order until a handler for it is deployed.
A duplicate is dropped, a ``paid`` that overtook its ``created`` waits for it,
and an event that fails three times parks its order (only its order). One
command runs it:

    OUTBOX_INBOX_DB=postgresql+asyncpg://app@db/app OUTBOX_BOOTSTRAP_SERVERS=broker-1:9092 \\
    faststream run examples.faststream_billing:app

and one replays a parked order after the fix, with the same environment:

    outbox parked replay orders ORDER_ID --app examples.faststream_billing:inbox
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sqlalchemy as sa
from faststream import FastStream
from faststream.confluent import KafkaBroker
from sqlalchemy.ext.asyncio import AsyncSession

from examples.order_events import OrderCreated, OrderPaid
from outbox import Inbox, WebhookAlertSink, create_async_engine
from outbox.faststream import subscribe, sweeping

DATABASE_URL = os.environ.get("OUTBOX_INBOX_DB", "sqlite+aiosqlite:///orders.db")
KAFKA_BOOTSTRAP = os.environ.get("OUTBOX_BOOTSTRAP_SERVERS", "localhost:9092")

billing = sa.MetaData()
invoices = sa.Table(
    "invoices", billing,
    sa.Column("order_id", sa.Integer, primary_key=True),
    sa.Column("customer", sa.String(100), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("state", sa.String(10), nullable=False),
)


# The inbox's own engine: asyncpg connections belong to the event loop that opened them, and the
# inbox runs its transactions on a loop of its own, not FastStream's.
inbox = Inbox(create_async_engine(DATABASE_URL), group="billing",
              alert=WebhookAlertSink(url) if (url := os.environ.get("OUTBOX_ALERT_WEBHOOK")) else None)


@inbox.handler("orders", OrderCreated)
async def open_invoice(session: AsyncSession, order: OrderCreated) -> None:
    await session.execute(invoices.insert().values(
        order_id=order.order_id, customer=order.customer, amount_cents=order.total_cents, state="open"))


@inbox.handler("orders", OrderPaid)
async def mark_paid(session: AsyncSession, order: OrderPaid) -> None:
    paid = await session.execute(invoices.update().where(invoices.c.order_id == order.order_id)
                                 .values(state="paid"))
    if paid.rowcount != 1:  # cannot happen in seq order; fail (and park) loudly if it ever does
        raise LookupError(f"order {order.order_id} paid before it was created")


# FastStream would create a missing topic with the broker's defaults; the topic belongs to the
# producer's side (the relay's first send creates it on an auto-creating cluster).
broker = KafkaBroker(KAFKA_BOOTSTRAP, allow_auto_create_topics=False)
subscribe(broker, inbox, auto_offset_reset="earliest")  # a new billing group bills every order


def _create_tables() -> None:
    inbox.create_tables()  # in production: Alembic migrations instead
    inbox.run_database(lambda: billing.create_all(inbox.engine))


@asynccontextmanager
async def lifespan() -> AsyncIterator[None]:
    await asyncio.to_thread(_create_tables)
    async with sweeping(inbox):  # parks orders whose missing event never comes
        yield


app = FastStream(broker, lifespan=lifespan)
