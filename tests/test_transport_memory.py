"""The in-memory broker, transport and source: held to the same conformance suites as Kafka's."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import Outcome, Record, Source, SourceFeatures, Transport, TransportFeatures, source_features
from transports._errors import CommitRefusedError, ConfigurationError
from transports._partitioner import partition_for_key
from transports.memory import InMemoryBroker, InMemorySource, InMemoryTransport
from transports.testing import SourceConformance, TransportConformance


class TestInMemoryTransportConformance(TransportConformance):
    """The double passes the suite the Kafka transports pass; its ``kafka`` is the broker itself."""

    @pytest.fixture
    def kafka(self) -> InMemoryBroker:
        return InMemoryBroker(partitions=4)

    @pytest.fixture
    def transport(self, kafka: InMemoryBroker) -> InMemoryTransport:
        return InMemoryTransport(kafka)

    def read_back(self, kafka: object, topic: str, *, expected: int, settle: float = 0.0) -> list[Record]:
        assert isinstance(kafka, InMemoryBroker)
        return sorted(kafka.records(topic), key=lambda r: (r.partition or 0, r.offset or 0))

    def partition_count_of(self, kafka: object, topic: str) -> int:
        assert isinstance(kafka, InMemoryBroker)
        return kafka.partitions(topic)


class TestInMemorySourceConformance(SourceConformance):
    quiet_seconds = 0.05
    deadline_seconds = 2.0

    @pytest.fixture
    def broker(self) -> InMemoryBroker:
        return InMemoryBroker(partitions=2)

    @pytest.fixture
    def make_source(self, broker: InMemoryBroker) -> Iterator[Callable[[str, Sequence[str]], Source]]:
        made: list[InMemorySource] = []

        def make(group: str, topics: Sequence[str]) -> Source:
            made.append(InMemorySource(broker, group_id=group, topics=topics))
            return made[-1]

        yield make
        for source in made:
            source.close()

    @pytest.fixture
    def produce(self, broker: InMemoryBroker) -> Callable[[Sequence[Record]], None]:
        def produce(records: Sequence[Record]) -> None:
            for record in records:
                broker.append(record)

        return produce


def test_they_are_a_transport_and_a_source() -> None:
    broker = InMemoryBroker()
    assert isinstance(InMemoryTransport(broker), Transport)
    assert isinstance(InMemorySource(broker, group_id="g", topics=["t"]), Source)


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=40),
       partitions=st.integers(1, 12))
def test_a_key_lands_where_java_kafka_puts_it(keys: list[bytes], partitions: int) -> None:
    broker = InMemoryBroker(partitions=partitions)
    results = InMemoryTransport(broker).publish([Record("t", b"v", key=k) for k in keys])
    assert [r.partition for r in results] == [partition_for_key(k, partitions) for k in keys]
    for partition in range(partitions):
        assert [r.offset for r in broker.partition_log("t", partition)] == list(
            range(sum(1 for r in results if r.partition == partition)))


@settings(max_examples=50, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans()), min_size=1, max_size=30))
def test_an_injected_failure_stops_only_its_key_and_nothing_lands_behind_it(
    plan: list[tuple[str, bool]]
) -> None:
    """Whatever records fail, nothing of a key is written after its first undelivered record."""
    transport = InMemoryTransport(InMemoryBroker())
    records = []
    for i, (key, fails) in enumerate(plan):
        records.append(Record("t", str(i).encode(), key=key.encode()))
        if fails:
            transport.fail(topic="t", key=key)  # queued: hits the next record of the key
    results = transport.publish(records)
    stopped: set[bytes] = set()
    for record, result in zip(records, results, strict=True):
        assert record.key is not None
        if record.key in stopped:
            assert result.outcome is Outcome.RETRY
        elif result.outcome is not Outcome.DELIVERED:
            stopped.add(record.key)
    written = transport.broker.records("t")
    assert [r.value for r in written] == [
        rec.value for rec, res in zip(records, results, strict=True) if res.outcome is Outcome.DELIVERED]


def test_an_outage_answers_retry_unreachable_and_writes_nothing() -> None:
    transport = InMemoryTransport()
    transport.down = True
    results = transport.publish([Record("t", b"1", key=b"k"), Record("t", b"2", key=b"k"), Record("t", b"3")])
    assert all(r.outcome is Outcome.RETRY and r.unreachable for r in results)
    assert transport.broker.records("t") == []


def test_a_failure_can_be_final_and_the_next_record_gets_through() -> None:
    transport = InMemoryTransport()
    transport.fail(key="k", outcome=Outcome.FAILED, error="not authorised")
    [failed] = transport.publish([Record("t", b"1", key=b"k")])
    [delivered] = transport.publish([Record("t", b"2", key=b"k")])
    assert (failed.outcome, failed.error) == (Outcome.FAILED, "not authorised")
    assert delivered.outcome is Outcome.DELIVERED and delivered.offset == 0


def test_an_invalid_topic_fails_its_record_only() -> None:
    results = InMemoryTransport().publish([Record("no spaces", b"1"), Record("t", b"2")])
    assert [r.outcome for r in results] == [Outcome.FAILED, Outcome.DELIVERED]
    assert results[0].error is not None and "invalid topic" in results[0].error


def test_a_partition_moves_only_after_its_holder_gave_it_up() -> None:
    """A new member gets its share at the holder's next poll, after the revoke; a late commit is refused."""
    broker = InMemoryBroker(partitions=2)
    for partition in (0, 1):
        broker.append(Record("t", b"x", partition=partition))
    first = InMemorySource(broker, group_id="g", topics=["t"])
    revoked: list[tuple[str, int]] = []
    first.on_revoke(lambda gone: (revoked.extend(gone), first.commit({p: 1 for p in gone})))
    assert len(first.poll(10, 0)) == 2
    second = InMemorySource(broker, group_id="g", topics=["t"])
    assert second.poll(10, 0) == [] and second.assigned() == frozenset()  # still held by first
    assert first.poll(10, 0) == []  # gives one up: its callback commits it in time
    assert len(revoked) == 1 and broker.committed("g", *revoked[0]) == 1
    assert second.poll(10, 0) == [] and second.assigned() == {revoked[0]}  # from the commit on
    with pytest.raises(CommitRefusedError):
        first.commit({revoked[0]: 0})
    assert broker.committed("g", *revoked[0]) == 1


def test_bad_arguments_are_named() -> None:
    broker = InMemoryBroker()
    with pytest.raises(ConfigurationError, match="partitions"):
        InMemoryBroker(partitions=0)
    with pytest.raises(ConfigurationError, match="group_id"):
        InMemorySource(broker, group_id="", topics=["t"])
    with pytest.raises(ConfigurationError, match="topics"):
        InMemorySource(broker, group_id="g", topics="t")
    with pytest.raises(ConfigurationError, match="outcome"):
        InMemoryTransport(broker).fail(outcome=Outcome.DELIVERED)
    source = InMemorySource(broker, group_id="g", topics=["t"])
    source.poll(1, 0)
    with pytest.raises(ValueError, match="outside"):
        source.commit({("t", 0): 5})


# -- the suites test what is claimed, and say what they skip ----------------------------------------

class _NoSizeLimit(InMemoryTransport):
    features = TransportFeatures(rejects_oversized=False)


class _NoOffsets(InMemorySource):
    features = SourceFeatures(offsets=False)


def test_a_test_of_a_feature_not_claimed_is_skipped_naming_it_not_passed() -> None:
    """Three oversized-record tests returned (passed) when a suite's flag said so; they skip now."""
    broker = InMemoryBroker(partitions=4)
    suite = TestInMemoryTransportConformance()
    for test in (suite.test_oversized_record_fails_and_stops_only_its_key,
                 suite.test_a_key_stopped_on_one_topic_flows_on_another,
                 suite.test_a_hot_key_stops_at_its_failed_record):
        with pytest.raises(pytest.skip.Exception, match="_NoSizeLimit does not claim rejects_oversized"):
            test(_NoSizeLimit(broker), broker, "orders")  # type: ignore[arg-type]


def test_a_feature_claimed_and_not_kept_fails_its_tests() -> None:
    broker = InMemoryBroker(partitions=4, max_record_bytes=10_000_000)  # takes the "oversized" record
    suite = TestInMemoryTransportConformance()
    with pytest.raises(AssertionError):
        suite.test_oversized_record_fails_and_stops_only_its_key(
            InMemoryTransport(broker), broker, "orders")  # type: ignore[arg-type]


def test_a_source_without_offsets_is_skipped_by_its_suite_and_refused_by_inbox_run() -> None:
    from outbox import ConfigurationError as OutboxConfigurationError
    from outbox import Inbox, create_engine

    broker = InMemoryBroker(partitions=2)
    made: list[Source] = []

    def make(group: str, topics: Sequence[str]) -> Source:
        made.append(_NoOffsets(broker, group_id=group, topics=topics))
        return made[-1]

    with pytest.raises(pytest.skip.Exception, match="_NoOffsets does not claim offsets"):
        SourceConformance().test_delivers_as_written_and_only_committed_positions_survive_a_restart(
            make, lambda records: None, "orders")
    assert source_features(InMemorySource(broker, group_id="g", topics=["t"])) == SourceFeatures()

    inbox = Inbox(create_engine("sqlite://"), group="g")
    inbox.handler("orders")(lambda session, message: None)
    inbox.stop()  # run() would return at once: only the refusal can fail it
    with pytest.raises(OutboxConfigurationError, match=r"_NoOffsets has no offsets.*inbox\.handle"):
        inbox.run(made[0])
    for source in made:
        source.close()
