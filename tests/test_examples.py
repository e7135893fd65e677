"""The relay and billing examples do what their docstrings say, against real servers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from examples import billing_consumer, relay_postgres_kafka
from outbox import Outbox, create_engine, message_to_record, new_message_id, record_to_message
from outbox.core._envelope import serialize_payload, utcnow
from outbox.core._wire import to_record


def test_relay_example_keeps_the_sasl_password_out_of_reprs():
    settings = relay_postgres_kafka.kafka_settings("127.0.0.1:9", "relay", "s3cret-pw")
    assert settings["security_protocol"] == "SASL_SSL"
    from transports.kafka import KafkaTransport

    transport = KafkaTransport(settings)
    try:
        assert "s3cret-pw" not in repr(transport) and "sasl.password" in repr(transport)
    finally:
        transport.close(0.1)


@pytest.mark.postgres
@pytest.mark.any_kafka
def test_relay_example_publishes_from_postgresql(postgres_db, any_kafka, topic):
    outbox = Outbox(create_engine(postgres_db))
    outbox.create_tables()  # before the relay: it reads the stored shard count when built
    relay = relay_postgres_kafka.build_relay(postgres_db, any_kafka)
    with Session(outbox.engine) as session, session.begin():
        outbox.publish(session, topic, {"order_id": 1, "event": "created"}, key=1)
    result = relay.run_once()
    relay.close()
    assert result.published == 1


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:
        _Hook.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _event(order_id: int, seq: int, event: str):
    body, content_type = serialize_payload({"order_id": order_id, "event": event,
                                            "total_cents": 990})
    now = utcnow()
    return record_to_message(to_record(
        message_id=new_message_id(), topic="orders", key=str(order_id), seq=seq, payload=body,
        content_type=content_type, headers={}, created_at=now, available_at=now))


def test_billing_example_applies_once_and_alerts_the_webhook(db_url):
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.received.clear()
    try:
        inbox = billing_consumer.build_inbox(db_url, f"http://127.0.0.1:{server.server_port}/hook")
        created, paid = _event(1, 1, "created"), _event(1, 2, "paid")
        for message in (created, paid, paid, created):  # duplicates on the wire
            inbox.handle(message_to_record(message))
        orphan = _event(2, 1, "paid")  # paid for an order billing never saw: the handler fails
        inbox.handle(message_to_record(orphan))
    finally:
        server.shutdown()
    with sa.create_engine(db_url).connect() as conn:
        rows = conn.execute(sa.select(billing_consumer.ledger)).all()
    assert [(r.order_id, r.state) for r in rows] == [(1, "paid")]
    assert [(a["kind"], a["key"], a["message_id"]) for a in _Hook.received] == [
        ("key_parked", "2", str(orphan.message_id))]


def test_the_unit_test_example_passes(tmp_path):
    """examples/orders_unit_test.py: a service's unit test on OutboxTestHarness, no servers."""
    from examples import orders_unit_test

    orders_unit_test.test_placing_an_order_publishes_it_and_billing_invoices_it_once(tmp_path)
