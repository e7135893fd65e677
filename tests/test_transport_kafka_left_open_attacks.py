"""Attacks on ending a transaction the broker left open (``KafkaTransactionalProducer.end_left_open``,
issue 36), on the real Apache Kafka.

The progress record's ``outbox-txn-topics`` header names the topics of a transaction; a take-over
that finds the transaction left open ends it on every partition of them. Those names were written
when the transaction was: the topic may be gone by the time the take-over reads them (an operator
deleted it, the rows of it were all failed). A topic that does not exist holds no open transaction,
so it must neither stop the take-over for good (the shard would never send again) nor be made anew
by the lookup (a deleted topic brought back with the broker's defaults).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from _kafka_transactions import wait_until
from confluent_kafka.admin import AdminClient, NewTopic

from outbox.testing import LocalKafka
from tests.conftest import own_local_kafka
from transports import Record, TransactionOutcome
from transports.kafka import KafkaTransport

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def strict_kafka() -> Iterator[LocalKafka]:
    """A broker that does not create topics on a lookup, as production clusters are usually set."""
    yield from own_local_kafka({"auto.create.topics.enable": "false"})


def made(admin: AdminClient, topic: str, partitions: int, **config: str) -> None:
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1,
                                  config=config)])[topic].result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = admin.list_topics(topic, timeout=5).topics.get(topic)
        if found is not None and found.error is None and all(
                p.leader >= 0 for p in found.partitions.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"topic {topic} has no leaders")


def exists(admin: AdminClient, topic: str) -> bool:
    found = admin.list_topics(topic, timeout=10).topics.get(topic)
    return found is not None and found.error is None and bool(found.partitions)


def test_a_deleted_topic_named_by_the_header_does_not_stop_the_take_over_for_good(
        strict_kafka: LocalKafka) -> None:
    """Broke before the fix: ``end_left_open`` raised ``RetriableTransportError`` ('Unknown topic')
    for a topic the header names that no longer exists, so the take-over failed at every batch and
    the shard never sent again."""
    bootstrap = strict_kafka.bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0,
                         "allow.auto.create.topics": False})
    made(admin, "progress", 1, **{"cleanup.policy": "compact"})
    made(admin, "orders", 2)
    transport = KafkaTransport(bootstrap_servers=bootstrap, delivery_timeout=10)
    try:
        producer = transport.transactional("outbox-attack-0", 10)
        started = time.monotonic()
        producer.end_left_open(["orders", "deleted-meanwhile"], ("progress", 0))
        assert time.monotonic() - started < 10
        assert not exists(admin, "deleted-meanwhile")
        producer.close()
    finally:
        transport.close()


def test_a_deleted_topic_named_by_the_header_is_not_made_anew(kafka: str) -> None:
    """On a broker that creates topics on a lookup (Kafka's default), ending the left-open
    transaction must not bring a deleted topic back (with the broker's default partitions)."""
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0, "allow.auto.create.topics": False})
    suffix = f"{time.monotonic_ns()}"
    progress, gone = f"attack-progress-{suffix}", f"attack-deleted-{suffix}"
    made(admin, progress, 1, **{"cleanup.policy": "compact"})
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=10)
    try:
        producer = transport.transactional(f"outbox-attack-{suffix}", 10)
        producer.end_left_open([gone], (progress, 0))
        assert not exists(admin, gone), "ending a left-open transaction made a deleted topic anew"
        producer.close()
    finally:
        transport.close()


def test_a_topic_made_anew_with_fewer_partitions_does_not_stop_the_next_producer_for_good(
        strict_kafka: LocalKafka) -> None:
    """A transaction that did not commit wrote partition 3 of a topic; the topic was then deleted and
    made anew with one partition. The next producer of the id ends what the old transaction wrote
    (``settle``): partition 3 no longer exists, and the old records went with the old topic, so there
    is nothing to end there. Broke before the fix: the empty record to partition 3 was refused
    ('Unknown partition') at every try, so ``transactional`` raised ``RetriableTransportError`` for
    good and the shard never sent again."""
    bootstrap = strict_kafka.bootstrap
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0,
                         "allow.auto.create.topics": False})
    made(admin, "progress", 1, **{"cleanup.policy": "compact"})
    made(admin, "orders", 4)
    made(admin, "refusing", 1, **{"max.message.bytes": "256"})
    tid = "outbox-attack-shrunk"
    transport = KafkaTransport(bootstrap_servers=bootstrap, delivery_timeout=10)
    try:
        producer = transport.transactional(tid, 10)
        answer = producer.send([Record("orders", b"row-1", key=b"k", partition=3),
                                Record("refusing", os.urandom(2000), key=b"big", partition=0),
                                Record("progress", b"progress", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        producer.close()
        admin.delete_topics(["orders"])["orders"].result(30)
        wait_until(lambda: not exists(admin, "orders"), 30, "the topic deleted")
        made(admin, "orders", 1)
        started = time.monotonic()
        taker = transport.transactional(tid, 10)
        assert time.monotonic() - started < 10
        assert taker.send([Record("orders", b"row-2", key=b"k", partition=0),
                           Record("progress", b"progress", key=tid.encode(), partition=0)]
                          ).outcome is TransactionOutcome.COMMITTED
        taker.close()
    finally:
        transport.close()
