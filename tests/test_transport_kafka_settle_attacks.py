"""Attacks on settling a transactional id's transactions that did not commit (``Unsettled``,
``KafkaTransactionalProducer.settle``), on three Apache Kafka nodes of the module's own.

A transaction that did not end committed may be left open on a data partition: the coordinator
drops its abort marker there when it finds no leader (the partition's only replica killed here; on
a real cluster, a broker frozen past its session and fenced on its return). The next producer of the
id ends it (an empty record of the same producer id, then an abort) before it is used; otherwise a
commit of the same producer id on that partition would end the old records too, committed. These
tests look for ways round that: a transaction that does not commit followed by no new producer, a
settle that fails part-way, a settle whose own abort marker is dropped.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

import pytest
from _kafka_transactions import coordinator_partition, stable_and_end, wait_until
from _relay_helpers import publish, rows, wait_for
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox import Outbox, Relay, RetriableTransportError, create_engine
from outbox.testing import LocalKafkaCluster
from transports import Outcome, Record, SendResult, TransactionOutcome
from transports.kafka import KafkaTransport, _transactions
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.xdist_group("kafka-cluster")]

DROPPED = "likely deleted already and hence can be skipped"
"""The coordinator's log line for a transaction marker it drops (the partition without a leader)."""

MESSAGE_ID = "outbox-message-id"


class Nodes:
    """Which node coordinates ``tid`` (spared, with the active controller) and which one to kill."""

    def __init__(self, cluster: LocalKafkaCluster, tid: str) -> None:
        self.cluster = cluster
        self.coordinator = cluster.leader("__transaction_state", coordinator_partition(tid))
        spared = (self.coordinator, cluster.active_controller())
        self.victim = next(n.node_id for n in cluster.nodes if n.node_id not in spared)
        self.admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "log_level": 0})
        self._node = next(n for n in cluster.nodes if n.node_id == self.coordinator)

    def topic(self, name: str, *on: int, **config: str) -> None:
        """``name`` with a partition on each node of ``on`` (one replica each), every one led."""
        new = NewTopic(name, num_partitions=len(on), replication_factor=-1,
                       replica_assignment=[[node] for node in on], config=config)
        self.admin.create_topics([new])[name].result(30)
        for partition in range(len(on)):
            self.cluster.leader(name, partition)

    def coordinator_log(self) -> int:
        """Where the coordinator's log is now (``dropped_since``)."""
        return len(self._node.log_since_launch())

    def dropped_since(self, mark: int) -> bool:
        """Whether the coordinator dropped a marker after ``mark`` (``coordinator_log``)."""
        return DROPPED in self._node.log_since_launch()[mark:]

    def kill_victim(self, topic: str, partition: int = 0) -> None:
        """Kill the victim and wait until ``topic[partition]`` (its only replica there) has no leader."""
        self.cluster.kill(self.victim)
        live = AdminClient({"bootstrap.servers": self.cluster.live_bootstrap(), "log_level": 0})
        wait_until(lambda: live.list_topics(topic, timeout=5).topics[topic].partitions[partition].leader
                   == -1, 60, f"{topic}[{partition}] without a leader")

    def restart_victim(self, topic: str, partition: int = 0) -> None:
        self.cluster.start(self.victim)
        self.cluster.leader(topic, partition)


class KilledAtAbort:
    """A confluent producer whose ``abort_transaction`` first runs ``before``, once (everything else its
    own). ``answered_first``: a record is produced only once every record produced before it was
    answered (written to its partition's log).

    Without that, a transaction's data record and the record the broker refuses were produced
    together, and the refusal could come back before the data record was sent (its leader's
    connection still being made): librdkafka sends nothing of a transaction that failed, so the data
    record was never written, the abort's dropped marker left nothing open, and the test did not
    reach its fault ("the broker wrote the data marker", the CI of ec05b0e). Answering each record
    before the next one is produced orders the two for certain (a flush before the abort's purge
    cannot: a record librdkafka holds back once the transaction failed is never answered)."""

    def __init__(self, inner: Producer, before: Any, *, answered_first: bool = False) -> None:
        self._inner, self._before, self._answered_first = inner, before, answered_first
        self._ran = False

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def produce(self, *args: Any, **kwargs: Any) -> None:
        if self._answered_first:
            left = self._inner.flush(10)
            assert left == 0, f"{left} record(s) produced before this one not answered in 10 s"
        self._inner.produce(*args, **kwargs)

    def abort_transaction(self, *args: Any) -> None:
        if not self._ran:
            self._ran = True
            self._before()
        self._inner.abort_transaction(*args)


class AbortedAtTheProgress:
    """One shard's relay set-up whose first transaction aborts after its data record was written.

    ``data`` gets one partition, on the victim node (its only replica); ``progress`` one on the
    coordinator's. A row of key ``k`` is published. ``transport`` (of the relay to make) gives out
    producers whose first progress record cannot be produced: its partition count is not known (a
    retriable refusal at produce(), as when the cluster does not answer a metadata request in time),
    once the data record was answered, and the victim is killed then: the transaction aborts with no
    record refused for good, and the coordinator drops its abort marker on ``data`` (``mark``: where
    its log was then). ``outcomes``: each transaction's; ``failed_makes``: each producer whose making
    (its settle) failed for want of the broker."""

    def __init__(self, cluster: LocalKafkaCluster, outbox: Outbox, data: str, progress: str,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        tid = f"outbox-{outbox.load_schema().incarnation}-0"
        self.nodes = nodes = Nodes(cluster, tid)
        nodes.topic(data, nodes.victim)
        nodes.topic(progress, nodes.coordinator, **{"cleanup.policy": "compact"})
        publish(outbox, data, ["k"])
        transport = KafkaTransport(bootstrap_servers=cluster.bootstrap, delivery_timeout=10.0)
        self.transport = transport
        wait_until(lambda: transport.ensure_compacted_topic(progress, 1, 10) or True, 30,
                   "the progress topic's configuration readable")
        real = transport.transactional
        self.outcomes: list[TransactionOutcome] = []
        self.failed_makes: list[BaseException] = []
        self.mark: list[int] = []
        outcomes, mark = self.outcomes, self.mark

        def transactional(*args: Any, **kwargs: Any) -> Any:
            try:
                producer = real(*args, **kwargs)
            except RetriableTransportError as exc:  # the settle of the id's next producer failed
                self.failed_makes.append(exc)
                raise
            real_send, lookup = producer.send, producer._partitions

            def partitions(topic: str) -> int | SendResult:
                if topic != progress or outcomes:
                    return lookup(topic)
                # The data record is written (the progress record goes once its report came): its
                # partition's only replica goes, and the progress partition cannot be looked up now.
                nodes.kill_victim(data)
                mark.append(nodes.coordinator_log())
                return SendResult(Outcome.RETRY, error="metadata of the progress topic: timed out",
                                  unreachable=True)

            def send(records: Any) -> Any:
                answer = real_send(records)
                outcomes.append(answer.outcome)
                return answer

            monkeypatch.setattr(producer, "_partitions", partitions)
            monkeypatch.setattr(producer, "send", send)
            return producer

        monkeypatch.setattr(transport, "transactional", transactional)

    def aborted(self, relay: Relay) -> None:
        """``relay`` (of ``transport``) runs until its first transaction's answer: aborted, its marker on
        ``data`` dropped by the coordinator."""
        wait_for(lambda: (relay.run_once(), bool(self.outcomes))[1], 120, "the first transaction's answer",
                 interval=0.0)
        assert self.outcomes == [TransactionOutcome.ABORTED]
        wait_until(lambda: self.nodes.dropped_since(self.mark[0]), 30,
                   "the coordinator dropping the data marker")


def test_a_transaction_aborted_for_want_of_the_broker_is_settled_before_its_shard_commits_again(
        kafka_cluster: LocalKafkaCluster, sqlite_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's transaction ends ABORTED with no record refused for good (a retriable refusal at
    produce(): here the progress topic's partition count could not be looked up, as when the
    cluster does not answer a metadata request in time; an implied delivery or an abortable commit
    end the same way), after its data record was written; its abort marker on the data partition is
    dropped (the partition's only replica killed). The relay kept that producer (it makes one anew
    only after UNKNOWN, FENCED or a refusal), so nothing ended the data record: the kept producer's
    next transaction, the same producer id, committed the row again there, which ended the old
    record committed too: the row twice on the wire for read_committed readers."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    data, progress = "settle-kept-rows", "settle-kept-progress"
    fault = AbortedAtTheProgress(kafka_cluster, outbox, data, progress, monkeypatch)
    nodes, transport = fault.nodes, fault.transport
    # A lease held all along, as a running relay's lease thread keeps it (run_once renews it only when
    # it runs): a new epoch would make a new producer anyway.
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=progress, worker_id="w",
                  lease_ttl=300)
    try:
        fault.aborted(relay)
        nodes.restart_victim(data)
        stable, end = wait_until(lambda: stable_and_end(nodes.admin, data, 0), 30, "the data offsets")
        assert stable < end, f"the broker wrote the data marker: nothing was left open ({stable}, {end})"
        wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 120,
                 "the row published", interval=0.0)
    finally:
        relay.close()
    on_wire = read_topic(kafka_cluster.bootstrap, data, expected=1, settle=2.0, isolation="read_committed")
    copies = Counter(dict(r.headers)[MESSAGE_ID] for r in on_wire)
    assert list(copies.values()) == [1], f"read_committed: {sorted(copies.values())} copies of the row"
    assert {r.status for r in rows(outbox)} == {"published"}
    engine.dispose()


def test_a_settle_that_fails_part_way_holds_no_partition_it_could_end(
        kafka_cluster: LocalKafkaCluster) -> None:
    """An aborted transaction wrote two data partitions; one's only replica is down when the next
    producer of the id is made. Its settle writes its empty record on the other partition, waits in
    vain for the leaderless one, and ``transactional`` raises (retriable, the unsettled partitions
    kept: the relay tries again at a later batch). The failed settle's own transaction was left
    open: the healthy partition it reached (which other shards' transactions and other producers
    write too) held every read_committed reader at its empty record until the id's next producer
    fenced it (the relay's next try) or the transaction timed out (a minute at least: a relay
    stopped meanwhile, or whose shard went to another relay). The settle now aborts what it wrote
    when it fails. Once the replica is back, everything the id left open is ended, once."""
    tid = "outbox-settle-part-way-0"
    data, progress, refusing = "settle-part-way-data", "settle-part-way-progress", "settle-part-way-refusing"
    nodes = Nodes(kafka_cluster, tid)
    nodes.topic(data, nodes.victim, nodes.coordinator)
    nodes.topic(progress, nodes.coordinator, **{"cleanup.policy": "compact"})
    nodes.topic(refusing, nodes.coordinator, **{"max.message.bytes": "256"})
    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap, delivery_timeout=5.0)
    other = Producer({"bootstrap.servers": kafka_cluster.bootstrap, "enable.idempotence": True,
                      "log_level": 0})
    try:
        first = transport.transactional(tid, 5)
        answer = first.send([Record(data, b"row-0", key=b"a", partition=0),
                             Record(data, b"row-1", key=b"b", partition=1),
                             Record(refusing, os.urandom(2000), key=b"big", partition=0),
                             Record(progress, b"progress", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        first.close()
        nodes.kill_victim(data, 0)
        _, before = wait_until(lambda: stable_and_end(nodes.admin, data, 1), 10, f"{data}[1]'s offsets")
        started = time.monotonic()
        with pytest.raises(RetriableTransportError):
            transport.transactional(tid, 5)
        failed_after = time.monotonic() - started
        assert (data, 0) in transport._unsettled[tid].partitions, "the leaderless partition forgotten"
        # The fault reached: the failed settle wrote its empty record on the healthy partition.
        _, after = wait_until(lambda: stable_and_end(nodes.admin, data, 1), 10, f"{data}[1]'s offsets")
        assert after > before, f"the failed settle wrote nothing on {data}[1] (its end {before}, {after})"
        # Another producer's record on the partition the settle reached: read_committed readers get it.
        other.produce(data, b"another shard's row", b"c", 1)
        assert other.flush(10) == 0
        wait_until(lambda: (lambda s: s[0] == s[1])(stable_and_end(nodes.admin, data, 1)), 10,
                   f"{data}[1] open to read_committed readers again after the failed settle "
                   f"(it failed after {failed_after:.1f} s)")
        nodes.restart_victim(data, 0)
        taker = transport.transactional(tid, 10)
        assert not transport._unsettled[tid], transport._unsettled[tid]
        again = taker.send([Record(data, b"row-0 again", key=b"a", partition=0),
                            Record(progress, b"progress again", key=tid.encode(), partition=0)])
        assert again.outcome is TransactionOutcome.COMMITTED, again
        taker.close()
        seen = read_topic(kafka_cluster.bootstrap, data, expected=2, settle=1.0, isolation="read_committed")
        assert sorted(r.value for r in seen) == [b"another shard's row", b"row-0 again"]
        # A client made after the restart (the test's own knows no leader of the restarted partition).
        fresh = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap, "log_level": 0})
        wait_until(lambda: all((lambda s: s[0] == s[1])(stable_and_end(fresh, data, p)) for p in (0, 1)), 15,
                   f"both partitions of {data} open to read_committed readers")
    finally:
        other.flush(5)
        transport.close()


def test_a_settle_whose_own_abort_marker_is_dropped_keeps_the_partition_to_end(
        kafka_cluster: LocalKafkaCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction aborted after its data record was written, its marker there dropped: left open.
    The next producer of the id settles it: its empty record joins the open records, and its abort
    is answered by the coordinator, which then drops that marker too (the data partition's only
    replica gone again). ``settle`` took the answer for the end and forgot the partition, so the
    same producer's commit there ended everything open, committed: the old row, the settle's empty
    record (key the transactional id, no headers: a foreign record to any inbox) and the row sent
    again, all read_committed."""
    tid = "outbox-settle-dropped-0"
    data, progress, refusing = "settle-dropped-data", "settle-dropped-progress", "settle-dropped-refusing"
    nodes = Nodes(kafka_cluster, tid)
    nodes.topic(data, nodes.victim)
    nodes.topic(progress, nodes.coordinator, **{"cleanup.policy": "compact"})
    nodes.topic(refusing, nodes.coordinator, **{"max.message.bytes": "256"})
    transport = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap, delivery_timeout=10.0)
    marks: list[int] = []

    def kill_the_data_replica() -> None:
        nodes.kill_victim(data)
        marks.append(nodes.coordinator_log())

    try:
        # A transaction aborted (a record refused for good), its data marker dropped.
        first = transport.transactional(tid, 30)
        monkeypatch.setattr(first, "_producer",
                            KilledAtAbort(first._producer, kill_the_data_replica, answered_first=True))
        answer = first.send([Record(data, b"row-1", key=b"k", partition=0),
                             Record(refusing, os.urandom(2000), key=b"big", partition=0),
                             Record(progress, b"progress", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        wait_until(lambda: nodes.dropped_since(marks[-1]), 30, "the coordinator dropping the data marker")
        first.close()
        nodes.restart_victim(data)
        left_open = wait_until(lambda: stable_and_end(nodes.admin, data, 0), 30, "the data offsets")
        # The fault reached: row-1 at offset 0, left open (an end of 0: it was never written; a last
        # stable offset of 1 or more: the broker wrote its marker).
        assert left_open == (0, 1), f"the data partition's last stable offset and end: {left_open}"

        # The next producer's settle: its abort marker on the data partition dropped as well.
        made = _transactions.Producer
        monkeypatch.setattr(_transactions, "Producer",
                            lambda settings: KilledAtAbort(made(settings), kill_the_data_replica))
        with suppress(RetriableTransportError):  # it cannot tell its abort ended the partition there
            transport.transactional(tid, 30)
        monkeypatch.setattr(_transactions, "Producer", made)
        wait_until(lambda: nodes.dropped_since(marks[-1]), 30, "the coordinator dropping the settle's marker")
        nodes.restart_victim(data)

        taker = transport.transactional(tid, 30)
        again = taker.send([Record(data, b"row-1 again", key=b"k", partition=0),
                            Record(progress, b"progress again", key=tid.encode(), partition=0)])
        assert again.outcome is TransactionOutcome.COMMITTED, again
        taker.close()
        seen = read_topic(kafka_cluster.bootstrap, data, expected=1, settle=2.0, isolation="read_committed")
        assert [r.value for r in seen] == [b"row-1 again"]
    finally:
        transport.close()



@pytest.mark.parametrize("ending", ["stopped-while-its-settle-fails", "dead-after-the-abort"])
def test_a_relay_gone_before_its_settle_leaves_nothing_open_for_the_next_owner_to_commit(
        kafka_cluster: LocalKafkaCluster, sqlite_db: str, monkeypatch: pytest.MonkeyPatch,
        ending: str) -> None:
    """A shard's transaction aborts after its data record was written, and its abort marker there is
    dropped (the data partition's only replica killed). The relay that wrote it then goes before any
    producer of the id ends that record: stopped (``close``, as on SIGTERM) while its settle fails
    for want of the partition's leader, or dead right after the abort (its lease expired, as on
    SIGKILL). Its transport's list of where such transactions wrote went with it. The next owner, of
    another transport (another process), read nothing that named the partition: the record is not
    in any committed progress. Its commit there ended the old record committed too: the row twice
    for read_committed readers. The shard's lease row names the topic now, written before the send,
    and the take-over ends what is open on each of its partitions first."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    data, progress = f"gone-rows-{ending}", f"gone-progress-{ending}"
    fault = AbortedAtTheProgress(kafka_cluster, outbox, data, progress, monkeypatch)
    nodes, first, failed_makes = fault.nodes, fault.transport, fault.failed_makes
    relay = Relay(outbox, first, exactly_once=True, progress_topic=progress, worker_id="first",
                  lease_ttl=300)
    try:
        fault.aborted(relay)
        if ending == "stopped-while-its-settle-fails":
            wait_for(lambda: (relay.run_once(), bool(failed_makes))[1], 120,
                     "the next producer's settle failing", interval=0.0)
            assert rows(outbox, status="pending"), "the row was published while its partition was down"
            relay.close()  # gives its lease back
        else:  # dead: nothing more runs in it; its heartbeat and lease expire
            long_ago = datetime(2000, 1, 1, tzinfo=UTC)
            with engine.begin() as conn:
                conn.execute(outbox.tables.leases.update().values(expires_at=long_ago))
                conn.execute(outbox.tables.relays.update().values(heartbeat_at=long_ago))
        nodes.restart_victim(data)
        left_open = wait_until(lambda: stable_and_end(nodes.admin, data, 0), 30, "the data offsets")
        assert left_open[0] < left_open[1], f"nothing was left open: {left_open}"
        # The next owner: a transport of its own, as another process's.
        other = KafkaTransport(bootstrap_servers=kafka_cluster.bootstrap, delivery_timeout=10.0)
        second = Relay(outbox, other, exactly_once=True, progress_topic=progress, worker_id="second",
                       lease_ttl=300)
        try:
            wait_for(lambda: (second.run_once(), not rows(outbox, status="pending"))[1], 120,
                     "the row published by the next owner", interval=0.0)
        finally:
            second.close()
    finally:
        relay.close()
    on_wire = read_topic(kafka_cluster.bootstrap, data, expected=1, settle=2.0, isolation="read_committed")
    copies = Counter(dict(r.headers)[MESSAGE_ID] for r in on_wire)
    assert list(copies.values()) == [1], f"read_committed: {sorted(copies.values())} copies of the row"
    engine.dispose()
