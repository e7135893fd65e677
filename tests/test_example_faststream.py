"""The FastStream billing example bills what the FastAPI orders example publishes, through a relay:
the documented commands (run, and replay a parked order), against a Kafka-protocol broker and PostgreSQL."""

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
from sqlalchemy.orm import Session

from examples import relay_postgres_kafka
from examples.order_events import OrderPaid
from outbox import Inbox, Outbox, create_engine
from transports.kafka import embedded_kafka

pytestmark = [pytest.mark.any_kafka, pytest.mark.postgres, pytest.mark.slow]  # two processes, ~20 s

ROOT = Path(__file__).resolve().parents[1]


def place_and_pay_orders(db: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Order 1 placed and paid, order 2 placed: three events in the outbox."""
    url = sa.make_url(db).set(drivername="postgresql+psycopg")
    monkeypatch.setenv("OUTBOX_DB", url.render_as_string(hide_password=False))
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
        billing_db = sa.make_url(postgres_db).set(drivername="postgresql+asyncpg")
        env = {**os.environ, "OUTBOX_INBOX_DB": billing_db.render_as_string(hide_password=False),
               "OUTBOX_BOOTSTRAP_SERVERS": servers}
        service = subprocess.Popen(
            [sys.executable, "-m", "faststream", "run", "examples.faststream_billing:app"], cwd=ROOT, env=env)
        try:
            expected = [(first, "ada", 990, "paid"), (second, "bob", 120, "open")]
            wait_until(lambda: invoices(postgres_db) == expected, service, "the orders billed")

            # An order billing never saw the creation of: paid fails three times and parks the order.
            outbox = Outbox(create_engine(postgres_db))
            with Session(outbox.engine) as session, session.begin():
                outbox.publish(session, "orders", OrderPaid(order_id=999, total_cents=5), key=999)
            assert relay.run_once().published == 1
            inbox = Inbox(outbox.engine, group="billing")
            wait_until(lambda: len(inbox.parked("orders", "999")) == 1, service, "order 999 parked")

            with outbox.engine.begin() as conn:  # the fix: the missing invoice, entered by hand
                conn.execute(sa.text("INSERT INTO invoices VALUES (999, 'eve', 5, 'open')"))
            replay = subprocess.run(
                [sys.executable, "-m", "outbox", "parked", "replay", "orders", "999",
                 "--app", "examples.faststream_billing:inbox", "--by", "test", "--reason", "invoice entered"],
                cwd=ROOT, env=env, capture_output=True,
                text=True, timeout=120)
            assert replay.returncode == 0, replay.stdout + replay.stderr
            assert invoices(postgres_db)[-1] == (999, "eve", 5, "paid")
            assert inbox.parked() == []
            outbox.engine.dispose()
        finally:
            relay.close()
            service.terminate()
            assert service.wait(30) == 0


def wait_until(condition, service: subprocess.Popen[bytes], what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 60
    while not condition():
        assert service.poll() is None, f"the service exited with {service.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
