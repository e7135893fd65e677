"""The FastAPI orders example: order rows and events commit together, failures leave neither."""

from __future__ import annotations

import importlib
import sys

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient


@pytest.fixture
def service(db_url, monkeypatch):
    url = sa.make_url(db_url)
    async_url = url.set(drivername="sqlite+aiosqlite" if url.get_backend_name() == "sqlite"
                        else "postgresql+psycopg")
    monkeypatch.setenv("OUTBOX_DB", async_url.render_as_string(hide_password=False))
    sys.modules.pop("examples.fastapi_orders", None)
    module = importlib.import_module("examples.fastapi_orders")
    with TestClient(module.app) as client:
        yield module, client, sa.create_engine(db_url)


def events(engine) -> list[tuple]:
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT key, seq, payload, event_type FROM outbox_messages ORDER BY id")).all()


def test_orders_and_events_commit_together(service):
    _, client, engine = service
    order_id = client.post("/orders", json={"customer": "ada", "total_cents": 990}).json()["order_id"]
    assert client.post(f"/orders/{order_id}/pay").status_code == 204
    rows = events(engine)
    assert [(key, seq) for key, seq, _, _ in rows] == [(str(order_id), 1), (str(order_id), 2)]
    assert [event_type for *_, event_type in rows] == ["orders.OrderCreated", "orders.OrderPaid"]
    assert b'"total_cents":990' in rows[1][2]

    assert client.post(f"/orders/{order_id}/pay").status_code == 409   # already paid
    assert client.post("/orders/999/pay").status_code == 404
    assert len(events(engine)) == 2, "a rejected request must leave no event behind"
    assert client.post("/orders", json={"customer": "bob", "total_cents": -1}).status_code == 422
    engine.dispose()
