"""A transaction the broker leaves open: Apache Kafka drops a transaction's markers for a partition
whose leader it cannot find (it takes the partition for deleted), so the partition's last stable
offset stays at that transaction's first record for good and no read_committed reader passes it.

That is what stalled an exactly-once relay's take-over after a single broker's SIGKILL and restart
(issue 36): the restarted broker's transaction coordinator sent the markers of a transaction caught
mid-commit while its old registration was being fenced, every partition briefly without a leader.
Here the same drop is made on purpose: the partition's only replica is killed, the transaction is
committed meanwhile, and the replica comes back.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from _kafka_transactions import (
    KilledAtCommit,
    coordinator_partition,
    one_replica_topics,
    stable_and_end,
    wait_until,
)
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox.testing import LocalKafka, LocalKafkaCluster
from tests.conftest import thawed_and_running
from transports import Outcome, ReadBack, Record, TransactionOutcome, Uncommitted
from transports._errors import RetriableTransportError
from transports.kafka import KafkaTransport
from transports.kafka._txn_headers import TOPICS_HEADER, with_positions, with_topics
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.xdist_group("kafka-cluster")]

DROPPED = "likely deleted already and hence can be skipped"
"""The coordinator's log line for a transaction marker it drops (the partition without a leader)."""


def dropped_since(node: Any, mark: int) -> bool:
    """Whether ``node`` logged dropping a marker after the first ``mark`` characters of its log since
    launch (``kafka_cluster``'s nodes serve the whole module: an earlier test's drop must not count)."""
    return DROPPED in node.log_since_launch()[mark:]

def leave_open(kafka_cluster: LocalKafkaCluster, tid: str, topic: str) -> AdminClient:
    """``topic`` (one partition, compacted) with a committed record of key ``tid`` and, after it, a
    transaction of ``tid`` the broker left open (its only replica killed while it committed)."""
    old = Producer({"bootstrap.servers": kafka_cluster.bootstrap, "transactional.id": tid,
                    "transaction.timeout.ms": 60_000, "log_level": 0})
    old.init_transactions(60)
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap, "log_level": 0})
    coordinator = kafka_cluster.leader("__transaction_state", coordinator_partition(tid))
    spared = (coordinator, kafka_cluster.active_controller())
    victim = next(n.node_id for n in kafka_cluster.nodes if n.node_id not in spared)
    new = NewTopic(topic, num_partitions=1, replication_factor=-1, replica_assignment=[[victim]],
                   config={"cleanup.policy": "compact"})
    admin.create_topics([new])[topic].result(30)
    kafka_cluster.leader(topic, 0)
    headers = [(TOPICS_HEADER, topic.encode())]
    old.begin_transaction()
    old.produce(topic, b"committed", tid.encode(), 0, headers=headers)
    old.commit_transaction(30)
    old.begin_transaction()
    old.produce(topic, b"left open", tid.encode(), 0, headers=headers)
    assert old.flush(30) == 0

    kafka_cluster.kill(victim)  # the partition's only replica: fenced after its session, leader -1
    live = AdminClient({"bootstrap.servers": kafka_cluster.live_bootstrap(), "log_level": 0})
    wait_until(lambda: live.list_topics(topic, timeout=5).topics[topic].partitions[0].leader == -1, 60,
               "the partition without a leader")
    node = next(n for n in kafka_cluster.nodes if n.node_id == coordinator)
    mark = len(node.log_since_launch())
    old.commit_transaction(30)  # decided; its marker for the leaderless partition is dropped:
    wait_until(lambda: dropped_since(node, mark), 30, "the coordinator dropping the marker")
    kafka_cluster.start(victim)
    kafka_cluster.leader(topic, 0)
    stable, end = wait_until(lambda: stable_and_end(admin, topic), 30, "the partition's offsets")
    assert stable < end, "the broker wrote the marker: nothing was left open"
    return admin


def row_1_again_reads_once(bootstrap: str, taker: Any, data: str, progress: str) -> None:
    """``taker`` (the next producer of the id) commits row-1 again: read_committed readers of ``data``
    get that one record, nothing of the transaction before it; ``taker`` closed."""
    tid = taker.transactional_id
    again = taker.send([Record(data, b"row-1 again", key=b"k", partition=0),
                        Record(progress, b"progress naming row-1 again", key=tid.encode(), partition=0)])
    assert again.outcome is TransactionOutcome.COMMITTED, again
    seen = read_topic(bootstrap, data, expected=2, timeout=10, isolation="read_committed")
    assert [r.value for r in seen] == [b"row-1 again"]
    taker.close()


def test_a_transaction_the_broker_left_open_is_ended_by_the_next_producer_of_its_id(
        kafka_cluster: LocalKafkaCluster) -> None:
    """Without ``end_left_open`` the read waits at the left-open record until its timeout
    ('could not read … in time') and every read_committed reader of the partition with it."""
    tid, topic = "outbox-left-open-0", "left-open-progress"
    admin = leave_open(kafka_cluster, tid, topic)

    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        producer = transport.transactional(tid, 30)
        started = time.monotonic()
        value = transport.last_committed(topic, 0, tid.encode(), 30)
        took = time.monotonic() - started
        # Aborted, as nothing of it was decided anywhere; the read ends at the committed record.
        assert value == b"committed"
        assert took < 15, f"the take-over read took {took:.1f} s"
        stable, end = stable_and_end(admin, topic)
        assert stable == end, "the partition is open to read_committed readers again"
        sent = producer.send([Record(topic, b"next", key=tid.encode(), partition=0)])
        assert sent.outcome is TransactionOutcome.COMMITTED
        assert transport.last_committed(topic, 0, tid.encode(), 30) == b"next"
        producer.close()
    finally:
        transport.close()


def test_a_left_open_transaction_of_an_earlier_release_is_ended_and_read_back_as_naming_nothing(
        kafka_cluster: LocalKafkaCluster) -> None:
    """A progress record written before the positions header (an earlier release's relay, died
    mid-commit) is still ended by the take-over's read-back, which gives it without positions: the
    relay counts nothing of it and sends its rows again, as that release did."""
    tid, topic = "outbox-left-open-4", "left-open-earlier-release"
    admin = leave_open(kafka_cluster, tid, topic)
    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        producer = transport.transactional(tid, 30)
        read = transport.read_back(topic, 0, tid.encode(), 30)
        assert read == ReadBack(b"committed", (Uncommitted(b"left open", None),))
        stable, end = stable_and_end(admin, topic)
        assert stable == end, "the partition is open to read_committed readers again"
        producer.close()
    finally:
        transport.close()


def test_an_aborted_transaction_whose_data_marker_alone_is_dropped_is_ended_before_the_id_commits_again(
        kafka_cluster: LocalKafkaCluster) -> None:
    """The coordinator decides an abort, writes the progress partition's marker and drops the data
    partition's (its only replica killed meanwhile): the data record stays undecided. The take-over
    read the earlier progress and sent the row again, and its producer's commit on that partition
    (the same producer id) ended the old record too, committed: the row twice. The read-back now
    finds that transaction after the last committed progress, its data read held at its own record,
    and aborts it there first: nothing of it is readable, and the next commit shows only its own."""
    tid, data, progress = "outbox-split-1", "split-abort-data", "split-abort-progress"
    admin, coordinator, victim = one_replica_topics(kafka_cluster, tid, data, progress, victim_holds="data")
    old = Producer({"bootstrap.servers": kafka_cluster.bootstrap, "transactional.id": tid,
                    "transaction.timeout.ms": 60_000, "log_level": 0})
    old.init_transactions(60)
    delivered: list[Any] = []
    old.begin_transaction()
    old.produce(data, b"row-1", b"k", 0, on_delivery=lambda _e, m: delivered.append(m))
    assert old.flush(30) == 0
    named = b"progress naming row-1"
    records = with_topics([Record(data, b"row-1", key=b"k"), Record(progress, named, key=tid.encode())])
    last = with_positions(records, delivered)[-1]
    old.produce(progress, named, tid.encode(), 0, headers=last.headers)
    assert old.flush(30) == 0
    kafka_cluster.kill(victim)
    live = AdminClient({"bootstrap.servers": kafka_cluster.live_bootstrap(), "log_level": 0})
    wait_until(lambda: live.list_topics(data, timeout=5).topics[data].partitions[0].leader == -1, 60,
               "the data partition without a leader")
    node = next(n for n in kafka_cluster.nodes if n.node_id == coordinator)
    mark = len(node.log_since_launch())
    old.abort_transaction(30)
    wait_until(lambda: dropped_since(node, mark), 30, "the coordinator dropping the data marker")
    kafka_cluster.start(victim)
    kafka_cluster.leader(data, 0)
    stable, end = wait_until(lambda: stable_and_end(admin, data), 30, "the data partition's offsets")
    assert stable < end, "the broker wrote the data marker: nothing was left open"

    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        taker = transport.transactional(tid, 30)
        read = transport.read_back(progress, 0, tid.encode(), 30)
        assert read == ReadBack(None, (Uncommitted(named, (False,)),))
        row_1_again_reads_once(kafka_cluster.bootstrap, taker, data, progress)
    finally:
        transport.close()


def test_a_relay_that_dies_while_ending_a_left_open_transaction_leaves_nothing_readable(
        kafka_cluster: LocalKafkaCluster) -> None:
    """Attack (issue 36): the producer ending the left-open transaction wrote its empty records and
    died before its abort. The next producer of the id must end both (its init aborts the dead one's
    transaction, whose records joined the left-open one), and no read_committed reader ever sees an
    empty record or the left-open one."""
    tid, topic = "outbox-left-open-1", "left-open-dies"
    admin = leave_open(kafka_cluster, tid, topic)

    # end_left_open's first half, then the process is gone: no abort.
    dying = Producer({"bootstrap.servers": kafka_cluster.bootstrap, "transactional.id": tid,
                      "transaction.timeout.ms": 60_000, "log_level": 0})
    dying.init_transactions(30)
    dying.begin_transaction()
    dying.produce(topic, b"", tid.encode(), 0)
    assert dying.flush(30) == 0
    del dying

    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        producer = transport.transactional(tid, 30)
        assert transport.last_committed(topic, 0, tid.encode(), 30) == b"committed"
        wait_until(lambda: (lambda s: s[0] == s[1])(stable_and_end(admin, topic)), 15,
                   "the partition open to read_committed readers again")
        seen = read_topic(kafka_cluster.bootstrap, topic, expected=1, settle=1.0, isolation="read_committed")
        assert [r.value for r in seen] == [b"committed"]
        producer.close()
    finally:
        transport.close()


def test_a_fenced_relay_held_at_the_live_owners_open_transaction_does_not_end_it(
        kafka_cluster: LocalKafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    """Attack (issue 36): two relays both decide to end a transaction of the id. The live owner (the
    newest producer) ended the left-open one and has a transaction of its own open; the relay that
    made its producer earlier (lease skew) is held at that open record of its own id and tries to
    end it. Its producer is fenced: nothing of it is written, its read fails (retried), and the
    live owner's transaction commits."""
    tid, topic = "outbox-left-open-2", "left-open-two-relays"
    admin = leave_open(kafka_cluster, tid, topic)
    skewed, owner = (KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap) for _ in range(2))
    try:
        fenced = skewed.transactional(tid, 10)  # kept: the transport holds its producers weakly
        live = owner.transactional(tid, 30)  # fences the skewed relay's producer
        assert owner.last_committed(topic, 0, tid.encode(), 30) == b"committed"
        raw = live._producer
        raw.begin_transaction()
        raw.produce(topic, b"live", tid.encode(), 0, headers=[(TOPICS_HEADER, topic.encode())])
        assert raw.flush(30) == 0
        caplog.clear()
        with pytest.raises(RetriableTransportError, match="cannot end the transaction"):
            skewed.last_committed(topic, 0, tid.encode(), 8)
        assert any("was left open by the broker" in r.getMessage() for r in caplog.records)
        raw.commit_transaction(30)  # raises if the skewed relay aborted it
        assert owner.last_committed(topic, 0, tid.encode(), 30) == b"live"
        seen = read_topic(kafka_cluster.bootstrap, topic, expected=2, settle=1.0, isolation="read_committed")
        assert [r.value for r in seen] == [b"committed", b"live"]
        stable, end = stable_and_end(admin, topic)
        assert stable == end
        live.close()
        fenced.close()
    finally:
        skewed.close()
        owner.close()


def test_a_commit_the_broker_leaves_open_is_not_reported_committed(
        kafka_cluster: LocalKafkaCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator answers a commit once it decided it, and writes the markers after: a commit
    whose marker it then drops (the partition without a leader) was reported COMMITTED, and the
    relay marked its rows published, though no read_committed reader ever got them (the next
    producer of the id aborts it, as does any later aborted transaction of the same producer there).
    ``COMMITTED`` must mean readable: this one is UNKNOWN (settled by the next producer of the id),
    and nothing of it is ever read, so its rows are sent again.

    A transaction is committed first, as a running relay's would be: the transport's shared admin
    client, which reads the last stable offset, then knows the killed replica as the leader and asks
    it, unanswered until its request timeout. The check's wait for that answer ended first and its
    bare ``TimeoutError`` escaped ``send``. (A fresh client, as without the first commit, is mostly
    told at once that the partition has no leader: the case was hit only now and then.)"""
    tid, topic = "outbox-left-open-3", "left-open-answered"
    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap, "log_level": 0})
    coordinator = kafka_cluster.leader("__transaction_state", coordinator_partition(tid))
    spared = (coordinator, kafka_cluster.active_controller())
    victim = next(n.node_id for n in kafka_cluster.nodes if n.node_id not in spared)
    new = NewTopic(topic, num_partitions=1, replication_factor=-1, replica_assignment=[[victim]])
    admin.create_topics([new])[topic].result(30)
    kafka_cluster.leader(topic, 0)
    live = AdminClient({"bootstrap.servers": kafka_cluster.live_bootstrap(), "log_level": 0})

    def kill_the_only_replica() -> None:
        kafka_cluster.kill(victim)
        wait_until(lambda: live.list_topics(topic, timeout=5).topics[topic].partitions[0].leader == -1, 60,
                   "the partition without a leader")

    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        producer = transport.transactional(tid, 10)
        first = producer.send([Record(topic, b"first", key=tid.encode(), partition=0)])
        assert first.outcome is TransactionOutcome.COMMITTED, first
        monkeypatch.setattr(producer, "_producer", KilledAtCommit(producer._producer, kill_the_only_replica))
        answer = producer.send([Record(topic, b"answered", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.UNKNOWN, answer
        assert "not ended" in (answer.error or "") or "cannot be read" in (answer.error or "")
        producer.close()
        kafka_cluster.start(victim)
        kafka_cluster.leader(topic, 0)
        stable, end = wait_until(lambda: stable_and_end(admin, topic), 30, "the partition's offsets")
        assert stable < end, "the broker wrote the marker: nothing was left open"
        # The next producer of the id (the relay's, after UNKNOWN) ends it: nothing of it is read.
        taker = transport.transactional(tid, 30)  # kept: the transport holds its producers weakly
        assert transport.last_committed(topic, 0, tid.encode(), 30) == b"first"
        seen = read_topic(kafka_cluster.bootstrap, topic, expected=2, timeout=5, isolation="read_committed")
        assert [r.value for r in seen] == [b"first"]
        taker.close()
    finally:
        transport.close()


@pytest.fixture
def own_kafka(module_kafka: LocalKafka) -> LocalKafka:
    """The module's single broker (``module_kafka``), shared by the two tests that kill or freeze it
    (one JVM start instead of two; the module is in the ``kafka-cluster`` group, on one worker).
    Their topics and transactional ids differ, and each leaves the broker running."""
    return thawed_and_running(module_kafka)


def new_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """``topic`` made on one broker, once every partition of it has a leader."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(30)
    wait_until(lambda: all(p.leader >= 0 for p in admin.list_topics(topic, timeout=5).topics[topic]
                           .partitions.values()), 30, "the topic's leaders")


def test_commits_after_the_broker_restarted_are_read_back_committed(own_kafka: LocalKafka) -> None:
    """The commit check reads the last stable offset with the transport's admin client, which keeps
    the leader epochs it knew before the broker's restart and does not refresh them: every read fails
    (FENCED_LEADER_EPOCH) and every commit came back UNKNOWN after the whole timeout, for good. A
    client whose read failed is made anew: the first commit after the restart is COMMITTED at once."""
    tid, topic = "outbox-restarted-0", "restarted"
    new_topic(own_kafka.bootstrap, topic, 2)
    transport = KafkaTransport(bootstrap_servers=own_kafka.bootstrap)
    try:
        def send(value: bytes) -> TransactionOutcome:
            producer = transport.transactional(tid, 10)
            try:
                return producer.send([Record(topic, value, key=b"k", partition=0),
                                      Record(topic, value, key=tid.encode(), partition=1)]).outcome
            finally:
                producer.close()

        assert send(b"before") is TransactionOutcome.COMMITTED
        own_kafka.kill()
        own_kafka.start()
        started = time.monotonic()
        assert send(b"after") is TransactionOutcome.COMMITTED
        assert time.monotonic() - started < 8
        seen = read_topic(own_kafka.bootstrap, topic, expected=4, settle=0.5, isolation="read_committed")
        assert sorted(r.value for r in seen) == [b"after", b"after", b"before", b"before"]
    finally:
        transport.close()


def test_a_commit_whose_broker_stops_answering_before_its_read_back_is_unknown(
        own_kafka: LocalKafka, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit is answered (decided), then the broker stops answering (frozen: a hung host, or one
    SIGKILLed and not back in time) while the partition's last stable offset is read back. The read's
    future did not finish within its wait: concurrent.futures' ``TimeoutError``, no ``KafkaException``,
    escaped ``send`` (the relay's batch failed and kept the producer, whose next transaction sent the
    rows again: twice on the wire). The outcome is UNKNOWN; the next producer of the id finds it
    committed."""
    tid, topic = "outbox-frozen-0", "frozen-after-commit"
    new_topic(own_kafka.bootstrap, topic, 1)
    transport = KafkaTransport(bootstrap_servers=own_kafka.bootstrap)
    try:
        producer = transport.transactional(tid, 5)
        frozen = KilledAtCommit(producer._producer, after=own_kafka.freeze)
        monkeypatch.setattr(producer, "_producer", frozen)
        try:
            answer = producer.send([Record(topic, b"answered", key=tid.encode(), partition=0)])
        finally:
            own_kafka.thaw()
        assert answer.outcome is TransactionOutcome.UNKNOWN, answer
        assert "cannot be read" in (answer.error or "") or "not ended" in (answer.error or "")
        producer.close()
        taker = transport.transactional(tid, 30)  # kept: the transport holds its producers weakly
        assert transport.last_committed(topic, 0, tid.encode(), 30) == b"answered"
        taker.close()
    finally:
        transport.close()


def test_a_commit_whose_progress_marker_alone_is_dropped_is_not_taken_for_unsent(
        kafka_cluster: LocalKafkaCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator decides a commit and writes its marker on the data partition (its leader alive)
    but drops the progress partition's (its only replica killed meanwhile). The commit is UNKNOWN (the
    progress partition does not read it back), the next producer of the id finds the progress record
    left open and aborts it on every partition. The take-over read the earlier progress (none here)
    and nothing more: the relay sent the row again, though read_committed readers had it already. The
    read-back now also gives that transaction, with which of its records are committed (the data
    record, read back at the offset its progress record names). On one broker this needs a kill
    between two partitions' marker appends; on several, one leader's loss."""
    tid, data, progress = "outbox-split-0", "split-data", "split-progress"
    admin, _, victim = one_replica_topics(kafka_cluster, tid, data, progress, victim_holds="progress")
    live = AdminClient({"bootstrap.servers": kafka_cluster.live_bootstrap(), "log_level": 0})

    def kill_the_progress_replica() -> None:
        kafka_cluster.kill(victim)
        wait_until(lambda: live.list_topics(progress, timeout=5).topics[progress].partitions[0].leader == -1,
                   60, "the progress partition without a leader")

    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        producer = transport.transactional(tid, 10)
        killing = KilledAtCommit(producer._producer, kill_the_progress_replica)
        monkeypatch.setattr(producer, "_producer", killing)
        named = b"progress naming row-1"
        answer = producer.send([Record(data, b"row-1", key=b"k", partition=0),
                                Record(progress, named, key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.UNKNOWN, answer
        producer.close()
        kafka_cluster.start(victim)
        kafka_cluster.leader(progress, 0)
        stable, end = wait_until(lambda: stable_and_end(admin, progress), 30, "the progress offsets")
        assert stable < end, "the broker wrote the progress marker: nothing was left open"
        assert read_topic(kafka_cluster.bootstrap, data, expected=1, timeout=10, isolation="read_committed")
        taker = transport.transactional(tid, 30)  # kept: the transport holds its producers weakly
        read = transport.read_back(progress, 0, tid.encode(), 30)
        assert read == ReadBack(None, (Uncommitted(named, (True,)),))  # aborted, its data record committed
        stable, end = stable_and_end(admin, progress)
        assert stable == end, "the progress partition is open to read_committed readers again"
        again = transport.read_back(progress, 0, tid.encode(), 30)  # a take-over that died before it sent
        assert again == read
        taker.close()
    finally:
        transport.close()


class AckedThenKilledAtAbort:
    """A confluent producer that produces a record only once every record produced before it was
    answered (written to its partition's log), and whose ``abort_transaction`` first runs ``before``
    (everything else its own).

    Produced together, the refused record's refusal could come back before the data record was sent
    (its leader's connection still being made): librdkafka sends nothing of a transaction that
    failed, so the data record was never written and the test did not reach its fault (as
    test_transport_kafka_settle_attacks.py's did in the CI of ec05b0e). A flush before the abort's
    purge cannot order them: a record held back once the transaction failed is never answered."""

    def __init__(self, inner: Producer, before: Any) -> None:
        self._inner, self._before = inner, before

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def produce(self, *args: Any, **kwargs: Any) -> None:
        left = self._inner.flush(10)
        assert left == 0, f"{left} record(s) produced before this one not answered in 10 s"
        self._inner.produce(*args, **kwargs)

    def abort_transaction(self, *args: Any) -> None:
        self._before()
        self._inner.abort_transaction(*args)


def test_an_aborted_transaction_that_never_wrote_its_last_record_is_ended_by_the_next_producer(
        kafka_cluster: LocalKafkaCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction fails before its last record (the relay's progress) is produced: a record is
    refused, or the broker froze past the deadline. Its abort's marker on a data partition is dropped
    (the partition's only replica gone meanwhile; on a real cluster, a broker frozen past its session
    and thawed), so the data record stays open there, and no progress record names its topics for a
    read-back to find. The next producer of the id committed on that partition, which ended the old
    record too, committed: the row twice on the wire (seen as 80 rows twice in
    tests/test_relay_exactly_once_pace_attacks.py under load). The transport now keeps where a
    transaction that did not commit wrote, and the next producer of the id ends it first."""
    tid, data, progress = "outbox-unsettled-0", "unsettled-data", "unsettled-progress"
    refusing = "unsettled-refusing"
    admin, coordinator, victim = one_replica_topics(kafka_cluster, tid, data, progress, victim_holds="data")
    admin.create_topics([NewTopic(refusing, num_partitions=1, replication_factor=-1,
                                  replica_assignment=[[coordinator]],
                                  config={"max.message.bytes": "256"})])[refusing].result(30)
    kafka_cluster.leader(refusing, 0)
    live = AdminClient({"bootstrap.servers": kafka_cluster.live_bootstrap(), "log_level": 0})
    node = next(n for n in kafka_cluster.nodes if n.node_id == coordinator)
    mark: list[int] = []

    def kill_the_data_replica() -> None:
        kafka_cluster.kill(victim)
        wait_until(lambda: live.list_topics(data, timeout=5).topics[data].partitions[0].leader == -1, 60,
                   "the data partition without a leader")
        mark.append(len(node.log_since_launch()))

    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap)
    try:
        producer = transport.transactional(tid, 10)
        monkeypatch.setattr(producer, "_producer", AckedThenKilledAtAbort(producer._producer,
                                                                          kill_the_data_replica))
        answer = producer.send([Record(data, b"row-1", key=b"k", partition=0),
                                Record(refusing, os.urandom(2000), key=b"big", partition=0),
                                Record(progress, b"progress", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        assert answer.results[1].outcome is Outcome.FAILED, answer  # refused by the broker, for good
        wait_until(lambda: dropped_since(node, mark[0]), 30, "the coordinator dropping the data marker")
        producer.close()
        kafka_cluster.start(victim)
        kafka_cluster.leader(data, 0)
        left_open = wait_until(lambda: stable_and_end(admin, data), 30, "the data partition's offsets")
        # The fault reached: row-1 at offset 0, left open (an end of 0: it was never written; a last
        # stable offset of 1 or more: the broker wrote its marker).
        assert left_open == (0, 1), f"the data partition's last stable offset and end: {left_open}"
        assert stable_and_end(admin, progress) == (0, 0), "the progress record was produced"

        taker = transport.transactional(tid, 30)  # the relay's next producer of the shard's id
        assert transport.read_back(progress, 0, tid.encode(), 30) == ReadBack(None, ())
        row_1_again_reads_once(kafka_cluster.bootstrap, taker, data, progress)
    finally:
        transport.close()
