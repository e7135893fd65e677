"""The two FastStream Kafka brokers' records and commits, in the primitives the inbox takes.

``faststream.confluent`` hands confluent-kafka ``Message`` objects (accessor
methods) and consumes through a wrapper around confluent-kafka's
``Consumer``; ``faststream.kafka`` hands aiokafka ``ConsumerRecord`` objects
(attributes) and consumes through an ``AIOKafkaConsumer``.
"""

from __future__ import annotations

from typing import Any

from transports import Record
from transports._logsafe import safe_logger

log = safe_logger("outbox.inbox")


def record_of(raw: Any) -> Record:
    """The ``Record`` of a consumed confluent-kafka ``Message`` or aiokafka ``ConsumerRecord``."""
    if callable(raw.topic):  # confluent-kafka
        timestamp_type, timestamp = raw.timestamp()
        return Record(topic=raw.topic(), value=raw.value(), key=raw.key(),
                      headers=list(raw.headers() or ()), partition=raw.partition(), offset=raw.offset(),
                      timestamp_ms=timestamp if timestamp_type else None)
    return Record(topic=raw.topic, value=raw.value, key=raw.key, headers=list(raw.headers or ()),
                  partition=raw.partition, offset=raw.offset,
                  timestamp_ms=raw.timestamp if raw.timestamp is not None and raw.timestamp >= 0 else None)


async def commit_through(message: Any) -> None:
    """Commit "everything of the record's partition before the record after it": nothing later.

    A confluent-kafka commit is asynchronous: the next record need not wait
    for the broker, and a commit lost in a crash means one redelivery, dropped
    as a duplicate. An aiokafka commit that a rebalance refused is logged, not
    raised: the record is finished, and its next delivery is dropped the same
    way. FastStream's in-memory ``TestKafkaBroker`` hands a consumer with
    nothing to commit on.
    """
    raw, consumer = message.raw_message, message.consumer
    if hasattr(consumer, "consumer"):  # faststream.confluent: confluent-kafka's Consumer inside
        from confluent_kafka import TopicPartition

        consumer.consumer.commit(offsets=[TopicPartition(raw.topic(), raw.partition(), raw.offset() + 1)],
                                 asynchronous=True)
    elif hasattr(consumer, "assignment"):  # faststream.kafka: aiokafka's AIOKafkaConsumer
        from aiokafka.errors import CommitFailedError
        from aiokafka.structs import TopicPartition as AioTopicPartition

        try:
            await consumer.commit({AioTopicPartition(raw.topic, raw.partition): raw.offset + 1})
        except CommitFailedError:
            log.info("commit of %s[%d]@%d refused by a rebalance; its next owner redelivers it, "
                     "and the inbox drops it as a duplicate", raw.topic, raw.partition, raw.offset)
