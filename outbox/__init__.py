"""transactional-outbox: publish events in the business transaction, relay them
to Kafka in per-key order, and consume them once with an idempotent inbox."""

from ._alerts import Alert, AlertSink, LoggingAlertSink, WebhookAlertSink
from ._engine import create_async_engine, create_engine
from ._envelope import Message, new_message_id
from ._errors import (
    ConfigurationError,
    InvalidHeadersError,
    InvalidKeyError,
    InvalidTopicError,
    LeaseLostError,
    MessageValidationError,
    OutboxError,
    PayloadTooLargeError,
    PermanentTransportError,
    RetriableTransportError,
    TransportError,
    UnserializablePayloadError,
)
from ._outbox import Outbox
from ._relay import Relay
from ._relay_batch import BatchResult
from ._relay_metrics import RelayMetrics, relay_metrics
from ._tables import OutboxTables
from ._wire import ForeignRecordError, message_to_record, record_to_message

__all__ = [
    "Alert",
    "AlertSink",
    "BatchResult",
    "ConfigurationError",
    "ForeignRecordError",
    "InvalidHeadersError",
    "InvalidKeyError",
    "InvalidTopicError",
    "LeaseLostError",
    "LoggingAlertSink",
    "Message",
    "MessageValidationError",
    "Outbox",
    "OutboxError",
    "OutboxTables",
    "PayloadTooLargeError",
    "PermanentTransportError",
    "Relay",
    "RelayMetrics",
    "RetriableTransportError",
    "TransportError",
    "UnserializablePayloadError",
    "WebhookAlertSink",
    "create_async_engine",
    "create_engine",
    "message_to_record",
    "new_message_id",
    "record_to_message",
    "relay_metrics",
]
