"""murmur2 agrees with Kafka's Java client and with librdkafka."""

from __future__ import annotations

import pytest

from outbox.core._sharding import shard_for_key
from transports._partitioner import murmur2, partition_for_key

# From Kafka's UtilsTest.testMurmur2.
JAVA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize("data, expected", JAVA_VECTORS.items())
def test_murmur2_matches_java(data, expected):
    assert murmur2(data) == expected


def test_shards_are_stable_and_in_range():
    assert {shard_for_key("order-1", 16) for _ in range(10)} == {shard_for_key("order-1", 16)}
    assert all(0 <= shard_for_key(f"k{i}", 7) < 7 for i in range(1000))
    assert all(0 <= shard_for_key(None, 7) < 7 for _ in range(100))


@pytest.mark.any_kafka
def test_partition_matches_librdkafka_murmur2_partitioner(any_kafka, topic):
    """librdkafka's murmur2_random is the Java-compatible partitioner: we must agree."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": any_kafka, "partitioner": "murmur2_random"})
    landed: dict[bytes, int] = {}
    keys = [f"order-{i}".encode() for i in range(200)]
    for key in keys:
        producer.produce(topic, key=key, value=b"v",
                         on_delivery=lambda err, msg: landed.__setitem__(msg.key(), msg.partition()))
    assert producer.flush(10) == 0
    partitions = len(producer.list_topics(topic).topics[topic].partitions)
    assert {k: partition_for_key(k, partitions) for k in keys} == landed
