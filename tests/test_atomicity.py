"""The business rows and the outbox rows commit together or not at all."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from outbox import Outbox, create_async_engine

business = sa.MetaData()
orders = sa.Table("orders", business, sa.Column("id", sa.Integer, primary_key=True))


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """This proof runs on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


def counts(engine: sa.Engine, outbox: Outbox) -> tuple[int, int]:
    with engine.connect() as conn:
        return (
            conn.scalar(sa.select(sa.func.count()).select_from(orders)),
            conn.scalar(sa.select(sa.func.count()).select_from(outbox.tables.messages)),
        )


def test_raise_leaves_neither_row_and_return_leaves_both(engine, outbox):
    business.create_all(engine)

    @outbox.transactional
    def place_order(order_id: int, *, fail: bool, session) -> None:
        session.execute(orders.insert().values(id=order_id))
        outbox.publish(session, "orders", {"order_id": order_id}, key=order_id)
        if fail:
            raise RuntimeError("payment declined")

    with pytest.raises(RuntimeError, match="payment declined"):
        place_order(1, fail=True)
    assert counts(engine, outbox) == (0, 0)

    place_order(2, fail=False)
    assert counts(engine, outbox) == (1, 1)


def test_caller_session_is_joined_not_committed(engine, outbox):
    """With session= given the decorator neither begins nor commits."""
    business.create_all(engine)

    @outbox.transactional
    def place_order(order_id: int, *, session) -> None:
        session.execute(orders.insert().values(id=order_id))
        outbox.publish(session, "orders", {"order_id": order_id}, key=order_id)

    with sa.orm.Session(engine) as session:
        session.begin()
        place_order(7, session=session)
        place_order(8, session=session)
        session.rollback()
    assert counts(engine, outbox) == (0, 0)


def _async_url(sync_url: str) -> str:
    url = sa.make_url(sync_url)
    driver = {"sqlite": "sqlite+aiosqlite", "mysql": "mysql+asyncmy", "mariadb": "mariadb+asyncmy"}
    return url.set(drivername=driver.get(url.get_backend_name(), "postgresql+psycopg")).render_as_string(
        hide_password=False)


def test_async_raise_leaves_neither_row_and_return_leaves_both(db_url, engine):
    async def scenario() -> None:
        async_engine = create_async_engine(_async_url(db_url))
        outbox = Outbox(async_engine)
        await outbox.create_tables_async()
        async with async_engine.begin() as conn:
            await conn.run_sync(business.create_all)

        @outbox.transactional
        async def place_order(order_id: int, *, fail: bool, session) -> None:
            await session.execute(orders.insert().values(id=order_id))
            await outbox.publish_async(session, "orders", {"order_id": order_id}, key=order_id)
            if fail:
                raise RuntimeError("payment declined")

        with pytest.raises(RuntimeError):
            await place_order(1, fail=True)
        assert counts(engine, outbox) == (0, 0)
        await place_order(2, fail=False)
        assert counts(engine, outbox) == (1, 1)
        await async_engine.dispose()

    asyncio.run(scenario())


def test_decorator_refuses_functions_it_cannot_serve(engine, outbox):
    from outbox import ConfigurationError

    with pytest.raises(ConfigurationError, match="'session' keyword"):
        outbox.transactional(lambda order_id: None)

    async def async_fn(*, session):  # pragma: no cover - never called
        return None

    with pytest.raises(ConfigurationError, match="async but this Outbox has a sync engine"):
        outbox.transactional(async_fn)
