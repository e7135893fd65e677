"""An orders service: FastAPI, SQLAlchemy's AsyncSession and the outbox decorator.

Placing an order writes the order row and its ``OrderCreated`` event in one
transaction; paying it writes the state change and ``OrderPaid``. Each event is a
pydantic model (examples/order_events.py): the outbox sends its event type with it,
and consumers choose a handler by it. A relay
process (see relay_postgres_kafka.py) publishes the events to Kafka.

    OUTBOX_DB=sqlite+aiosqlite:///orders.db uvicorn examples.fastapi_orders:app
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import pydantic
import sqlalchemy as sa
from fastapi import FastAPI, HTTPException

from examples.order_events import OrderCreated, OrderPaid
from outbox import AsyncOutbox, create_async_engine

DATABASE_URL = os.environ.get("OUTBOX_DB", "sqlite+aiosqlite:///orders.db")

engine = create_async_engine(DATABASE_URL)
outbox = AsyncOutbox(engine)
orders = sa.Table(
    "orders", outbox.tables.metadata,  # one MetaData: Alembic sees business and outbox tables
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("customer", sa.String(100), nullable=False),
    sa.Column("total_cents", sa.Integer, nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
)


class NewOrder(pydantic.BaseModel):
    customer: str
    total_cents: int = pydantic.Field(gt=0)


@outbox.transactional
async def place_order(order: NewOrder, *, session) -> int:
    result = await session.execute(
        orders.insert().values(customer=order.customer, total_cents=order.total_cents,
                               state="created").returning(orders.c.id))
    order_id = result.scalar_one()
    await outbox.publish(session, "orders", OrderCreated(order_id=order_id, **order.model_dump()),
                         key=order_id)
    return order_id


@outbox.transactional
async def pay_order(order_id: int, *, session) -> None:
    row = (await session.execute(
        sa.select(orders).where(orders.c.id == order_id).with_for_update())).one_or_none()
    if row is None:
        raise HTTPException(404, f"no order {order_id}")
    if row.state != "created":
        raise HTTPException(409, f"order {order_id} is {row.state}, not created")
    await session.execute(orders.update().where(orders.c.id == order_id).values(state="paid"))
    await outbox.publish(session, "orders", OrderPaid(order_id=order_id, total_cents=row.total_cents),
                         key=order_id)


@asynccontextmanager
async def lifespan(_: FastAPI):
    await outbox.create_tables()  # in production: Alembic migrations instead
    yield
    await engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)


@app.post("/orders", status_code=201)
async def create_order(order: NewOrder) -> dict:
    return {"order_id": await place_order(order)}


@app.post("/orders/{order_id}/pay", status_code=204)
async def pay(order_id: int) -> None:
    await pay_order(order_id)
