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


def set_producer_quota(bootstrap: str, client_id: str, bytes_per_second: int | None,
                       timeout: float = 60.0) -> None:
    """Throttle the producers of ``client_id`` on the broker at ``bootstrap`` to ``bytes_per_second``
    (Kafka's ``producer_byte_rate`` client quota; None removes it).

    The broker takes such a producer's requests and holds its connection muted for as long as the
    bytes put it over the rate: a broker that answers, slowly for what is sent. confluent-kafka's
    admin client has no client-quota call, so Kafka's own ``kafka-configs`` runs (its class, on the
    local broker's jars: ``_kafka_libs``).
    """
    import subprocess

    from ._kafka_libs import java, kafka_libs, missing

    libs, runtime = kafka_libs(), java()
    if libs is None or runtime is None:
        raise RuntimeError(f"cannot set a client quota: {missing()}")
    change = (["--add-config", f"producer_byte_rate={bytes_per_second}"] if bytes_per_second is not None
              else ["--delete-config", "producer_byte_rate"])
    done = subprocess.run([runtime, "-cp", f"{libs}/*", "kafka.admin.ConfigCommand", "--bootstrap-server",
                           bootstrap, "--alter", *change, "--entity-type", "clients", "--entity-name",
                           client_id], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kafka-configs could not set {client_id!r}'s quota: "
                           f"{(done.stderr or done.stdout).strip()[-500:]}")
