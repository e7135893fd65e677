"""The FastStream billing example bills what the FastAPI orders example publishes, through a relay:
the documented command, against a Kafka-protocol broker and PostgreSQL."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from examples import relay_postgres_kafka
from transports.kafka import embedded_kafka

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[1]


def place_and_pay_orders(db: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Order 1 placed and paid, order 2 placed: three events in the outbox."""
    url = sa.make_url(db).set(drivername="postgresql+psycopg")
    monkeypatch.setenv("DATABASE_URL", url.render_as_string(hide_password=False))
    sys.modules.pop("examples.fastapi_orders", None)
    orders = importlib.import_module("examples.fastapi_orders")
    with TestClient(orders.app) as client:
        ids = [client.post("/orders", json={"customer": name, "total_cents": cents}).json()["order_id"]
               for name, cents in (("ada", 990), ("bob", 120))]
        assert client.post(f"/orders/{ids[0]}/pay").status_code == 204
    return ids


def invoices(db: str) -> list[tuple[int, str, int, str]]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("invoices"):
                return []
            return [tuple(r) for r in conn.execute(sa.text(
                "SELECT order_id, customer, amount_cents, state FROM invoices ORDER BY order_id"))]
    finally:
        engine.dispose()


def test_the_billing_service_bills_every_order_once(postgres_db: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = place_and_pay_orders(postgres_db, monkeypatch)
    # A broker of its own: the example's topic is the fixed name "orders".
    with embedded_kafka() as servers:
        relay = relay_postgres_kafka.build_relay(postgres_db, servers)
        assert relay.run_once().published == 3
        relay.close()
        billing_db = sa.make_url(postgres_db).set(drivername="postgresql+asyncpg")
        service = subprocess.Popen(
            [sys.executable, "-m", "faststream", "run", "examples.faststream_billing:app"], cwd=ROOT,
            env={**os.environ, "DATABASE_URL": billing_db.render_as_string(hide_password=False),
                 "KAFKA_BOOTSTRAP": servers})
        try:
            expected = [(first, "ada", 990, "paid"), (second, "bob", 120, "open")]
            deadline = time.monotonic() + 60
            while invoices(postgres_db) != expected:
                assert service.poll() is None, f"the service exited with {service.returncode}"
                assert time.monotonic() < deadline, f"invoices: {invoices(postgres_db)}"
                time.sleep(0.2)
        finally:
            service.terminate()
            assert service.wait(30) == 0
