"""Errors raised at the broker edge, and the root they share with the framework.

They live at the lowest layer that raises them, so a transport needs nothing
from ``outbox``; ``outbox`` re-exports every one (``outbox.TransportError`` is
this class), so callers catch them by the framework's names.
"""

from __future__ import annotations

import re


class OutboxError(Exception):
    """Root of every error this library raises."""


class ConfigurationError(OutboxError, ValueError):
    """A setting is invalid; raised when the object is built, not on first use."""


class UnsupportedBrokerError(ConfigurationError):
    """The broker cannot do what the setting asks, whoever asks it: librdkafka's mock cluster for
    exactly once. A tenant fleet stops on it (every tenant shares the broker) instead of trying each
    tenant again for good."""


class MessageValidationError(OutboxError, ValueError):
    """A message handed to ``publish()`` is invalid; nothing was written."""


class InvalidTopicError(MessageValidationError):
    """The topic name breaks Kafka's naming rules."""


class TransportError(OutboxError, ConnectionError):
    """The broker edge failed; raised only by transports."""


class RetriableTransportError(TransportError):
    """A broker operation that may succeed if tried again (broker down, timeout).

    Sends never raise: their permanent failures come back as ``Outcome.FAILED``.
    """


class TopicNotFoundError(RetriableTransportError):
    """A topic the broker answers it does not have (deleted, or not made yet): retriable, and a hint
    for whoever made it (an exactly-once relay makes its progress topic again, ``_exactly_once``)."""


class HeldByOpenTransactionError(RetriableTransportError):
    """A partition does not read past a record yet, held by a transaction open there (retriable).

    A partition's last stable offset (what read_committed readers reach) is the first offset of the
    oldest transaction open on it, whoever's: another producer's long transaction holds it, or one of
    this transactional id's own whose marker the broker dropped. Without DescribeProducers the two
    cannot be told apart, so nothing is committed there until it reads past; the message names the
    partitions, their last stable offsets and the offsets they must pass. It is no broker outage:
    the broker answers, and the transaction ends when its producer ends it, or at its timeout.

    ``answered``: every request of the wait was answered (False: a read held until its deadline,
    which a broker gone meanwhile would leave so too).
    """

    def __init__(self, message: str, *, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


class CommitUnansweredError(RetriableTransportError):
    """An offset commit got no answer in time (or an earlier one still waits for its answer).

    Either the group's coordinator is out of reach (an outage), or librdkafka holds
    the commit behind a rebalance that waits for this consumer's own next poll to
    serve its revoke: the commit blocks that poll, so nothing moves until the wait
    gives up. Only what the next poll does tells the two apart (``outbox.inbox``'s
    runner: a revocation served there was what the commit waited for).
    """


class CommitRefusedError(TransportError):
    """The broker refused an offset commit because the group is rebalancing or moved on.

    Nothing was committed: the positions stay where they were, and whoever owns
    the partition next replays from there (the inbox drops what it applied).
    """


class CommitUnconfirmedError(TransportError):
    """An offset commit was sent, but where it was made its answer cannot be awaited.

    Neither a success nor a failure: the Kafka source raises it for the commit
    inside a revoke callback under KIP-848's group protocol, which librdkafka
    answers only after the callback returned (``KafkaSource.commit``). The caller
    records nothing as committed and takes it for no answer from the broker, so an
    outage under way goes on being one. It is a ``TransportError`` so that code
    which knows only the base treats it as "not committed", the safe reading.
    """


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to about ``limit`` characters: an error message never echoes a huge value."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit + 2 else f"{text[:limit]}..."


# Kafka's own rule (kafka.common.internals.Topic): legal characters, 249 at most.
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def validate_topic(topic: object) -> str:
    """Return ``topic`` if Kafka accepts it as a topic name, else raise ``InvalidTopicError``."""
    if not isinstance(topic, str):
        raise InvalidTopicError(f"topic must be a str, got {type(topic).__name__}: {shown(topic)}")
    if not _TOPIC.fullmatch(topic) or topic in {".", ".."}:
        raise InvalidTopicError(
            f"invalid topic {shown(topic)} ({len(topic)} characters): Kafka topics are 1-249 characters of "
            "letters, digits, '.', '_' and '-', and not '.' or '..'"
        )
    return topic
