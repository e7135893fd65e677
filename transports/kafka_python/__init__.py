"""Kafka transport and source on kafka-python-ng (install the ``kafka-python`` extra).

For teams that already run kafka-python-ng clients and do not want librdkafka.
"""

try:
    import kafka  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'transports.kafka_python needs kafka-python-ng: pip install "transactional-outbox[kafka-python]"'
    ) from exc

from ._source import KafkaPythonSource
from ._transport import KafkaPythonTransport

__all__ = ["KafkaPythonSource", "KafkaPythonTransport"]
