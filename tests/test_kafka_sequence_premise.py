"""What Apache Kafka checks of an idempotent producer's sequence numbers: the premise of ``_isolate``.

``KafkaTransport`` sends the records of a request refused whole again one at a time on a new
producer (``transports/kafka/_transport.py``, ``_isolate``), because a new producer id's first
batch on a partition is taken at any sequence number (``ProducerAppendInfo.checkSequence``):
a second request on its way behind a refused first one would be written ahead of it. This
speaks the protocol itself (InitProducerId, then ProduceRequest v7 with chosen sequence
numbers), which no client lets a test do, so that a broker that starts checking shows here.
"""

from __future__ import annotations

import uuid

from _kafka_protocol import NONE, Connection
from confluent_kafka.admin import AdminClient

from outbox.testing import create_topic

OUT_OF_ORDER_SEQUENCE_NUMBER = 45


def leader_of(bootstrap: str, topic: str, partition: int) -> str:
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    leader = metadata.topics[topic].partitions[partition].leader
    broker = metadata.brokers[leader]
    return f"{broker.host}:{broker.port}"


def test_a_new_producer_ids_first_batch_is_taken_at_any_sequence_and_then_gaps_are_refused(
    kafka: str,
) -> None:
    topic = f"seq-{uuid.uuid4().hex[:10]}"
    create_topic(kafka, topic, 1)
    connection = Connection(leader_of(kafka, topic, 0))
    try:
        pid = connection.producer_id()
        # As hot:1 after hot:0's request was refused before the log: written, the partition's first.
        assert connection.produce(topic, 0, pid, 1) == NONE
        # hot:0 sent again after it: now it is the one out of order.
        assert connection.produce(topic, 0, pid, 0) == OUT_OF_ORDER_SEQUENCE_NUMBER
        # Once the producer id has state on the partition, a gap is refused: what pipelining rests on.
        assert connection.produce(topic, 0, pid, 2) == NONE
        assert connection.produce(topic, 0, pid, 4) == OUT_OF_ORDER_SEQUENCE_NUMBER
    finally:
        connection.close()
