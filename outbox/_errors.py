"""The error hierarchy: one root, and each error also a builtin it resembles.

Callers can catch ``OutboxError`` for everything this library raises, or the
builtin (``ValueError``, ``TypeError``, ``ConnectionError``) when they already
handle that family.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Root of every error this library raises."""


class ConfigurationError(OutboxError, ValueError):
    """A setting is invalid; raised when the object is built, not on first use."""


class MessageValidationError(OutboxError, ValueError):
    """A message handed to ``publish()`` is invalid; nothing was written."""


class InvalidTopicError(MessageValidationError):
    """The topic name breaks Kafka's naming rules."""


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


class TransportError(OutboxError, ConnectionError):
    """The broker edge failed; raised only by transports."""


class RetriableTransportError(TransportError):
    """A broker operation that may succeed if tried again (broker down, timeout).

    Sends never raise: their permanent failures come back as ``Outcome.FAILED``.
    """



class CommitRefusedError(TransportError):
    """The broker refused an offset commit because the group is rebalancing or moved on.

    Nothing was committed: the positions stay where they were, and whoever owns
    the partition next replays from there (the inbox drops what it applied).
    """
