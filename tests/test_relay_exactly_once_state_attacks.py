"""Attacks on fcf0a2c: a record librdkafka refuses for its transaction's failed state (``_STATE``).

The fix takes such a record for a retry for why the transaction failed (``_failed``). These check
that a transaction failed by a record the broker refuses for good, while later records wait for room
in a small queue (``queue.buffering.max.messages``), still fails that record alone, and that a
producer fenced while a record waits for room ends ``FENCED`` (no attempt counted), on Apache Kafka.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

import pytest
import tenacity
from _relay_helpers import publish, rows, wait_for
from confluent_kafka import KafkaError, KafkaException

from outbox import Outbox, Relay, create_engine
from outbox.testing import create_topic
from transports import Outcome, Record, SendResult, TransactionOutcome
from transports.kafka import KafkaTransport, _transactions

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def test_a_refusal_for_good_meeting_a_full_queue_fails_the_refused_record_only(
        kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The topic takes 2,000 bytes at most; the first of 14 records is 4,000 (random). The queue
    holds 10: the 11th waits for room, the broker refuses the request of the first ten, and
    librdkafka refuses the 11th for the failed transaction (``_STATE``). The refused records fail
    (the relay isolates the big one, below); the 11th is a retry, not a failure of its own."""
    create_topic(kafka, topic, 1, config={"max.message.bytes": "2000"})
    transport = KafkaTransport({"queue.buffering.max.messages": 10}, bootstrap_servers=kafka,
                               delivery_timeout=5.0)
    waiting = _transactions.produce_waiting
    refused: list[KafkaError] = []

    def recording(kafka_: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
        try:
            return waiting(kafka_, deadline, *args, **kwargs)
        except KafkaException as exc:
            refused.append(exc.args[0])
            raise

    producer = transport.transactional("outbox-test-state-refused", 5.0)
    try:
        warm = producer.send([Record(topic, b"warm", key=b"k")])
        assert warm.outcome is TransactionOutcome.COMMITTED, warm
        monkeypatch.setattr(_transactions, "produce_waiting", recording)
        big = base64.b64encode(os.urandom(3000))
        answer = producer.send([Record(topic, big, key=b"big"),
                                *(Record(topic, b"%d" % i, key=b"k%d" % i) for i in range(1, 14))])
    finally:
        producer.close()
        transport.close()
    assert [e.code() for e in refused] == [KafkaError._STATE]
    assert answer.outcome is TransactionOutcome.ABORTED, answer
    assert answer.results[0].outcome is Outcome.FAILED
    assert [r.outcome for r in answer.results] == [Outcome.FAILED] * 10 + [Outcome.RETRY] * 4, answer
    assert "too large" in (answer.results[10].error or "").lower(), answer.results[10]


def test_a_relay_fails_alone_the_record_refused_for_good_when_its_transaction_meets_a_full_queue(
        sqlite_db: str, kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The case above through an exactly-once relay: 33 rows of one shard, the 4th too large for its
    topic, a queue of 10. Its transactions meet ``_STATE`` (at least once) and the broker's refusal
    of whole requests; the big row fails alone, and every other row is published with the one
    attempt that delivered it (none counted for the aborted transactions)."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    create_topic(kafka, topic, 1, config={"max.message.bytes": "2000"})
    keys = [f"k{k}" for k in range(30)]
    publish(outbox, topic, keys[:3])
    publish(outbox, topic, ["poison"], payload={"big": base64.b64encode(os.urandom(3000)).decode()})
    publish(outbox, topic, [*keys[3:], None, None])
    transport = KafkaTransport({"queue.buffering.max.messages": 10}, bootstrap_servers=kafka,
                               delivery_timeout=5.0)
    waiting = _transactions.produce_waiting
    refused: list[KafkaError] = []

    def recording(kafka_: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
        try:
            return waiting(kafka_, deadline, *args, **kwargs)
        except KafkaException as exc:
            refused.append(exc.args[0])
            raise

    monkeypatch.setattr(_transactions, "produce_waiting", recording)
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=f"{topic}-progress",
                  backoff=tenacity.wait_fixed(0.2))
    wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 60, "every row settled")
    relay.close()
    stored = rows(outbox)
    assert [r.key for r in stored if r.status == "failed"] == ["poison"]
    assert [(r.key, r.attempts, r.last_error) for r in stored if r.attempts != 1] == []
    assert refused and {e.code() for e in refused} == {KafkaError._STATE}, refused
    engine.dispose()


def test_a_producer_fenced_while_a_record_waits_for_room_ends_fenced(
        kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer producer of the id is made while the 11th record waits for room in a queue of 10, and each
    record after is answered (refused for the old epoch) before the next is produced: the transaction
    ends ``FENCED`` (the relay counts no attempt for it), not aborted with a retry the broker answered.
    (librdkafka let each of them be produced: no ``produce()`` raised here.)"""
    create_topic(kafka, topic, 1)
    transport = KafkaTransport({"queue.buffering.max.messages": 10}, bootstrap_servers=kafka,
                               delivery_timeout=5.0)
    waiting = _transactions.produce_waiting
    newer: list[Any] = []

    def fencing(kafka_: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
        if len(kafka_) >= 10 and not newer:
            newer.append(transport.transactional("outbox-test-state-fenced", 5.0))
        if newer:
            until = time.monotonic() + 10
            while len(kafka_) and time.monotonic() < until:  # each record answered before the next
                kafka_.poll(0.1)
        return waiting(kafka_, deadline, *args, **kwargs)

    producer = transport.transactional("outbox-test-state-fenced", 5.0)
    try:
        warm = producer.send([Record(topic, b"warm", key=b"k")])
        assert warm.outcome is TransactionOutcome.COMMITTED, warm
        monkeypatch.setattr(_transactions, "produce_waiting", fencing)
        answer = producer.send([Record(topic, b"%d" % i, key=b"k%d" % i) for i in range(14)])
    finally:
        producer.close()
        for p in newer:
            p.close()
        transport.close()
    assert answer.outcome is TransactionOutcome.FENCED, answer
