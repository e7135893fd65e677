"""KafkaPythonTransport: the same conformance suite over a kafka-python-ng KafkaProducer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from _relay_helpers import publish, rows
from kafka import KafkaProducer

from outbox import ConfigurationError, Outbox, Relay, create_engine
from transports import Outcome, Record, Transport
from transports._waves import NO_REPORT
from transports.kafka_python import KafkaPythonTransport
from transports.testing import BrokerProcess, TransportConformance, read_topic


class TestKafkaPythonTransportConformance(TransportConformance):
    """On the session's Apache Kafka (the suite's tests take ``kafka``)."""

    # 5 in flight (kafka-python-ng's default, which docs/relay.md allows): client retries may
    # reorder a partition's records, never a key's, because of the waves.
    @pytest.fixture(params=[1, 5], ids=["in-flight-1", "in-flight-5"])
    def transport(self, kafka: str, request: pytest.FixtureRequest) -> Iterator[KafkaPythonTransport]:
        producer = KafkaProducer(bootstrap_servers=kafka.split(","), acks="all", linger_ms=2,
                                 max_in_flight_requests_per_connection=request.param)
        yield KafkaPythonTransport(producer, delivery_timeout=10)
        producer.close(5)


def test_needs_a_producer() -> None:
    with pytest.raises(ConfigurationError, match="KafkaProducer"):
        KafkaPythonTransport(object())


def test_is_a_transport() -> None:
    class Stub:
        def send(self): ...
        def flush(self): ...
        def partitions_for(self): ...

    assert isinstance(KafkaPythonTransport(Stub()), Transport)


def test_a_topic_the_broker_creates_on_first_use_gets_every_record_at_once(kafka: str, topic: str) -> None:
    """Apache Kafka answers the Metadata request that starts a topic's auto-creation with
    UnknownTopicOrPartition, then the first records NotLeaderForPartition until the new
    partitions' leaders are in place. Neither fails a record, and the transport sends again what
    a leader not yet in place refused (kafka-python-ng retries nothing by default): every record
    is delivered in the first publish. (Before, they came back RETRY, and the relay counted an
    attempt on each key's first row of every new topic.)"""
    producer = KafkaProducer(bootstrap_servers=kafka.split(","), acks="all")
    try:
        transport = KafkaPythonTransport(producer, delivery_timeout=10)
        records = [Record(topic=topic, value=f"{i}".encode(), key=f"k{i % 3}".encode()) for i in range(9)]
        first = transport.publish(records)
        assert [r.outcome for r in first] == [Outcome.DELIVERED] * 9, [r.error for r in first]
    finally:
        producer.close(5)


@pytest.mark.any_kafka
@pytest.mark.parametrize("acks", [1, 0, None], ids=["acks=1", "acks=0", "default acks"])
def test_settings_that_can_lose_acknowledged_records_are_refused(any_kafka: str, acks: int | None) -> None:
    settings = {} if acks is None else {"acks": acks}  # kafka-python-ng's default is acks=1
    producer = KafkaProducer(bootstrap_servers=any_kafka.split(","), **settings)
    try:
        with pytest.raises(ConfigurationError, match="acks='all'"):
            KafkaPythonTransport(producer)
    finally:
        producer.close(5)


@pytest.mark.any_kafka
@pytest.mark.parametrize("acks", ["all", -1])
def test_acks_all_is_accepted(any_kafka: str, topic: str, acks: str | int) -> None:
    """Both spellings of acks=all build a transport, and that transport delivers."""
    producer = KafkaProducer(bootstrap_servers=any_kafka.split(","), acks=acks)
    try:
        transport = KafkaPythonTransport(producer, delivery_timeout=10)
        [result] = transport.publish([Record(topic=topic, value=b"v", key=b"k")])
        assert result.outcome is Outcome.DELIVERED, result
        written = read_topic(any_kafka, topic, expected=1, timeout=20)
        assert [(r.key, r.value) for r in written] == [(b"k", b"v")]
    finally:
        producer.close(5)


@pytest.mark.slow
@pytest.mark.any_kafka
def test_a_flush_timeout_is_a_retry_per_record_not_an_error_of_the_batch(tmp_path, topic: str) -> None:
    """A broker that stops answering: each unacknowledged record comes back RETRY.

    The relay backs off (briefly) but counts no attempt on the row: nothing was
    delivered and no record got an answer, so this is an outage (DESIGN §9);
    once the broker answers again the same rows go out.
    """
    with BrokerProcess() as broker:
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap.split(","), acks="all",
                                 max_block_ms=3000)
        transport = KafkaPythonTransport(producer, delivery_timeout=1.5)
        warm = transport.publish([Record(topic=topic, value=b"warm", key=b"w")])
        assert [r.outcome for r in warm] == [Outcome.DELIVERED]  # topic and metadata known

        outbox = Outbox(create_engine(f"sqlite:///{tmp_path / 'outbox.db'}"))
        outbox.create_tables()
        publish(outbox, topic, ["a", "a", "b"])
        relay = Relay(outbox, transport)
        broker.freeze()
        result = relay.run_once()
        assert (result.sent, result.published, result.retried) == (3, 0, 2)
        stored = rows(outbox)
        assert [(r.status, r.attempts, r.last_error) for r in stored] == [
            ("pending", 0, NO_REPORT), ("pending", 0, None), ("pending", 0, NO_REPORT)
        ]
        assert all(r.available_at > r.created_at for r in (stored[0], stored[2]))  # backed off

        broker.thaw()
        for _ in range(100):
            relay.run_once()
            if not rows(outbox, status="pending"):
                break
            time.sleep(0.1)
        relay.close()
        assert {r.status for r in rows(outbox)} == {"published"}
        # To each partition's end: the records that timed out while the broker was frozen may be on
        # the topic twice, and four records could be read before the last one sent.
        values = [r.key for r in read_topic(broker.bootstrap, topic, expected=4, timeout=20, whole=True)]
        assert values.count(b"a") >= 2 and values.count(b"b") >= 1  # duplicates allowed
        producer.close(5)
