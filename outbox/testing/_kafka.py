"""A real Apache Kafka for tests: ``LocalKafka``, one KRaft node (``_kafka_cluster`` has three).

Started from the broker's jars (``_kafka_libs``: ``scripts/setup`` fetches them
from Maven Central) with the machine's Java, in a temp dir, on free ports of
127.0.0.1. Each node is a combined broker and controller (``_kafka_node``).

Ready means, for every node: the JVM runs; its log says it listens on both of
its ports; the listening sockets of those ports are this JVM's (``/proc``);
and a metadata request on its client port is answered with *our* cluster id
and lists the node at its address. A free port can be taken between the pick
and the bind: a first start that loses that race starts again on new ports
(three times at most); a restart must get its old ports back and fails
clearly when it cannot.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Self

from ._jvm import HOST
from ._kafka_admin import admin_client, create_topic, partition_leader
from ._kafka_libs import java, kafka_libs, kafka_version, missing
from ._kafka_node import STOP_TIMEOUT, KafkaNode
from ._ports import free_ports

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient, ClusterMetadata

START_TIMEOUT = 120.0
PORT_ATTEMPTS = 3

TEST_SETTINGS: Mapping[str, str] = {
    # Several partitions per auto-created topic, as librdkafka's mock cluster gives (4): a test's
    # keys spread over partitions without creating the topic first.
    "num.partitions": "4",
    # A new consumer group forms at once instead of waiting 3 s for more members.
    "group.initial.rebalance.delay.ms": "0",
    # The tests' consumers use sessions of a few seconds (a dead member is noticed sooner); the
    # broker's floor is 6 s by default.
    "group.min.session.timeout.ms": "1000",
    # The same for KIP-848 consumer groups (group.protocol=consumer), whose session and
    # heartbeat the broker sets: 45 s and 5 s by default, and a new member waits for a
    # heartbeat to get its partitions.
    "group.consumer.session.timeout.ms": "6000",
    "group.consumer.min.session.timeout.ms": "1000",
    "group.consumer.heartbeat.interval.ms": "500",
    "group.consumer.min.heartbeat.interval.ms": "500",
    # Internal topics created on first use: 4 partitions instead of 50 start faster on one host.
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.num.partitions": "4",
}
"""Settings every local broker gets (``settings=`` overrides any of them)."""


class KafkaStartError(RuntimeError):
    """A local Apache Kafka node did not become ready; the message ends with its log's tail."""


class _PortRace(Exception):
    """A node's first start found one of its picked ports taken: try again on new ones."""


def replication(factor: int, min_insync: int) -> dict[str, str]:
    """The replication settings of the cluster's topics, internal ones included.

    The transaction state log's too, so that transactional producers work on one node.
    """
    return {
        "default.replication.factor": str(factor),
        "min.insync.replicas": str(min_insync),
        "offsets.topic.replication.factor": str(factor),
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": str(min_insync),
        "share.coordinator.state.topic.replication.factor": str(factor),
        "share.coordinator.state.topic.min.isr": str(min_insync),
    }


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes in URL-safe base64 (``kafka-storage random-uuid``)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka avoids these too: a command line reads them as an option
            return text


class _KafkaNodes:
    """What ``LocalKafka`` and ``LocalKafkaCluster`` share: nodes, readiness, topics, clean-up."""

    def __init__(self, count: int, *, replication_factor: int, min_insync_replicas: int,
                 settings: Mapping[str, str] | None, heap: str, libs: Path | None,
                 start_timeout: float, relayed_at: int | None = None) -> None:
        jars, runtime = libs or kafka_libs(), java()
        if jars is None or runtime is None:
            raise FileNotFoundError(missing() or "no Apache Kafka jars or no Java runtime")
        self.version = kafka_version(jars)
        self.cluster_id = new_cluster_id()
        self.start_timeout = start_timeout
        self._relayed_at = relayed_at
        self._root = Path(tempfile.mkdtemp(prefix="outbox-kafka-"))
        self.nodes = [KafkaNode(i, self._root / f"node-{i}", libs=jars, java=runtime, heap=heap)
                      for i in range(1, count + 1)]
        self._properties = {**TEST_SETTINGS, **replication(replication_factor, min_insync_replicas),
                            **{k: str(v) for k, v in (settings or {}).items()}}
        try:
            self._first_start()
        except BaseException:
            self.close()
            raise

    # -- start -----------------------------------------------------------------------------------

    def _first_start(self) -> None:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._configure()
            self._format()
            for node in self.nodes:
                node.launch()
            try:
                self._wait_ready(self.nodes, first=True)
                return
            except _PortRace as race:
                if attempt == PORT_ATTEMPTS:
                    raise KafkaStartError(f"{race}, in each of {PORT_ATTEMPTS} starts on new ports") from None
                for node in self.nodes:
                    node.kill()
                    shutil.rmtree(node.data_dir, ignore_errors=True)

    def _configure(self) -> None:
        # Every port of every node distinct: picked one by one, two could be the same.
        per_node = 2 if self._relayed_at is None else 3
        picked = iter(free_ports(per_node * len(self.nodes)))
        ports = [(next(picked), next(picked)) for _ in self.nodes]
        voters = ",".join(f"{node.node_id}@{HOST}:{controller}"
                          for node, (_, controller) in zip(self.nodes, ports, strict=True))
        for node, (port, controller) in zip(self.nodes, ports, strict=True):
            relayed = None if self._relayed_at is None else (next(picked), self._relayed_at)
            node.configure(port, controller, {"controller.quorum.voters": voters, **self._properties},
                           relayed)

    def _format(self) -> None:
        """Format every node's data directory (one JVM each, side by side)."""
        runs = [(node, subprocess.Popen(node.format_command(self.cluster_id), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, cwd=node.directory))
                for node in self.nodes]
        for node, run in runs:
            out, _ = run.communicate(timeout=self.start_timeout)
            if run.returncode != 0:
                raise KafkaStartError(f"formatting Kafka node {node.node_id} failed:\n"
                                      f"{out.decode(errors='replace')[-3000:]}")

    def _wait_ready(self, nodes: list[KafkaNode], *, first: bool = False) -> None:
        """Wait until each of ``nodes`` is ready (module doc); raise ``KafkaStartError`` with its log
        when one exits or the start timeout passes."""
        deadline = time.monotonic() + self.start_timeout
        pending = list(nodes)
        admins: dict[int, AdminClient] = {}
        while pending:
            for node in pending:
                if node.running:
                    continue
                if first and node.lost_a_port_race():
                    raise _PortRace(f"Kafka node {node.node_id} found port {node.port} or "
                                    f"{node.controller_port} taken")
                raise KafkaStartError(f"Kafka node {node.node_id} exited ({node.exit_code()}) while "
                                      f"starting: {node.first_error()}\n{node.tail()}")
            for node in [n for n in pending if n.says_bound()]:
                node.prove_bound()
                admin = admins.setdefault(node.node_id, admin_client(node.bootstrap))
                if self._answers_for_us(node, admin):
                    pending.remove(node)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(node.tail() for node in pending)
                raise KafkaStartError(f"Kafka node(s) {[n.node_id for n in pending]} not ready within "
                                      f"{self.start_timeout:.0f} s:\n{tails}")
            if pending:
                time.sleep(0.2)

    def _answers_for_us(self, node: KafkaNode, admin: AdminClient) -> bool:
        """Whether ``node``'s client port answers with our cluster and lists the node at its address.

        Another cluster's broker on that port (a port taken after our pick) answers with another
        cluster id: that is an error, not "not ready yet".
        """
        from confluent_kafka import KafkaException

        try:
            metadata: ClusterMetadata = admin.list_topics(timeout=2)
        except KafkaException:
            return False
        if metadata.cluster_id != self.cluster_id:
            raise KafkaStartError(f"port {node.port} of Kafka node {node.node_id} is answered by cluster "
                                  f"{metadata.cluster_id!r}, not ours ({self.cluster_id!r})")
        listed = metadata.brokers.get(node.node_id)
        return listed is not None and (listed.host, listed.port) == (HOST, node.port)

    # -- what tests use --------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """Bootstrap servers: every node's client address."""
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> KafkaNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no Kafka node {node_id} (nodes {[n.node_id for n in self.nodes]})")

    def live_bootstrap(self) -> str:
        """Bootstrap servers of the nodes that run and are not frozen (all nodes if none does)."""
        live = [node.bootstrap for node in self.nodes if node.running and not node.frozen]
        return ",".join(live) or self.bootstrap

    def create_topic(self, name: str, partitions: int = 1, *, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, timeout: float = 30.0) -> None:
        """``create_topic`` on this broker's running nodes."""
        create_topic(self.live_bootstrap(), name, partitions, replication_factor=replication_factor,
                     config=config, timeout=timeout)

    def leader(self, topic: str, partition: int, timeout: float = 30.0) -> int:
        """The node id leading ``topic``'s ``partition``: a node that runs and is not frozen, as the
        running nodes' metadata says. After the leader was killed, waits (up to ``timeout`` s) until
        the controller has moved leadership (``broker.session.timeout.ms``, 9 s, for a SIGKILL)."""
        def serving(node_id: int) -> bool:
            node = next((n for n in self.nodes if n.node_id == node_id), None)
            return node is not None and node.running and not node.frozen

        return partition_leader(self.live_bootstrap(), topic, partition, timeout, accept=serving)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every node and delete the directory (data and logs): the broker was a throwaway."""
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self._root, ignore_errors=True)

    def _restart(self, *nodes: KafkaNode) -> None:
        """Start stopped or killed nodes again on their ports and data, side by side; wait until
        each is ready."""
        for node in nodes:
            node.launch()
        self._wait_ready(list(nodes))


class LocalKafka(_KafkaNodes):
    """A throwaway single-node Apache Kafka (KRaft, broker and controller in one JVM); a context manager.

    ``bootstrap`` is its address (``127.0.0.1:PORT``). Topics are auto-created with 4 partitions;
    internal topics (consumer offsets, transaction state) have replication factor 1, so consumer
    groups and transactional producers work. ``settings`` are broker properties on top of
    ``TEST_SETTINGS``. ``stop()`` (SIGTERM), ``kill()`` (SIGKILL), ``freeze()`` (SIGSTOP),
    ``thaw()`` and ``start()`` (same ports, same data) are the faults a test plays.
    ``relayed_at``: a second client listener whose metadata names that port, where the test's
    proxy listens (``KafkaNode.configure``; the proxy forwards to ``nodes[0].relayed[0]``). Raises
    ``FileNotFoundError`` (one line: how to get the jars) when Java or the jars are missing.
    """

    def __init__(self, settings: Mapping[str, str] | None = None, *, heap: str = "512m",
                 libs: Path | None = None, start_timeout: float = START_TIMEOUT,
                 relayed_at: int | None = None) -> None:
        super().__init__(1, replication_factor=1, min_insync_replicas=1, settings=settings, heap=heap,
                         libs=libs, start_timeout=start_timeout, relayed_at=relayed_at)

    def __repr__(self) -> str:
        return f"LocalKafka({self.version}, {self.nodes[0]!r})"

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def pid(self) -> int | None:
        """The broker JVM's process id while it runs."""
        return self.nodes[0].pid

    @property
    def log_path(self) -> Path:
        return self.nodes[0].log_path

    @property
    def frozen(self) -> bool:
        """Whether the broker is stopped by ``freeze()`` and not yet thawed."""
        return self.nodes[0].frozen

    def start(self) -> None:
        """Start the broker again after ``stop()`` or ``kill()``; return once it is ready."""
        self._restart(self.nodes[0])

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after ``timeout`` s."""
        self.nodes[0].stop(timeout)

    def kill(self) -> None:
        self.nodes[0].kill()

    def freeze(self) -> None:
        self.nodes[0].freeze()

    def thaw(self) -> None:
        self.nodes[0].thaw()


@contextmanager
def local_kafka(settings: Mapping[str, str] | None = None) -> Iterator[str]:
    """Run a throwaway single-node Apache Kafka; yield its bootstrap servers; remove it after."""
    with LocalKafka(settings) as kafka:
        yield kafka.bootstrap
