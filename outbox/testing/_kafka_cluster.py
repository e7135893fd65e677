"""Three Apache Kafka nodes on one host, for failover tests (``LocalKafkaCluster``).

Each node is a combined broker and controller (``_kafka_node``): the three are
the metadata quorum's voters and the cluster's brokers, so a node killed is a
broker and a voter gone, and killing the active controller moves the quorum's
leadership and the leadership of the partitions that node led. (Three
controllers and three brokers apart would be six JVMs on a 2-core machine.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._kafka import START_TIMEOUT, _KafkaNodes
from ._kafka_node import STOP_TIMEOUT, KafkaNode


class LocalKafkaCluster(_KafkaNodes):
    """A throwaway three-node Apache Kafka on this host (KRaft, each node broker and controller).

    Topics get ``replication_factor`` replicas (3) and ``min_insync_replicas`` (2), internal ones
    too. Nodes are numbered from 1: ``kill(n)``, ``stop(n)``, ``start(n)``, ``freeze(n)`` and
    ``thaw(n)`` act on one; ``leader(topic, partition)`` and ``active_controller()`` say whom to
    hit. ``heap`` is per node. Meant for ``slow`` failover tests: three JVMs.
    """

    def __init__(self, nodes: int = 3, *, replication_factor: int = 3, min_insync_replicas: int = 2,
                 settings: Mapping[str, str] | None = None, heap: str = "384m", libs: Path | None = None,
                 start_timeout: float = START_TIMEOUT) -> None:
        if not 1 <= min_insync_replicas <= replication_factor <= nodes:
            raise ValueError(f"need 1 <= min_insync_replicas ({min_insync_replicas}) <= replication_factor "
                             f"({replication_factor}) <= nodes ({nodes})")
        super().__init__(nodes, replication_factor=replication_factor,
                         min_insync_replicas=min_insync_replicas, settings=settings, heap=heap, libs=libs,
                         start_timeout=start_timeout)

    def __repr__(self) -> str:
        return f"LocalKafkaCluster({self.version}, {self.nodes!r})"

    def start(self, *node_ids: int) -> None:
        """Start nodes ``node_ids`` again (same ports, same data), side by side; return once each is
        ready (several at once start in about the time of one)."""
        self._restart(*(self.node(node_id) for node_id in node_ids))

    def stop(self, node_id: int, timeout: float = STOP_TIMEOUT) -> None:
        self.node(node_id).stop(timeout)

    def kill(self, node_id: int) -> None:
        self.node(node_id).kill()

    def freeze(self, node_id: int) -> None:
        self.node(node_id).freeze()

    def thaw(self, node_id: int) -> None:
        self.node(node_id).thaw()

    def active_controller(self, timeout: float = 30.0) -> int:
        """The node id of the metadata quorum's leader (the active controller), among running nodes.

        Read from each running node's ``quorum-state`` file (its last known leader and epoch): the
        newest epoch's leader, once that leader runs and is not frozen. Waits up to ``timeout`` s
        for an election after the leader went away.
        """
        deadline = time.monotonic() + timeout
        while True:
            newest: tuple[int, int] | None = None
            for node in self.nodes:
                if not node.running:
                    continue
                state = _quorum_state(node)
                if state is not None and (newest is None or state[0] > newest[0]):
                    newest = state
            if newest is not None:
                leader = next((n for n in self.nodes if n.node_id == newest[1]), None)
                if leader is not None and leader.running and not leader.frozen:
                    return leader.node_id
            if time.monotonic() > deadline:
                raise TimeoutError(f"no running active controller within {timeout:.0f} s")
            time.sleep(0.1)


def _quorum_state(node: KafkaNode) -> tuple[int, int] | None:
    """(leader epoch, leader id) from the node's ``__cluster_metadata-0/quorum-state``, if it knows one."""
    try:
        path = node.data_dir / "__cluster_metadata-0" / "quorum-state"
        state: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    leader, epoch = int(state.get("leaderId", -1)), int(state.get("leaderEpoch", -1))
    return (epoch, leader) if leader >= 0 else None
