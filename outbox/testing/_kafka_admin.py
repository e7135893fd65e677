"""Admin calls the local brokers' users need: create, change and delete a topic, find a leader.

Plain functions of a bootstrap address, so a test on any broker (the session's,
one from ``OUTBOX_TEST_KAFKA_BOOTSTRAP``) uses them as ``LocalKafka`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient


def admin_client(bootstrap: str) -> AdminClient:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, "socket.timeout.ms": 5000})


def create_topic(bootstrap: str, name: str, partitions: int = 1, *, replication_factor: int | None = None,
                 config: Mapping[str, str] | None = None, timeout: float = 30.0) -> None:
    """Create topic ``name`` on the broker at ``bootstrap`` and wait until every partition has a leader.

    ``config`` holds topic settings (``{"max.message.bytes": "2000"}``, ``min.insync.replicas``);
    ``replication_factor`` defaults to the broker's ``default.replication.factor``.
    """
    from confluent_kafka.admin import NewTopic

    admin = admin_client(bootstrap)
    topic = NewTopic(name, num_partitions=partitions, replication_factor=replication_factor or -1,
                     config=dict(config or {}))
    admin.create_topics([topic], operation_timeout=timeout)[name].result(timeout)
    deadline = time.monotonic() + timeout
    while True:
        found = admin.list_topics(name, timeout=timeout).topics.get(name)
        if (found is not None and found.error is None and len(found.partitions) == partitions
                and all(p.leader >= 0 for p in found.partitions.values())):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {name!r} has no leader for every partition after {timeout:.0f} s")
        time.sleep(0.1)


def delete_topic(bootstrap: str, name: str, timeout: float = 30.0) -> None:
    """Delete topic ``name`` on the broker at ``bootstrap``; return once the controller accepted it."""
    admin = admin_client(bootstrap)  # alive until the answer: a client dropped earlier cancels it
    admin.delete_topics([name], operation_timeout=timeout)[name].result(timeout)


def alter_topic(bootstrap: str, name: str, config: Mapping[str, str], timeout: float = 30.0) -> None:
    """Set topic settings (``{"min.insync.replicas": "2"}``) on the broker at ``bootstrap``, the
    others kept (an incremental change); return once the controller accepted it."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    entries = [ConfigEntry(key, str(value), incremental_operation=AlterConfigOpType.SET)
               for key, value in config.items()]
    resource = ConfigResource(ConfigResource.Type.TOPIC, name, incremental_configs=entries)
    admin = admin_client(bootstrap)  # alive until the answer: a client dropped earlier cancels it
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout)


def partition_leader(bootstrap: str, topic: str, partition: int, timeout: float = 30.0,
                     accept: Callable[[int], bool] = lambda broker: True) -> int:
    """The broker id leading ``topic``'s ``partition``; waits up to ``timeout`` s for one that ``accept``s.

    (Metadata names a killed leader until the controller has fenced it and moved leadership.)
    """
    deadline = time.monotonic() + timeout
    admin = admin_client(bootstrap)
    while True:
        found = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        known = found.partitions.get(partition) if found is not None else None
        if known is not None and known.leader >= 0 and accept(known.leader):
            return int(known.leader)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no leader of {topic}[{partition}] within {timeout:.0f} s")
        time.sleep(0.1)
