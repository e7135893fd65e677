"""Checked by mypy --strict in test_typing.py: how a typed service uses the producer API.

Not collected by pytest (no ``test_`` prefix); ``run`` is also executed there.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import AsyncOutbox, Outbox, create_async_engine, create_engine


def build(url: str) -> Outbox:
    return Outbox(create_engine(url))


def run(outbox: Outbox) -> list[str]:
    @outbox.transactional
    def place_order(session: Session, order_id: int, *, note: str = "") -> str:
        outbox.publish(session, "orders", {"id": order_id}, key=order_id)
        return note

    done: list[str] = [place_order(1, note="first")]  # no session=: the decorator opens it
    with outbox.begin() as session:  # the other way: a block that commits at its end
        outbox.publish(session, "orders", {"id": 2}, key=2)
    return done


async def run_async(url: str) -> int:
    outbox = Outbox(create_async_engine(url))

    @outbox.transactional
    async def place(session: AsyncSession, order_id: int) -> int:
        await outbox.publish_async(session, "orders", {"id": order_id}, key=order_id)
        return order_id

    number: int = await place(4)
    async with outbox.begin_async() as session:
        await outbox.publish_async(session, "orders", {"id": number + 1}, key=number + 1)
    return number


async def run_async_outbox(url: str) -> list[int]:
    """The async flavour by its own name: ``await publish``, ``async with begin()``, typed ``await``s."""
    outbox = AsyncOutbox(create_async_engine(url))
    await outbox.create_tables()

    @outbox.transactional
    async def place(session: AsyncSession, order_id: int) -> int:
        await outbox.publish(session, "orders", {"id": order_id}, key=order_id)
        return order_id

    placed: list[int] = [await place(7)]
    async with outbox.begin() as session:
        await outbox.publish(session, "orders", {"id": 8}, key=7)
    placed.append((await outbox.load_schema()).shard_count)
    await outbox.engine.dispose()
    return placed
