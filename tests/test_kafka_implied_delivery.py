"""A record librdkafka reports delivered without an offset is sent again, not marked published.

On a real Apache Kafka, behind a proxy (``_kafka_proxy``) that sends one produce
request to a partition that does not exist (the broker refuses it, writes nothing
of it, and the client retries such a refusal) and holds its answer until the request
behind it was taken: librdkafka reports the refused request's record delivered,
with no offset, and it is in no log (``transports/kafka/_implied.py``). This is
what a clean-clone CI run met on a topic its first send created.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _kafka_protocol import known_producers
from _kafka_proxy import HoldingProxy
from confluent_kafka import Consumer, Producer, TopicPartition
from conftest import unavailable

from outbox.testing import LocalKafka, create_topic
from transports import Outcome, Record, TransactionOutcome
from transports.kafka import KafkaTransport

pytestmark = pytest.mark.kafka


FORGETFUL = {"producer.id.expiration.ms": "1500", "producer.id.expiration.check.interval.ms": "250"}
"""The broker forgets a producer id on a partition 1.5 s after its last write there (a day by default)."""


class Relayed:
    """A broker whose RELAYED listener is reached through the proxy; the tests' own clients go direct."""

    def __init__(self, proxy: HoldingProxy, kafka: LocalKafka) -> None:
        self.proxy, self.kafka = proxy, kafka
        self.through_proxy = f"127.0.0.1:{proxy.port}"
        self.direct = kafka.bootstrap


@pytest.fixture(scope="module")
def relayed() -> Iterator[Relayed]:
    proxy = HoldingProxy()
    try:
        kafka = LocalKafka(FORGETFUL, relayed_at=proxy.port)
    except FileNotFoundError as exc:
        proxy.close()
        unavailable(str(exc))
    assert kafka.nodes[0].relayed is not None
    proxy.forward_to(kafka.nodes[0].relayed[0])
    try:
        yield Relayed(proxy, kafka)
    finally:
        kafka.close()
        proxy.close()


def log_of(bootstrap: str, topic: str, partition: int = 0) -> list[bytes]:
    """The values in ``topic``'s ``partition``, in offset order, read to its end (read_committed)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "log_level": 3})
    try:
        part = TopicPartition(topic, partition, 0)
        end = consumer.get_watermark_offsets(part, timeout=30)[1]
        if end == 0:
            return []  # nothing to read, and no position to wait for
        consumer.assign([part])
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while consumer.position([part])[0].offset < end:
            assert time.monotonic() < deadline, f"{topic}[{partition}] not read to its end {end}"
            for message in consumer.consume(100, 0.5):
                if message.error() is None:
                    values.append(message.value())
        return values
    finally:
        consumer.close()


def new_topic(relayed: Relayed) -> str:
    topic = f"implied-{uuid.uuid4().hex[:10]}"
    create_topic(relayed.direct, topic, 1)
    return topic


UNPROVEN = "reported delivered without an offset"
"""What a record librdkafka implied delivered comes back with (``transports/kafka/_implied.py``)."""

ONE_RECORD_A_REQUEST = {"batch.num.messages": 1, "linger.ms": 0}
"""Each record in a request of its own, so the first record's request can be refused alone."""


def test_librdkafka_reports_a_record_it_did_not_write_as_delivered_without_an_offset(
        relayed: Relayed) -> None:
    """The premise: if librdkafka stops implying deliveries (or Kafka starts checking a new producer's
    first sequence), this fails, and ``_implied`` can be revisited."""
    topic = new_topic(relayed)
    reports: dict[bytes, tuple[Any, int | None]] = {}
    producer = Producer({"bootstrap.servers": relayed.through_proxy, "enable.idempotence": True,
                         "acks": "all", "enable.gapless.guarantee": True, "log_level": 3,
                         **ONE_RECORD_A_REQUEST})
    producer.list_topics(topic, timeout=10)
    relayed.proxy.arm(release_at=2)
    for value in (b"r1", b"r2"):
        producer.produce(topic, value, b"k", 0,
                         on_delivery=lambda error, message: reports.__setitem__(
                             message.value(), (error, message.offset())))
        producer.poll(0)
    assert producer.flush(30) == 0
    assert reports == {b"r1": (None, None), b"r2": (None, 0)}  # both "delivered"; one has no offset
    assert log_of(relayed.direct, topic) == [b"r2"]  # and only one was written


def test_a_new_producers_first_record_to_a_partition_goes_alone(relayed: Relayed) -> None:
    """``_first_contact``: the first request is refused and answered a second later; nothing of the
    partition went behind it, so the key is written in order, all in one ``publish``. Pipelined
    with it, r2 would have been written first."""
    topic = new_topic(relayed)
    transport = KafkaTransport({"bootstrap.servers": relayed.through_proxy, **ONE_RECORD_A_REQUEST})
    try:
        records = [Record(topic, value, key) for value, key in
                   ((b"r1", b"k"), (b"r2", b"k"), (b"o1", b"other"), (b"r3", b"k"))]
        relayed.proxy.arm(release_at=2, hold_for=1.0)
        results = transport.publish(records)
    finally:
        transport.close()
    assert [r.outcome for r in results] == [Outcome.DELIVERED] * 4, results
    assert log_of(relayed.direct, topic) == [b"r1", b"r2", b"o1", b"r3"]


def forgotten(relayed: Relayed, topic: str, timeout: float = 30.0) -> None:
    """Wait until the broker knows no producer on the topic's partition (``FORGETFUL``), as it
    says itself (DescribeProducers): a loaded host may run its expiry check late."""
    deadline = time.monotonic() + timeout
    while known_producers(relayed.direct, topic, 0):
        assert time.monotonic() < deadline, f"the broker knows a producer on {topic} after {timeout:g} s"
        time.sleep(0.1)


def test_a_record_implied_delivered_is_sent_again(relayed: Relayed) -> None:
    """``_implied``: the partition written before (so not contacted alone again), the broker has
    forgotten the producer since (``producer.id.expiration.ms``): its next first request refused and
    the one behind taken, librdkafka reports the refused record delivered without an offset."""
    topic = new_topic(relayed)
    transport = KafkaTransport({"bootstrap.servers": relayed.through_proxy, **ONE_RECORD_A_REQUEST})
    try:
        assert transport.publish([Record(topic, b"r0", b"k")])[0].outcome is Outcome.DELIVERED
        forgotten(relayed, topic)
        records = [Record(topic, value, b"k") for value in (b"r1", b"r2")]
        relayed.proxy.arm(release_at=2)
        first = transport.publish(records)
        # r1 was refused, r2 taken and written first; r1 comes back to be sent again, and r2, behind
        # an undelivered record of its key, too (a duplicate, which consumers drop by message id).
        assert [r.outcome for r in first] == [Outcome.RETRY, Outcome.RETRY], first
        assert first[0].error is not None and UNPROVEN in first[0].error
        again = transport.publish(records)
        assert [r.outcome for r in again] == [Outcome.DELIVERED, Outcome.DELIVERED], again
    finally:
        transport.close()
    log = log_of(relayed.direct, topic)
    assert log == [b"r0", b"r2", b"r1", b"r2"], log


def test_a_transaction_holding_a_record_it_was_not_told_was_written_is_aborted(relayed: Relayed) -> None:
    """Exactly-once mode: committed, the transaction would have sealed its other records without r1."""
    topic = new_topic(relayed)
    transport = KafkaTransport({"bootstrap.servers": relayed.through_proxy})
    try:
        producer = transport.transactional(f"implied-{uuid.uuid4().hex[:8]}", 10.0, one_per_request=True)
        # The last record goes once the others' reports came: r1 and r2 are on their way together.
        records = [Record(topic, value, b"k") for value in (b"r1", b"r2", b"r3")]
        relayed.proxy.arm(release_at=2)
        first = producer.send(records)
        assert first.outcome is TransactionOutcome.ABORTED, first
        assert first.error is not None and UNPROVEN in first.error
        assert all(r.outcome is Outcome.RETRY for r in first.results), first
        again = producer.send(records)
        assert again.outcome is TransactionOutcome.COMMITTED, again
    finally:
        transport.close()
    assert log_of(relayed.direct, topic) == [b"r1", b"r2", b"r3"]



def test_a_topic_found_only_after_the_first_contacts_gets_none_of_its_records_pipelined(
        relayed: Relayed) -> None:
    """A batch over two topics: ``late`` is unknown when the first contacts look up partitions and
    created while ``first``'s first record is on its way. Looked up again when the batch was
    pipelined, ``late``'s key went with no first contact: its first request refused, the one behind
    it was written ahead of it (the log held b2 alone). It now comes back with the lookup's answer,
    the key's order kept for the next batch's first contact."""
    first = new_topic(relayed)
    late = f"implied-late-{uuid.uuid4().hex[:8]}"
    transport = KafkaTransport({"bootstrap.servers": relayed.through_proxy, **ONE_RECORD_A_REQUEST,
                                "allow.auto.create.topics": False,
                                "topic.metadata.propagation.max.ms": 100}, delivery_timeout=15)

    def create_late_topic_while_first_is_held() -> None:
        relayed.proxy.wait(lambda: relayed.proxy.answers_held >= 1, 10, "the first contact's answer")
        create_topic(relayed.direct, late, 1)
        relayed.proxy.arm(topic=late, release_at=2)  # late's first request, had it gone pipelined
        relayed.proxy.release_answers()

    try:
        records = [Record(first, b"a1", b"k"), Record(late, b"b1", b"kb"), Record(late, b"b2", b"kb")]
        relayed.proxy.arm(topic=first)
        helper = threading.Thread(target=create_late_topic_while_first_is_held)
        helper.start()
        results = transport.publish(records)
        helper.join()
    finally:
        transport.close()
        relayed.proxy.disarm()
    assert results[0].outcome is Outcome.DELIVERED, results
    assert [r.outcome for r in results[1:]] != [Outcome.DELIVERED] * 2, results
    assert log_of(relayed.direct, late) in ([], [b"b1"], [b"b1", b"b2"])  # never b2 ahead of b1
