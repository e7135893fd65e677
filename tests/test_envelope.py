"""Envelope <-> Kafka record mapping, both directions, for each payload kind."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pydantic
import pytest

from outbox import ForeignRecordError, Message, message_to_record, new_message_id, record_to_message
from outbox.core._envelope import BYTES, JSON, TEXT, serialize_payload
from transports import Record


class OrderPaid(pydantic.BaseModel):
    order_id: int
    amount: Decimal
    paid_at: datetime


NOW = datetime(2026, 11, 22, 12, 0, 0, 123456, tzinfo=UTC)
PAYLOADS = {
    "pydantic": (OrderPaid(order_id=7, amount=Decimal("9.90"), paid_at=NOW), JSON),
    "dict": ({"order_id": 7, "at": NOW, "id": uuid.UUID(int=5)}, JSON),
    "list": ([1, "two", None], JSON),
    "bytes": (b"\x00\x01binary\xff", BYTES),
    "text": ("plain text ✓", TEXT),
}


def envelope(payload: object, *, key: str | None = "order-7", delayed: bool = False) -> Message:
    body, content_type = serialize_payload(payload)
    return Message(
        message_id=new_message_id(), topic="orders", key=key, seq=3 if key else None,
        payload=body, content_type=content_type,
        headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        created_at=NOW, available_at=NOW + timedelta(seconds=30) if delayed else NOW,
    )


@pytest.mark.parametrize("kind", PAYLOADS)
def test_round_trip_through_record(kind):
    payload, content_type = PAYLOADS[kind]
    message = envelope(payload)
    assert message.content_type == content_type
    record = message_to_record(message)
    assert record.key == b"order-7" and record.value == message.payload
    assert dict(record.headers)["outbox-seq"] == b"3"
    assert record_to_message(record) == message


def test_unkeyed_and_delayed_round_trip():
    message = envelope({"a": 1}, key=None, delayed=True)
    record = message_to_record(message)
    assert record.key is None and "outbox-seq" not in dict(record.headers)
    assert record_to_message(record) == message


def test_payload_decoders():
    message = envelope(PAYLOADS["pydantic"][0])
    assert message.parse(OrderPaid) == PAYLOADS["pydantic"][0]
    assert message.json()["order_id"] == 7


def test_message_ids_are_uuid7_and_time_ordered():
    ids = [new_message_id() for _ in range(1000)]
    assert all(i.version == 7 for i in ids)
    assert ids == sorted(ids)


@pytest.mark.parametrize("headers, reason", [
    ([], "no 'outbox-message-id' header"),
    ([("outbox-message-id", b"not-a-uuid"), ("outbox-created-at", b"x")], "broken outbox envelope"),
    ([("outbox-message-id", str(uuid.uuid4()).encode())], "broken outbox envelope"),
])
def test_foreign_records_are_named(headers, reason):
    with pytest.raises(ForeignRecordError, match=reason):
        record_to_message(Record(topic="orders", value=b"{}", headers=headers))


@pytest.mark.any_kafka
def test_record_from_the_broker_decodes_to_the_same_envelope(any_kafka, topic):
    from confluent_kafka import Consumer, Producer

    sent = [envelope(payload) for payload, _ in PAYLOADS.values()]
    producer = Producer({"bootstrap.servers": any_kafka})
    for message in sent:
        record = message_to_record(message.model_copy(update={"topic": topic}))
        producer.produce(topic, value=record.value, key=record.key, headers=record.headers)
    assert producer.flush(10) == 0

    consumer = Consumer({"bootstrap.servers": any_kafka, "group.id": topic,
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10})
    consumer.subscribe([topic])
    received = []
    try:
        for _ in range(200):
            for m in consumer.consume(10, timeout=0.2):
                assert m.error() is None, m.error()
                received.append(record_to_message(Record(
                    topic=m.topic(), value=m.value(), key=m.key(),
                    headers=list(m.headers() or []), partition=m.partition(), offset=m.offset(),
                )))
            if len(received) == len(sent):
                break
    finally:
        consumer.close()
    assert received == [message.model_copy(update={"topic": topic}) for message in sent]
