"""``outbox.testing``'s Apache Kafka: LocalKafka, LocalKafkaCluster and the broker a test needs.

What the broker-facing suite rests on: the broker is the one we started (its
port, its cluster), the faults a test plays do what they say (stop, kill,
freeze, restart on the same ports and data), the internal topics work on one
node (consumer groups, transactions), and a test that needs Apache Kafka
never runs on the mock.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from conftest import unavailable

from outbox.testing import (
    KAFKA_BOOTSTRAP_VARIABLE,
    KAFKA_LIBS_VARIABLE,
    BrokerNeed,
    KafkaStartError,
    LocalKafka,
    LocalKafkaCluster,
    Unavailable,
    create_topic,
    free_port,
    free_ports,
    kafka_bootstrap,
    wait_until_bound,
)
from transports.kafka import embedded_kafka
from transports.testing import read_topic

ROOT = Path(__file__).resolve().parents[1]


def produce(bootstrap: str, topic: str, value: bytes, timeout: float = 30.0) -> str | None:
    """Write one record with an idempotent ``acks=all`` producer; None once acknowledged, else the error."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "log_level": 0,
                         "message.timeout.ms": int(timeout * 1000)})
    reports: list[object] = []
    producer.produce(topic, value, b"k", on_delivery=lambda error, _: reports.append(error))
    producer.flush(timeout + 5)
    return "no report" if not reports else None if reports[0] is None else str(reports[0])


def held_by(port: int) -> socket.socket:
    """A listening socket on ``port``: what another xdist worker's server would be."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.mark.slow  # four starts of a JVM broker
def test_a_local_kafka_is_the_broker_on_its_port_and_survives_stop_kill_and_freeze(
    own_kafka: LocalKafka, topic: str
) -> None:
    broker = own_kafka
    assert broker.pid is not None
    wait_until_bound(broker.pid, broker.port, "the broker", timeout=5)
    metadata = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10)
    assert metadata.cluster_id == broker.cluster_id
    assert {(b.id, b.host, b.port) for b in metadata.brokers.values()} == {(1, "127.0.0.1", broker.port)}
    assert produce(broker.bootstrap, topic, b"before") is None

    broker.stop()  # SIGTERM: a clean shutdown
    assert broker.pid is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", broker.port), timeout=2).close()
    broker.start()  # same port, same data
    assert [r.value for r in read_topic(broker.bootstrap, topic, expected=1)] == [b"before"]

    broker.kill()  # SIGKILL: nothing flushed, nobody told
    broker.start()
    assert produce(broker.bootstrap, topic, b"after the kill") is None
    written = read_topic(broker.bootstrap, topic, expected=2)
    assert [r.value for r in written] == [b"before", b"after the kill"]

    broker.freeze()
    try:
        frozen = produce(broker.bootstrap, topic, b"while frozen", timeout=2)
        assert frozen is not None and "timed out" in frozen, frozen
    finally:
        broker.thaw()
    assert produce(broker.bootstrap, topic, b"thawed") is None

    broker.stop()
    taker = held_by(broker.port)  # the port went to someone else meanwhile
    try:
        with pytest.raises(KafkaStartError, match=f"127.0.0.1:{broker.port}: Address already in use"):
            broker.start()
    finally:
        taker.close()


@pytest.mark.kafka
@pytest.mark.slow  # two starts of a JVM broker
def test_a_first_start_that_finds_its_port_taken_starts_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the pick of a free port and the broker's bind, another process may take the port."""
    taken = free_port()
    first = [True]

    def picks(count: int) -> list[int]:  # the first pick (node 1's client port) is the taken one
        if first.pop() if first else False:
            return [taken, *(p for p in free_ports(count) if p != taken)][:count]
        return free_ports(count)

    monkeypatch.setattr("outbox.testing._kafka.free_ports", picks)
    taker = held_by(taken)
    try:
        try:
            broker = LocalKafka()
        except FileNotFoundError as exc:
            unavailable(str(exc))
        with broker:
            assert broker.port != taken
            assert broker.pid is not None
            wait_until_bound(broker.pid, broker.port, "the broker", timeout=5)
            assert produce(broker.bootstrap, f"t-{uuid.uuid4().hex[:8]}", b"v") is None
    finally:
        taker.close()


@pytest.mark.slow  # the first group and transaction create their internal topics: ~4 s
def test_groups_and_transactions_work_on_one_node(kafka: str, topic: str) -> None:
    """The internal topics (consumer offsets, transaction state) have one replica on one node."""
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"tx-{topic}", "log_level": 0})
    producer.init_transactions(30)
    for value, commit in ((b"aborted", False), (b"committed", True)):
        producer.begin_transaction()
        producer.produce(topic, value, b"k", partition=0)
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    consumer = Consumer({"bootstrap.servers": kafka, "group.id": f"g-{topic}", "log_level": 0,
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                         "enable.auto.commit": False, "session.timeout.ms": 6000})
    consumer.subscribe([topic])
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    try:
        while not got and time.monotonic() < deadline:
            got.extend(m.value() for m in consumer.consume(10, 0.5) if m.error() is None)
        [message] = consumer.consume(1, 0.5) or [None]  # nothing more: the aborted record is not read
        assert message is None
        consumer.commit(asynchronous=False)  # a group's offsets, on __consumer_offsets
    finally:
        consumer.close()
    assert got == [b"committed"]


def test_a_topic_can_be_created_with_its_own_settings(kafka: str, topic: str) -> None:
    create_topic(kafka, topic, 2, config={"max.message.bytes": "2000"})
    assert produce(kafka, topic, b"x" * 500) is None
    producer = Producer({"bootstrap.servers": kafka, "log_level": 0, "message.timeout.ms": 10000})
    errors: list[object] = []
    producer.produce(topic, b"x" * 5000, b"k", on_delivery=lambda error, _: errors.append(error))
    producer.flush(15)
    assert len(errors) == 1 and errors[0] is not None and "too large" in str(errors[0]).lower()


@pytest.mark.any_kafka
def test_a_test_that_needs_apache_kafka_never_gets_the_mock_from_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with embedded_kafka() as mock:
        monkeypatch.setenv(KAFKA_BOOTSTRAP_VARIABLE, mock)
        with pytest.raises(Unavailable, match="mock cluster"), kafka_bootstrap(BrokerNeed.REAL):
            pass
        with kafka_bootstrap(BrokerNeed.ANY) as servers:
            assert servers == mock


REAL_BROKER_TEST = "tests/test_local_kafka.py::test_groups_and_transactions_work_on_one_node"


@pytest.mark.slow  # a pytest of its own: 3-5 s
@pytest.mark.parametrize("ci, outcome", [("", "1 skipped"), ("true", "1 error")], ids=["locally", "CI"])
def test_without_apache_kafka_a_real_broker_test_skips_locally_and_fails_in_ci(
    tmp_path: Path, ci: str, outcome: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {KAFKA_BOOTSTRAP_VARIABLE, "CI"}}
    env.update({KAFKA_LIBS_VARIABLE: str(tmp_path), "CI": ci, "PATH": os.environ["PATH"]})
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rsf", "-p", "no:xdist",
                          REAL_BROKER_TEST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert outcome in run.stdout, run.stdout[-3000:]
    assert "no Apache Kafka" in run.stdout and "scripts/setup" in run.stdout, run.stdout[-3000:]


def test_the_cluster_finds_leaders_and_the_active_controller_and_outlives_losing_them(
    kafka_cluster: LocalKafkaCluster, topic: str
) -> None:
    cluster = kafka_cluster
    metadata = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(timeout=10)
    assert metadata.cluster_id == cluster.cluster_id and sorted(metadata.brokers) == [1, 2, 3]
    create_topic(cluster.bootstrap, topic, 3)
    found = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(topic, timeout=10)
    assert all(len(p.replicas) == 3 for p in found.topics[topic].partitions.values())
    assert produce(cluster.bootstrap, topic, b"one") is None

    leader = cluster.leader(topic, 0)
    cluster.kill(leader)
    assert cluster.leader(topic, 0) != leader  # a follower in the ISR took over
    assert produce(cluster.live_bootstrap(), topic, b"two") is None
    controller = cluster.active_controller()
    survivors = {1, 2, 3} - {leader}
    assert controller in survivors
    cluster.start(leader)
    cluster.kill(controller)
    assert cluster.active_controller() in {1, 2, 3} - {controller}
    assert produce(cluster.live_bootstrap(), topic, b"three") is None
    cluster.start(controller)
    values = sorted(r.value for r in read_topic(cluster.bootstrap, topic, expected=3))
    assert values == [b"one", b"three", b"two"]


def test_local_kafka_refuses_to_start_without_its_jars_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KAFKA_LIBS_VARIABLE, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="scripts/setup") as refused:
        LocalKafka()
    assert "\n" not in str(refused.value)


def test_the_ports_a_node_is_given_are_distinct() -> None:
    """A node's broker and controller listeners were picked one ``free_port`` at a time, and the
    kernel can hand a port just closed out again: both on one port, the node refused at its format
    ("two listeners on the same port", the CI of 892f5a3). ``free_ports`` holds each until all are
    picked."""
    for _ in range(200):
        ports = free_ports(6)
        assert len(set(ports)) == 6, ports
