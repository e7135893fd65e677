"""Kafka transport on confluent-kafka (install the ``kafka`` extra)."""

try:
    import confluent_kafka  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'transports.kafka needs confluent-kafka: pip install "transactional-outbox[kafka]"'
    ) from exc

from ._embedded import embedded_kafka
from ._settings import librdkafka_config, property_of
from ._source import KafkaSource
from ._transactions import KafkaTransactionalProducer
from ._transport import KafkaTransport

__all__ = ["KafkaSource", "KafkaTransactionalProducer", "KafkaTransport", "embedded_kafka",
           "librdkafka_config", "property_of"]
