"""``KafkaPythonTransport``: the ``Transport`` protocol over a kafka-python-ng ``KafkaProducer``.

For teams that already run a configured ``KafkaProducer`` (SASL, SSL, their own
serialisation of nothing: records are bytes here). The same per-key contract as
``transports.kafka.KafkaTransport`` holds, and it is kept the same way: records
go out in waves (the n-th record of a key only after records 1..n-1 of that key
were acknowledged), with the partition Kafka's Java client would choose for the
key. Unlike librdkafka, kafka-python-ng has no idempotent producer, so a broker
retry inside the client may duplicate a record; duplicates are allowed, and the
waves keep first occurrences in order.

Settings that could lose an acknowledged record are refused when the transport
is built: ``acks`` must be ``'all'`` (-1). With ``acks=1`` (kafka-python-ng's
default) the leader acknowledges before any replica has the record, so a leader
failure loses records the relay already marked published; with ``acks=0``
every record is "delivered" the moment it is queued, written or not. Client
``retries`` with ``max_in_flight_requests_per_connection`` > 1 may reorder
records of one partition, but never two records of one key here: a key's next
record is only sent after the previous one was acknowledged (the waves), so
those settings are left to the producer's owner.

The broker refuses a *request* (a partition's batch), not a record: a record
over the topic's ``max.message.bytes`` fails every record of the wave that
shared its request, other keys' too. When more than one record of a wave came
back with such a refusal (``REFUSED_WHOLE``), each is sent again alone, and
gets its own answer (``transports._refusals``): only the record at fault fails.

A record the broker answers NOT_LEADER or LEADER_NOT_AVAILABLE (a new topic's
first moments on Apache Kafka, a leader change) is sent again inside its wave
until ``delivery_timeout``: kafka-python-ng retries nothing by default, and one
record per key makes that safe.

A wave whose acknowledgements do not all arrive within ``delivery_timeout``
is not an error of the batch: its unacknowledged records come back as
``RETRY`` (the relay backs off and counts the attempt); records still queued
in the producer may reach the broker later, as duplicates.

Not safe to call ``publish`` from several threads at once.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import kafka.errors as kafka_errors
from kafka.protocol.metadata import MetadataRequest

from .._errors import ConfigurationError
from .._protocol import Outcome, Record, SendResult, TransportFeatures
from .._refusals import NOT_SENT_ALONE
from .._unknown_topics import PROPAGATION_SECONDS, UnknownTopics
from .._waves import NO_REPORT, key_partition, publish_in_waves
from ._logging import route_kafka_logs

PERMANENT_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.InvalidTopicError,
    kafka_errors.InvalidMessageError,
    kafka_errors.PolicyViolationError,
)

# Refusals the broker gives a whole request for what one record in it is (transports._refusals).
# UnknownError: kafka-python-ng 2.2 knows no INVALID_RECORD (87, a keyless record on a compacted
# topic) and reports it so; sent alone, the record at fault is the only one that gets it again.
REFUSED_WHOLE: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.UnknownError,
)

# Answers of a partition whose leader is moving (or, for a new topic, not yet in place): sent
# again inside the wave after LEADER_BACKOFF seconds, within delivery_timeout.
LEADER_MOVING: tuple[type[Exception], ...] = (
    kafka_errors.NotLeaderForPartitionError,
    kafka_errors.LeaderNotAvailableError,
)
LEADER_BACKOFF = 0.1  # kafka-python-ng's own retry_backoff_ms

# Topic errors in a metadata answer that no resend can fix.
PERMANENT_TOPIC_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.UnknownTopicOrPartitionError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
)

SAFE_ACKS = frozenset({"all", "-1"})

# kafka-python-ng refuses a record whose batch estimate (a 61-byte batch header, 21 bytes of
# the widest record overhead, then key, value and headers with their varint lengths) is over
# max_request_size. That estimate exceeds librdkafka's per-record count, by which records
# are measured (``max_record_bytes``), by at most 58 bytes; 61 keeps a margin.
BATCH_ESTIMATE_MARGIN = 61


# Errors meaning the broker did not answer at all (down, unreachable, frozen), or answered that
# the cluster cannot take writes now (too few in-sync replicas for acks=all): an outage, never the
# record's fault. (kafka-python-ng retries none of them by default: retries=0.)
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.NotEnoughReplicasError,
    kafka_errors.NotEnoughReplicasAfterAppendError,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.NoBrokersAvailable,
    kafka_errors.KafkaConnectionError,
    kafka_errors.RequestTimedOutError,
)


def classify(error: BaseException) -> Outcome:
    """FAILED for errors a resend cannot fix; RETRY for everything else (timeouts, broker down)."""
    return Outcome.FAILED if isinstance(error, PERMANENT_ERRORS) else Outcome.RETRY


def result_of(error: BaseException) -> SendResult:
    """The ``SendResult`` of a record that ``error`` kept from being delivered."""
    return SendResult(classify(error), error=repr(error),
                      unreachable=isinstance(error, UNREACHABLE_ERRORS))


class KafkaPythonTransport:
    """Publishes through an existing ``kafka.KafkaProducer``; the producer stays yours.

    ``delivery_timeout`` bounds the wait for acknowledgements of one wave;
    records without one come back as ``RETRY``. ``close`` flushes but does not
    close the producer, because the caller created it.

    Before sending to a topic the producer has no metadata for, the transport
    asks the broker about it (one Metadata request, bounded by the producer's
    ``max_block_ms`` and ``delivery_timeout``): kafka-python-ng itself only logs
    ``UnknownTopicOrPartition`` and waits ``max_block_ms`` for a topic that will
    never appear, which would retry the record forever. An unknown, invalid or
    unauthorised topic makes its records ``FAILED``. ``allow_auto_create_topics``
    is what that request asks for (the broker's own setting still applies); when it asks,
    "unknown" is believed only after up to 30 s of asking again, since Apache Kafka answers
    the request that starts a topic's creation that way (``transports._unknown_topics``).
    """

    features = TransportFeatures()
    """All of them: per-key order, offsets, records the broker keeps, oversized records refused."""

    def __init__(self, producer: Any, *, delivery_timeout: float = 30.0,
                 allow_auto_create_topics: bool = True) -> None:
        route_kafka_logs()
        if not all(hasattr(producer, name) for name in ("send", "flush", "partitions_for")):
            raise ConfigurationError(
                f"KafkaPythonTransport needs a kafka.KafkaProducer, got {type(producer).__name__}"
            )
        if not 0 < delivery_timeout < math.inf:
            raise ConfigurationError(
                f"delivery_timeout must be positive, finite seconds, got {delivery_timeout!r}")
        acks = getattr(producer, "config", {}).get("acks", "all")
        if str(acks) not in SAFE_ACKS:
            raise ConfigurationError(
                f"KafkaPythonTransport needs a KafkaProducer with acks='all', got acks={acks!r}: "
                "with acks=1 a leader failure loses records already acknowledged, and with "
                "acks=0 a record counts as delivered without being written"
            )
        self._producer = producer
        self._delivery_timeout = delivery_timeout
        self._auto_create = bool(allow_auto_create_topics)
        max_block = getattr(producer, "config", {}).get("max_block_ms", 60_000) / 1000
        self._probe_timeout = min(delivery_timeout, max_block)
        # An "unknown topic" is believed after this long (transports._unknown_topics), within
        # the probe's own bound so that the probe ends with the broker's answer.
        self._unknown = UnknownTopics(min(PROPAGATION_SECONDS, self._probe_timeout * 0.8))

    def __repr__(self) -> str:
        return f"KafkaPythonTransport({type(self._producer).__name__})"

    @property
    def max_record_bytes(self) -> int:
        """The largest record (librdkafka's count) the producer's ``max_request_size`` lets through."""
        return int(getattr(self._producer, "config", {}).get("max_request_size", 1_048_576)
                   ) - BATCH_ESTIMATE_MARGIN

    max_record_setting = f"max_request_size less {BATCH_ESTIMATE_MARGIN} bytes of batch overhead"

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        """Send ``records``; one result per record, in input order."""
        return publish_in_waves(records, partial(self._send_wave, records))

    def _send_wave(
        self, records: Sequence[Record], indexes: list[int], results: list[SendResult | None]
    ) -> None:
        counts: dict[str, int | SendResult] = {}  # with the broker down a lookup takes max_block_ms
        topic_errors: dict[str, SendResult | None] = {}  # per wave: one probe per new topic
        futures = []
        for i in indexes:
            record = records[i]
            if record.topic not in topic_errors:
                topic_errors[record.topic] = self._topic_error(record.topic)
            error = topic_errors[record.topic]
            if error is not None:
                results[i] = error
                continue
            try:
                partition = key_partition(record, counts, self._partition_count)
                if isinstance(partition, SendResult):
                    results[i] = partition
                    continue
                futures.append((i, partition, self._send(record, partition)))
            except kafka_errors.KafkaError as exc:
                results[i] = result_of(exc)
        futures = self._settle(records, futures, results)
        refused = [(i, partition) for i, partition, future in futures
                   if future.is_done and future.failed() and isinstance(future.exception, REFUSED_WHOLE)]
        if len(refused) > 1:  # one alone in its request: the refusal is its own
            self._send_alone(records, refused, results)

    def _settle(self, records: Sequence[Record], futures: list[tuple[int, int | None, Any]],
                results: list[SendResult | None]) -> list[tuple[int, int | None, Any]]:
        """Wait for the wave's answers; send again, within ``delivery_timeout``, what a moving
        leader refused (``LEADER_MOVING``); return the last send of each record.

        kafka-python-ng retries nothing by default (``retries=0``), and Apache Kafka answers a
        new topic's first records NOT_LEADER for a moment, as it does during a leader change.
        Inside a wave (one record per key) sending again cannot reorder a key.
        """
        deadline = time.monotonic() + self._delivery_timeout
        latest = {i: (partition, future) for i, partition, future in futures}
        waiting = futures
        while True:
            self._flush(max(0.0, deadline - time.monotonic()))
            moving = [(i, partition) for i, partition, future in waiting
                      if future.is_done and future.failed() and isinstance(future.exception, LEADER_MOVING)]
            if not moving or time.monotonic() + LEADER_BACKOFF >= deadline:
                break
            time.sleep(LEADER_BACKOFF)  # the client refreshes its metadata meanwhile
            waiting = []
            for i, partition in moving:
                try:
                    waiting.append((i, partition, self._send(records[i], partition)))
                except kafka_errors.KafkaError:
                    continue  # its first answer stands
                latest[i] = (partition, waiting[-1][2])
        for i, (_, future) in latest.items():
            results[i] = _outcome(future)
        return [(i, partition, future) for i, (partition, future) in latest.items()]

    def _send_alone(self, records: Sequence[Record], refused: list[tuple[int, int | None]],
                    results: list[SendResult | None]) -> None:
        """Send each record a request refused whole again in a request of its own (within one more
        ``delivery_timeout``): its answer is then its own. One not sent again in time is RETRY."""
        deadline = time.monotonic() + self._delivery_timeout
        for i, partition in refused:
            left = deadline - time.monotonic()
            if left <= 0:
                results[i] = SendResult(Outcome.RETRY, error=NOT_SENT_ALONE, unreachable=True)
                continue
            try:
                future = self._send(records[i], partition)
            except kafka_errors.KafkaError as exc:
                results[i] = result_of(exc)
                continue
            self._flush(left)
            results[i] = _outcome(future)

    def _send(self, record: Record, partition: int | None) -> Any:
        return self._producer.send(record.topic, value=record.value, key=record.key,
                                   headers=list(record.headers), partition=partition)

    def _flush(self, timeout: float) -> None:
        # A timeout is no error of the batch: records without an acknowledgement come back
        # as RETRY (``_outcome``).
        with contextlib.suppress(kafka_errors.KafkaTimeoutError):
            self._producer.flush(timeout)

    def _partition_count(self, topic: str) -> int | SendResult:
        try:
            partitions = self._producer.partitions_for(topic)
        except kafka_errors.KafkaError as exc:
            return result_of(exc)
        if not partitions:
            # The broker answered, for a topic it has no partitions of yet: the topic's, counted.
            return SendResult(Outcome.RETRY, error=f"no partitions known for topic {topic!r}",
                              unreachable=False)
        return len(partitions)

    def _topic_error(self, topic: str) -> SendResult | None:
        """A result for every record of ``topic`` if the broker rejects or does not answer; else None."""
        cluster = getattr(self._producer, "_metadata", None)
        client = getattr(getattr(self._producer, "_sender", None), "_client", None)
        if cluster is None or client is None or cluster.partitions_for_topic(topic) is not None:
            return None  # known topic (the common case), or not a producer we can ask through
        deadline = time.monotonic() + self._probe_timeout
        while True:
            node = client.least_loaded_node()
            answered = threading.Event()
            future = (client.send(node, MetadataRequest[4]([topic], self._auto_create))
                      if node is not None else None)
            if future is not None:
                future.add_both(lambda *_, event=answered: event.set())
                client.wakeup()
                answered.wait(max(0.0, deadline - time.monotonic()))
                if future.succeeded():
                    error = _refusal(topic, future.value.topics)
                    if error is None:
                        self._unknown.known(topic)
                        return None  # known, or being created: partitions_for waits for it
                    # "Unknown" may mean "being created" by this very request (auto-creation
                    # asked; transports._unknown_topics): ask again for a while.
                    unknown = issubclass(error, kafka_errors.UnknownTopicOrPartitionError)
                    left = self._unknown.wait_left(topic) if unknown and self._auto_create else 0.0
                    if left <= 0:
                        return SendResult(Outcome.FAILED, error=f"{error.__name__}: topic {topic!r}")
                    time.sleep(min(0.1, left))
                    continue
            if time.monotonic() >= deadline:
                return SendResult(Outcome.RETRY, unreachable=True, error=(
                    f"no metadata answer for topic {topic!r} in {self._probe_timeout:g} s"))
            time.sleep(0.05)  # no connection ready yet (the client is connecting)

    def close(self, timeout: float = 10.0) -> None:
        self._producer.flush(timeout)


def _refusal(topic: str, answered: Any) -> type[Exception] | None:
    """The error a Metadata answer gives ``topic`` that no send can overcome, if any."""
    for error_code, name, *_ in answered:
        error: type[Exception] = kafka_errors.for_code(error_code)
        if name == topic and issubclass(error, PERMANENT_TOPIC_ERRORS):
            return error
    return None


def _outcome(future: Any) -> SendResult:
    if not future.is_done:
        return SendResult(Outcome.RETRY, error=NO_REPORT, unreachable=True)
    if future.failed():
        return result_of(future.exception)
    metadata = future.value
    return SendResult(Outcome.DELIVERED, metadata.partition, metadata.offset)
