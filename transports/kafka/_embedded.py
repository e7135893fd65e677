"""An embedded Kafka-protocol broker: librdkafka's mock cluster.

It speaks the real protocol, so every client (this process's, other
processes', other languages') connects to it like to Kafka, but it needs no
JVM and no Docker. It lives as long as the context; topics auto-create with
4 partitions, and it keeps only the last few MiB of each partition.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from confluent_kafka import Producer


@contextmanager
def embedded_kafka(brokers: int = 3, rtt_ms: int = 0) -> Iterator[str]:
    """Start a mock cluster and yield its bootstrap servers ("host:port,…").

    ``rtt_ms`` delays every broker response (``test.mock.broker.rtt``), so a
    round trip costs what it costs on a real cluster across zones.
    """
    owner = Producer({"test.mock.num.brokers": brokers, "test.mock.broker.rtt": rtt_ms, "log_level": 3})
    try:
        metadata = owner.list_topics(timeout=10)
        yield ",".join(f"{b.host}:{b.port}" for b in metadata.brokers.values())
    finally:
        owner.flush(1)
