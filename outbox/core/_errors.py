"""The error hierarchy: one root, and each error also a builtin it resembles.

The root and the errors a transport raises are defined in ``transports._errors``
(the lowest layer that raises them) and re-exported here.

Callers can catch ``OutboxError`` for everything this library raises, or the
builtin (``ValueError``, ``TypeError``, ``ConnectionError``) when they already
handle that family.
"""

from __future__ import annotations

from transports._errors import (
    CommitRefusedError,
    CommitUnansweredError,
    CommitUnconfirmedError,
    ConfigurationError,
    HeldByOpenTransactionError,
    InvalidTopicError,
    MessageValidationError,
    OutboxError,
    RetriableTransportError,
    TopicNotFoundError,
    TransportError,
    UnsupportedBrokerError,
)

__all__ = [
    "CommitRefusedError",
    "CommitUnansweredError",
    "CommitUnconfirmedError",
    "ConfigurationError",
    "HeldByOpenTransactionError",
    "InvalidContentTypeError",
    "InvalidDelayError",
    "InvalidEventTypeError",
    "InvalidHeadersError",
    "InvalidKeyError",
    "InvalidTopicError",
    "MessageValidationError",
    "NonStandardJsonError",
    "OutboxError",
    "PayloadTooLargeError",
    "RecordTooLargeError",
    "RetriableTransportError",
    "SchemaError",
    "TopicNotFoundError",
    "TransportError",
    "UnserializablePayloadError",
    "UnsupportedBrokerError",
]


class InvalidKeyError(MessageValidationError):
    """The sharding key has the wrong type or is too long."""


class InvalidHeadersError(MessageValidationError):
    """Headers are not a mapping of str to str, or use a reserved name."""


class InvalidContentTypeError(MessageValidationError):
    """The content type is malformed, or contradicts how the payload is serialised."""


class UnserializablePayloadError(MessageValidationError, TypeError):
    """The payload cannot be turned into bytes."""


class NonStandardJsonError(UnserializablePayloadError):
    """A JSON payload would not be standard JSON: NaN or Infinity, or two keys that serialise alike.

    ``{"a": float("nan")}`` and ``{1: "x", "1": "y"}`` have no standard JSON form
    that a consumer reads back as sent; a pydantic model would even turn NaN
    into ``null`` without a word.
    """


class PayloadTooLargeError(MessageValidationError):
    """The serialised payload exceeds the configured maximum."""


class RecordTooLargeError(PayloadTooLargeError):
    """The broker record (payload, key, headers and envelope) exceeds ``max_record_bytes``.

    The limit is stored with the tables and agreed with the relay's producer, so
    a record refused here is one the relay could never have sent.
    """


class InvalidEventTypeError(MessageValidationError):
    """The event type is not 1-255 characters of text without control characters, or
    contradicts the registered type of the model published."""


class InvalidDelayError(MessageValidationError):
    """The delay is not a timedelta or seconds, is negative, not finite, or too long."""


class SchemaError(ConfigurationError):
    """The tables are missing, older than this release (upgrade them) or newer (upgrade the package)."""
