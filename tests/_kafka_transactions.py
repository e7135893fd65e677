"""Helpers of the tests that make Apache Kafka split or leave open a transaction on three nodes of
their own (``kafka_cluster``): where a transactional id's coordinator lives, topics of one replica on
chosen nodes, a partition's stable offset, a producer killed at its commit."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from outbox.testing import LocalKafkaCluster

T = TypeVar("T")

TXN_PARTITIONS = 4  # transaction.state.log.num.partitions of the test brokers


def coordinator_partition(transactional_id: str) -> int:
    """The ``__transaction_state`` partition of a transactional id (Java's ``String.hashCode``)."""
    h = 0
    for ch in transactional_id:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    signed = h - (1 << 32) if h >= 1 << 31 else h
    return (0 if signed == -(1 << 31) else abs(signed)) % TXN_PARTITIONS


def one_replica_topics(cluster: LocalKafkaCluster, tid: str, data: str, progress: str, *,
                       victim_holds: str) -> tuple[AdminClient, int, int]:
    """A data and a (compacted) progress topic of one partition and one replica each, for a split: one
    on the node whose ``__transaction_state`` partition coordinates ``tid``, the other (``victim_holds``:
    "data" or "progress") on a node that is neither it nor the active controller, the victim to kill
    while the coordinator writes the markers. Both have a leader on return. An admin client, the
    coordinator's node, the victim's."""
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "log_level": 0})
    coordinator = cluster.leader("__transaction_state", coordinator_partition(tid))
    spared = (coordinator, cluster.active_controller())
    victim = next(n.node_id for n in cluster.nodes if n.node_id not in spared)
    on = {data: victim if victim_holds == "data" else coordinator,
          progress: victim if victim_holds == "progress" else coordinator}
    made = admin.create_topics([
        NewTopic(data, num_partitions=1, replication_factor=-1, replica_assignment=[[on[data]]]),
        NewTopic(progress, num_partitions=1, replication_factor=-1, replica_assignment=[[on[progress]]],
                 config={"cleanup.policy": "compact"})])
    for future in made.values():
        future.result(30)
    cluster.leader(data, 0)
    cluster.leader(progress, 0)
    return admin, coordinator, victim


def stable_and_end(admin: AdminClient, topic: str, partition: int = 0) -> tuple[int, int]:
    """The partition's last stable offset and high watermark."""
    tp = TopicPartition(topic, partition)
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]  # confluent_kafka leaves it untyped

    def offset(level: IsolationLevel) -> int:
        answer = admin.list_offsets({tp: latest}, isolation_level=level, request_timeout=10)[tp]
        return int(answer.result(10).offset)
    return offset(IsolationLevel.READ_COMMITTED), offset(IsolationLevel.READ_UNCOMMITTED)


def wait_until(condition: Callable[[], T], timeout: float, what: str) -> T:
    """``condition()``'s first truthy answer, asked every 0.2 s (an error counts as no answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := condition():
                return value
        except Exception:  # a node is coming or going: ask again
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class KilledAtCommit:
    """A confluent producer whose ``commit_transaction`` first runs ``before``, and ``after`` once the
    commit was answered (everything else its own)."""

    def __init__(self, inner: Producer, before: Callable[[], None] = lambda: None,
                 after: Callable[[], None] = lambda: None) -> None:
        self._inner, self._before, self._after = inner, before, after

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def commit_transaction(self, *args: Any) -> None:
        self._before()
        self._inner.commit_transaction(*args)
        self._after()
