"""A consumer that never fetches one of its partitions in a steady group is replaced (``KafkaSource``).

The CI stall this answers (test_input_domain, one partition's records never received while the
group was steady): librdkafka starts a partition's fetcher only once its committed offset was
fetched, and a failed OffsetFetch leaves the partition assigned and never started until the next
rebalance. That failure cannot be ordered from a real broker on demand, so the tests make a
partition unfetched behind ``KafkaSource``'s back, the way librdkafka would leave it: paused on
the underlying consumer (``KafkaSource`` itself never pauses), with its records produced after.
The rejoin watch must see the partition starved (records waiting beyond an unmoving position,
nothing queued) and replace the consumer, whose successor fetches it. And what is not
starvation must not be replaced: an application that has not polled its queued records for
longer than ``rejoin_after``, and a partition with nothing beyond its position.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer, TopicPartition

from outbox.testing import create_topic
from transports.kafka import KafkaSource

pytestmark = pytest.mark.xdist_group("timing")  # wall-clock bounds

REJOIN_AFTER = 3.0
BOUND = 60.0
"""Seconds for the starved partition's records to arrive: ``rejoin_after``, the answer's
confirmation (a report ``_PROBE_EVERY`` after it), a rebalance, with room for a loaded machine."""


def produce(bootstrap: str, topic: str, partition: int, count: int, size: int = 10) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for n in range(count):
        producer.produce(topic, f"p{partition}-{n}".encode().ljust(size, b"."), partition=partition)
    assert producer.flush(30) == 0


def source_of(bootstrap: str, topic: str, rejoin_after: float = REJOIN_AFTER,
              **settings: object) -> KafkaSource:
    return KafkaSource(bootstrap_servers=bootstrap, group_id=f"g-{uuid.uuid4().hex[:8]}", topics=[topic],
                       rejoin_after=rejoin_after, settings={"statistics.interval.ms": 500, **settings})


def receive(source: KafkaSource, got: Counter[int | None], want: Counter[int | None], bound: float) -> None:
    deadline = time.monotonic() + bound
    while any(got[p] < n for p, n in want.items()) and time.monotonic() < deadline:
        for r in source.poll(100, 0.2):
            got[r.partition] += 1


@pytest.mark.kafka
def test_a_partition_the_consumer_never_fetches_is_fetched_by_a_new_consumer(
    kafka: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="transports.kafka")
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka, topic, 2)
    produce(kafka, topic, 0, 1)
    source = source_of(kafka, topic)
    try:
        got: Counter[int | None] = Counter()
        receive(source, got, Counter({0: 1}), 60)
        assert got[0] == 1 and source.assigned() == {(topic, 0), (topic, 1)}, (got, source.assigned())
        source._consumer.pause([TopicPartition(topic, 1)])  # librdkafka no longer fetches it
        produce(kafka, topic, 0, 5)
        produce(kafka, topic, 1, 6)
        started = time.monotonic()
        receive(source, got, Counter({0: 6}), BOUND)
        # Done with partition 0, as the inbox says it (a new consumer starts at the committed offsets;
        # uncommitted, partition 0's records would come again, which the inbox drops as duplicates).
        source.commit({(topic, 0): 6})
        receive(source, got, Counter({0: 6, 1: 6}), BOUND)
        took = time.monotonic() - started
        assert got == Counter({0: 6, 1: 6}), f"{dict(got)} after {took:.0f}s, rejoins {source.rejoins}"
        assert source.rejoins == 1
        said = [m for r in caplog.records if "has not fetched" in (m := r.getMessage())]
        assert len(said) == 1, said
        assert f"{topic}[1]" in said[0] and "position 0, end 6" in said[0], said[0]
        assert "fetch_state " in said[0], said[0]
        assert source.config["group.id"] in said[0]
    finally:
        source.close()


@pytest.mark.kafka
def test_an_application_that_has_not_polled_its_queued_records_and_an_idle_partition_are_not_starved(
    kafka: str
) -> None:
    """Records queued for the application, unpolled for three times ``rejoin_after``; then both
    partitions at their end, polled for seven times ``rejoin_after`` (long enough for the watch
    to ask the broker about them and for a report after its answer): no new consumer.

    The queue is kept small (16 KB, records of 4 KB), so while the application does not poll,
    librdkafka stops fetching with records waiting beyond both positions: only the queued
    records (``fetchq_cnt``) tell this from starvation."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka, topic, 2)
    produce(kafka, topic, 0, 1)
    source = source_of(kafka, topic, rejoin_after=2.0, **{"queued.max.messages.kbytes": 16,
                                                           "max.partition.fetch.bytes": 16384})
    try:
        got: Counter[int | None] = Counter()
        receive(source, got, Counter({0: 1}), 60)
        assert got[0] == 1
        produce(kafka, topic, 0, 200, size=4096)
        produce(kafka, topic, 1, 200, size=4096)
        got += Counter(r.partition for r in source.poll(1, 2.0))  # its fetches go on meanwhile
        time.sleep(6.0)  # busy: not polling, records queued
        receive(source, got, Counter({0: 201, 1: 200}), 60)
        assert got == Counter({0: 201, 1: 200})
        end = time.monotonic() + 15.0  # idle: nothing beyond either position, asked about twice
        while time.monotonic() < end:
            assert not source.poll(100, 0.2)
        assert source.rejoins == 0
    finally:
        source.close()


def _report(partition: dict[str, object]) -> str:
    """A statistics report of a steady consumer holding t[0], taken now."""
    unassigned = {"fetchq_cnt": 0, "leader": -1}
    return json.dumps({"ts": int(time.monotonic() * 1e6), "cgrp": {"state": "up", "join_state": "steady"},
                       "topics": {"t": {"partitions": {"0": partition, "-1": unassigned}}}})


def test_a_partition_whose_broker_does_not_answer_is_an_outage_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Never started, records waiting or not: when no broker answers for its offsets, no new consumer
    (it would wait the same way), and one INFO line says so however often the watch asks. A partition
    without a leader, or with records queued for the application, is not watched at all. (No broker
    at all: its reports are fed by hand, as test_inbox_rejoin.py's watch tests do.)"""
    caplog.set_level(logging.INFO, logger="transports.kafka")
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], rejoin_after=30)
    never_started = {"fetch_state": "none", "next_offset": -1001, "committed_offset": 5, "fetchq_cnt": 0,
                     "leader": 1}
    try:
        source._assignment = frozenset({("t", 0)})
        for waiting in ({**never_started, "leader": -1}, {**never_started, "fetchq_cnt": 3}):
            source._statistics(_report(waiting))
            assert not source._starvation.still, waiting
        source._statistics(_report(never_started))
        for _ in range(2):
            source._starvation.still[("t", 0)].since -= 40  # as if unmoved that long
            source._statistics(_report(never_started))
            source._starvation.next_probe = 0.0
            source._watch_partitions(time.monotonic())
        said = [m for r in caplog.records if "does not answer for their offsets" in (m := r.getMessage())]
        assert len(said) == 1, said
        assert "t[0] unmoved for 30s" in said[0] and "an outage, no new consumer" in said[0], said[0]
        assert source.rejoins == 0 and source._starvation.still[("t", 0)].asked is None
    finally:
        source.close()


@pytest.mark.kafka
def test_a_partition_that_just_received_records_when_asked_is_not_replaced_on_that_answer(kafka: str) -> None:
    """Idle for ``rejoin_after``, then records arrive just before the watch asks: the broker names an
    end beyond the position in the latest report, which librdkafka took before it fetched them. Only
    a report taken ``_PROBE_EVERY`` after the answer, still unmoved, is starvation; one that moved
    ends it. (The source's own consumer is never polled: its reports are fed by hand, taken when fed;
    the broker's answers are real.)"""
    from transports.kafka import _starvation

    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka, topic, 1)
    produce(kafka, topic, 0, 3)
    source = KafkaSource(bootstrap_servers=kafka, group_id=f"g-{uuid.uuid4().hex[:8]}", topics=[topic],
                         rejoin_after=30)
    tp = (topic, 0)
    at = {"fetch_state": "active", "next_offset": 0, "committed_offset": 0, "fetchq_cnt": 0, "leader": 1}

    def report(partition: dict[str, object]) -> None:
        group = {"state": "up", "join_state": "steady"}
        source._statistics(json.dumps({"ts": int(time.monotonic() * 1e6), "cgrp": group,
                                       "topics": {topic: {"partitions": {"0": partition}}}}))

    def unmoved_for_long() -> None:
        report(at)
        source._starvation.still[tp].since -= 40  # unmoved that long, nothing beyond it until just now
        report(at)
        source._starvation.next_probe = 0.0
        source._watch_partitions(time.monotonic())
        still = source._starvation.still[tp]
        assert still.asked is not None and still.end == 3, "the broker's answer"
        report(at)  # taken before the answer could show in a fetch
        source._starvation.next_probe = 0.0  # the next probe, no report since (the application busy)
        source._watch_partitions(time.monotonic())
        assert source.rejoins == 0, "replaced on the answer alone"

    try:
        source._assignment = frozenset({tp})
        unmoved_for_long()
        report({**at, "next_offset": 3})  # fetched: it moved
        assert source._starvation.still[tp].asked is None
        source._starvation.still.clear()
        unmoved_for_long()
        still = source._starvation.still[tp]
        assert still.asked is not None
        still.asked -= _starvation.PROBE_EVERY + 0.5  # as if the broker answered that long ago
        report(at)  # still unmoved, taken after the answer: starved
        source._starvation.next_probe = 0.0
        source._watch_partitions(time.monotonic())
        assert source.rejoins == 1
    finally:
        source.close()


@pytest.mark.kafka
def test_an_open_transaction_is_not_records_waiting(kafka: str) -> None:
    """``read_committed``: records of a transaction still open cannot be read yet; they are not
    records waiting. The watch's ListOffsets request goes with the consumer's
    isolation level, so the end it is told is the last stable offset (here 1, the high watermark 4),
    and the partition, at it, is idle: polled for seven times ``rejoin_after``, no new consumer."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka, topic, 1)
    produce(kafka, topic, 0, 1)
    open_transaction = Producer({"bootstrap.servers": kafka, "transactional.id": uuid.uuid4().hex})
    open_transaction.init_transactions(30)
    open_transaction.begin_transaction()
    for n in range(3):
        open_transaction.produce(topic, f"open-{n}".encode(), partition=0)
    assert open_transaction.flush(30) == 0
    source = source_of(kafka, topic, rejoin_after=2.0)
    try:
        got: Counter[int | None] = Counter()
        receive(source, got, Counter({0: 1}), 60)
        end = time.monotonic() + 15.0
        while time.monotonic() < end:
            got += Counter(r.partition for r in source.poll(100, 0.2))
        assert got == Counter({0: 1}) and source.rejoins == 0, (got, source.rejoins)
        _, high = source._consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)
        assert high == 1, "the last stable offset"
    finally:
        source.close()
        open_transaction.abort_transaction(30)
