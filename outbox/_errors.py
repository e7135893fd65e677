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
    ConfigurationError,
    InvalidTopicError,
    MessageValidationError,
    OutboxError,
    RetriableTransportError,
    TransportError,
)

__all__ = [
    "CommitRefusedError",
    "ConfigurationError",
    "InvalidContentTypeError",
    "InvalidHeadersError",
    "InvalidKeyError",
    "InvalidTopicError",
    "MessageValidationError",
    "OutboxError",
    "PayloadTooLargeError",
    "RetriableTransportError",
    "SchemaError",
    "TransportError",
    "UnserializablePayloadError",
]


class InvalidKeyError(MessageValidationError):
    """The sharding key has the wrong type or is too long."""


class InvalidHeadersError(MessageValidationError):
    """Headers are not a mapping of str to str, or use a reserved name."""


class InvalidContentTypeError(MessageValidationError):
    """The content type is malformed, or contradicts how the payload is serialised."""


class UnserializablePayloadError(MessageValidationError, TypeError):
    """The payload cannot be turned into bytes."""


class PayloadTooLargeError(MessageValidationError):
    """The serialised payload exceeds the configured maximum."""


class SchemaError(ConfigurationError):
    """The tables are missing, older than this release (upgrade them) or newer (upgrade the package)."""
