"""transactional-outbox: publish events in the business transaction, relay them
to Kafka in per-key order, and consume them once with an idempotent inbox."""

from .core._alerts import Alert, AlertKind, AlertSink, LoggingAlertSink, WebhookAlertSink
from .core._cloudevents import CloudEvents
from .core._engine import create_async_engine, create_engine
from .core._envelope import Message, new_message_id
from .core._errors import (
    CommitRefusedError,
    CommitUnansweredError,
    CommitUnconfirmedError,
    ConfigurationError,
    HeldByOpenTransactionError,
    InvalidContentTypeError,
    InvalidDelayError,
    InvalidEventTypeError,
    InvalidHeadersError,
    InvalidKeyError,
    InvalidTopicError,
    MessageValidationError,
    NonStandardJsonError,
    OutboxError,
    PayloadTooLargeError,
    RecordTooLargeError,
    RetriableTransportError,
    SchemaError,
    TopicNotFoundError,
    TransportError,
    UnserializablePayloadError,
)
from .core._events import event, event_type_of, upcaster
from .core._foreign import ForeignEnvelope
from .core._gc import tune_gc_for_batches
from .core._tables import OutboxTables
from .core._wire import ForeignRecordError, message_to_record, record_to_message
from .inbox import (
    DiscardRefusedError,
    Disposition,
    ForeignRecords,
    HandlerSignal,
    Inbox,
    NotParkedError,
    ParkedMessage,
    ParkedReplay,
    ParkMessage,
    RetryLater,
    SkipMessage,
    StartPolicy,
    UnknownEvents,
)
from .producer import AsyncOutbox, Outbox
from .relay import BatchResult, Relay, RelayMetrics, relay_metrics

__all__ = [
    "Alert",
    "AlertKind",
    "AlertSink",
    "AsyncOutbox",
    "BatchResult",
    "CloudEvents",
    "CommitRefusedError",
    "CommitUnansweredError",
    "CommitUnconfirmedError",
    "ConfigurationError",
    "DiscardRefusedError",
    "Disposition",
    "ForeignEnvelope",
    "ForeignRecordError",
    "ForeignRecords",
    "HandlerSignal",
    "HeldByOpenTransactionError",
    "Inbox",
    "InvalidContentTypeError",
    "InvalidDelayError",
    "InvalidEventTypeError",
    "InvalidHeadersError",
    "InvalidKeyError",
    "InvalidTopicError",
    "LoggingAlertSink",
    "Message",
    "MessageValidationError",
    "NonStandardJsonError",
    "NotParkedError",
    "Outbox",
    "OutboxError",
    "OutboxTables",
    "ParkMessage",
    "ParkedMessage",
    "ParkedReplay",
    "PayloadTooLargeError",
    "RecordTooLargeError",
    "Relay",
    "RelayMetrics",
    "RetriableTransportError",
    "RetryLater",
    "SchemaError",
    "SkipMessage",
    "StartPolicy",
    "TopicNotFoundError",
    "TransportError",
    "UnknownEvents",
    "UnserializablePayloadError",
    "WebhookAlertSink",
    "create_async_engine",
    "create_engine",
    "event",
    "event_type_of",
    "message_to_record",
    "new_message_id",
    "record_to_message",
    "relay_metrics",
    "tune_gc_for_batches",
    "upcaster",
]


def __getattr__(name: str) -> str:
    """``outbox.__version__``, read from the distribution's metadata when first asked for.

    Lazily: reading package metadata costs tens of milliseconds that a process
    which never asks should not pay at ``import outbox``.
    """
    if name == "__version__":
        from ._version import version

        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
