"""``KafkaSource`` against the session's Kafka-protocol broker, and its settings checks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from outbox import CommitUnconfirmedError, ConfigurationError
from transports import Record, Source
from transports.kafka import KafkaSource
from transports.testing import SourceConformance

FAST = {"fetch_max_wait_ms": 10, "session_timeout_ms": 4000, "heartbeat_interval_ms": 500}


def test_settings_are_checked_when_the_source_is_built() -> None:
    with pytest.raises(ConfigurationError, match="unknown Kafka setting 'linger'"):
        KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], linger=5)
    with pytest.raises(ConfigurationError, match=r"enable\.auto\.commit must stay off"):
        KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                    enable_auto_commit=True)
    with pytest.raises(ConfigurationError, match="invalid Kafka setting"):
        KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                    session_timeout_ms="soon")
    with pytest.raises(ConfigurationError, match="topics"):
        KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics="t")
    with pytest.raises(ValueError, match="invalid topic"):
        KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["a topic"])
    with pytest.raises(ConfigurationError, match="group_id"):
        KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="", topics=["t"])


def test_secrets_do_not_show_in_repr() -> None:
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                         security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                         sasl_plain_username="svc", sasl_plain_password="hunter2")
    try:
        assert "hunter2" not in repr(source)
        assert isinstance(source, Source)
        assert source.config["enable.auto.offset.store"] is False
        assert source.config["auto.offset.reset"] == "earliest"
    finally:
        source.close()


def test_the_source_reads_committed_and_says_so_at_start_when_told_otherwise(
        caplog: pytest.LogCaptureFixture) -> None:
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"])
    source.close()
    assert source.config["isolation.level"] == "read_committed"
    assert not [r for r in caplog.records if "isolation.level" in r.getMessage()]
    other = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                        isolation_level="read_uncommitted")
    other.close()
    (warning,) = [r for r in caplog.records if "isolation.level=read_uncommitted" in r.getMessage()]
    assert warning.levelname == "WARNING" and "aborted Kafka transactions" in warning.getMessage()


@pytest.mark.kafka
def test_records_of_an_aborted_transaction_never_reach_the_source(kafka: str, topic: str) -> None:
    """Apache Kafka itself (the mock cluster ignores read_committed): an exactly-once relay's
    aborted batch is invisible to the inbox. (Read uncommitted, the source gets both.)"""
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"{topic}-tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"aborted", b"k", partition=0)
    producer.flush(10)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, b"committed", b"k", partition=0)
    producer.commit_transaction(30)
    source = KafkaSource(bootstrap_servers=kafka, group_id=f"g-{topic}", topics=[topic], **FAST)
    try:
        records = poll_until(source, 1)
        records += source.poll(100, 1.0)  # anything behind it
    finally:
        source.close()
    assert [r.value for r in records] == [b"committed"]


def poll_until(source: KafkaSource, count: int, timeout: float = 30.0) -> list:  # type: ignore[type-arg]
    records: list = []  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while len(records) < count and time.monotonic() < deadline:
        records.extend(source.poll(100, 0.2))
    return records


class _Fetched:
    """A consumed message as confluent-kafka hands it over (the parts ``poll`` reads)."""

    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._at = (topic, partition, offset)

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]

    def value(self) -> bytes:
        return b"v"

    def key(self) -> bytes:
        return b"k"

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return 0, 0


def test_a_record_whose_partition_is_revoked_before_the_poll_returns_is_dropped() -> None:
    """``poll`` takes the first record and what is queued behind it in two calls; a rebalance in the
    second revokes a partition the first call's record came from. The revoke callback committed
    and forgot that partition, so the record is not the consumer's any more: handed over, it would
    be tracked again and its offset committed by a consumer that no longer owns it. librdkafka
    drops such records within one call, never across two."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"])
    revoked: list[list[tuple[str, int]]] = []
    source.on_revoke(revoked.append)

    class RebalancingBetweenCalls:
        """The second call serves a revoke of partition 0, as librdkafka serves rebalance callbacks."""

        def consume(self, num_messages: int, timeout: float) -> list[_Fetched]:
            if num_messages == 1:
                return [_Fetched("t", 0, 7)]
            source._revoked(self, [TopicPartition("t", 0)])  # type: ignore[arg-type]
            return [_Fetched("t", 1, 3)]

    real, source._consumer = source._consumer, RebalancingBetweenCalls()  # type: ignore[assignment]
    source._assignment = frozenset({("t", 0), ("t", 1)})
    try:
        records = source.poll(500, 0.1)
    finally:
        source._consumer = real
        source.close()
    assert revoked == [[("t", 0)]]
    assert [(r.partition, r.offset) for r in records] == [(1, 3)]


class _SendsWithoutWaiting:
    """Stands in for librdkafka's consumer inside a revoke callback: takes the commit, answers later.

    (The real consumer's close would wait out its session timeout for a commit no broker answers.)
    """

    def __init__(self) -> None:
        self.sent: list[list[tuple[str, int, int]]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous, "a synchronous commit inside a KIP-848 revoke callback stalls"
        self.sent.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])


def test_a_commit_inside_a_kip_848_revocation_is_sent_unconfirmed_and_a_refusal_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under KIP-848 the revoke callback's commit is sent without waiting, and ``commit`` says so
    (``CommitUnconfirmedError``): returning as if it were stored made the inbox take it for the
    broker's answer, ending an outage under way in the log (test_inbox_broker_outage.py). Its refusal
    arrives later, through librdkafka's commit report: without a line there, a
    refused revocation commit left no trace at all. A report about other positions (a commit
    that raised its own error) says nothing, and the report is taken once."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                         settings={"group.protocol": "consumer"})
    raised: list[BaseException] = []

    def commit_at_revocation(gone: Sequence[tuple[str, int]]) -> None:
        try:
            source.commit({("t", 0): 7})
        except CommitUnconfirmedError as exc:
            raised.append(exc)

    source.on_revoke(commit_at_revocation)
    stub = _SendsWithoutWaiting()
    real, source._consumer = source._consumer, stub  # type: ignore[assignment]
    try:
        source._revoked(stub, [TopicPartition("t", 0)])  # type: ignore[arg-type]
        assert len(raised) == 1 and stub.sent == [[("t", 0, 7)]]
        refused = KafkaError(KafkaError.UNKNOWN_MEMBER_ID)
        with caplog.at_level(logging.WARNING, logger="transports.kafka"):
            source._reported(refused, [TopicPartition("t", 0, 3)])  # not the unawaited one
            assert not caplog.records
            source._reported(refused, [TopicPartition("t", 0, 7)])
            source._reported(refused, [TopicPartition("t", 0, 7)])  # reported once only
        [line] = [r.getMessage() for r in caplog.records]
        assert "not stored" in line and "('t', 0)" in line
    finally:
        source._consumer = real
        source.close()


def test_polls_records_and_commits_exactly_the_given_positions(kafka: str, topic: str) -> None:
    producer = Producer({"bootstrap.servers": kafka})
    for i in range(10):
        producer.produce(topic, f"v{i}".encode(), b"k", partition=1, headers=[("h", b"x")])
    producer.flush(10)
    revoked: list[list[tuple[str, int]]] = []
    source = KafkaSource(bootstrap_servers=kafka, group_id=f"g-{topic}", topics=[topic], **FAST)
    source.on_revoke(revoked.append)
    records = poll_until(source, 10)
    assert [r.value for r in records] == [f"v{i}".encode() for i in range(10)]
    assert [r.offset for r in records] == list(range(10))
    assert {(r.topic, r.partition, r.key) for r in records} == {(topic, 1, b"k")}
    assert records[0].headers == [("h", b"x")]
    source.commit({(topic, 1): 4})  # "everything before offset 4 is done"
    source.close()
    assert revoked and (topic, 1) in revoked[0]  # leaving the group revokes first

    probe = Consumer({"bootstrap.servers": kafka, "group.id": f"g-{topic}"})
    try:
        [position] = probe.committed([TopicPartition(topic, 1)], timeout=10)
        assert position.offset == 4
    finally:
        probe.close()


@pytest.mark.slow
class TestKafkaSourceConformance(SourceConformance):
    """The suite ``transports.memory.InMemorySource`` passes too: the double is held to the real one."""

    quiet_seconds = 0.5

    @pytest.fixture
    def make_source(self, kafka: str) -> Iterator[Callable[[str, Sequence[str]], Source]]:
        made: list[KafkaSource] = []

        def make(group: str, topics: Sequence[str]) -> Source:
            made.append(KafkaSource(bootstrap_servers=kafka, group_id=group, topics=topics, **FAST))
            return made[-1]

        yield make
        for source in made:
            source.close()

    @pytest.fixture
    def produce(self, kafka: str) -> Callable[[Sequence[Record]], None]:
        def produce(records: Sequence[Record]) -> None:
            producer = Producer({"bootstrap.servers": kafka, "log_level": 3})
            for record in records:
                assert record.partition is not None
                producer.produce(record.topic, record.value, record.key, partition=record.partition,
                                 headers=record.headers)
            assert producer.flush(10) == 0

        return produce
