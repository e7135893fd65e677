"""``KafkaTransport``: the relay's broker edge on confluent-kafka (librdkafka).

The per-key contract of ``transports.Transport`` is kept by sending each batch
in waves (``transports._waves``), not left to librdkafka's retry behaviour: a
record of a key is never written while an earlier record of that key is
unacknowledged.

Keyed records go to the partition Kafka's Java client would choose
(``partition_for_key``: murmur2 of the key modulo the partition count), so JVM
producers and consumers agree; partition counts come from topic metadata and are
refreshed every ``metadata_refresh`` seconds. Unkeyed records let librdkafka
spread them. The producer is idempotent (``enable.idempotence``, ``acks=all``).

Not safe to call ``publish`` from several threads at once; one relay thread
owns a transport.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from transports._errors import ConfigurationError

from .._protocol import Outcome, Record, SendResult
from .._waves import key_partition, publish_in_waves
from ._logging import LibrdkafkaLog
from ._settings import check_with_librdkafka, librdkafka_config, redacted

# Errors that cannot succeed by sending the same record again.
PERMANENT_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.INVALID_RECORD,
    KafkaError._BAD_MSG,
    KafkaError.POLICY_VIOLATION,
    KafkaError._INVALID_ARG,
})

# Errors meaning the broker did not answer at all (frozen, down, unreachable).
UNREACHABLE_ERRORS = frozenset({
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._RESOLVE,
})

DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "compression.type": "lz4",
}


def classify(error: KafkaError) -> Outcome:
    """Map a librdkafka error to RETRY (may pass later) or FAILED (never will)."""
    if error.code() in PERMANENT_ERRORS:
        return Outcome.FAILED
    return Outcome.RETRY


def result_of(error: KafkaError) -> SendResult:
    """The ``SendResult`` of a record that ``error`` kept from being delivered."""
    return SendResult(classify(error), error=error.str(), unreachable=error.code() in UNREACHABLE_ERRORS)


class KafkaTransport:
    """Publishes outbox batches to Kafka with per-key order and per-record results.

    ``settings`` and keyword arguments take kafka-python-ng names
    (``bootstrap_servers``, ``linger_ms``, ``sasl_plain_password`` …) or raw
    librdkafka keys (``"linger.ms"``); unknown or invalid ones raise
    ``ConfigurationError`` here. ``delivery_timeout`` bounds how long one
    ``publish`` waits for delivery reports (librdkafka's ``message.timeout.ms``
    is set just below it, so every record gets a report); records still without
    one come back as ``RETRY``.
    """

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        /,
        *,
        delivery_timeout: float = 30.0,
        metadata_refresh: float = 30.0,
        **kwargs: Any,
    ) -> None:
        config = {**DEFAULTS, **librdkafka_config(settings, **kwargs)}
        if not config.get("bootstrap.servers"):
            raise ConfigurationError("KafkaTransport needs bootstrap_servers")
        if str(config.get("enable.idempotence")).lower() not in {"true", "1"}:
            raise ConfigurationError(
                "KafkaTransport keeps per-key order across retries only with enable.idempotence=True"
            )
        if not delivery_timeout > 0 or not metadata_refresh > 0:
            raise ConfigurationError("delivery_timeout and metadata_refresh must be positive seconds")
        config.setdefault("message.timeout.ms", max(1, int(delivery_timeout * 1000) - 500))
        check_with_librdkafka(config)
        self._config = config
        self._delivery_timeout = delivery_timeout
        self._metadata_refresh = metadata_refresh
        self._partitions: dict[str, tuple[float, int]] = {}
        self._log = LibrdkafkaLog()
        self._producer = self._new_producer()
        self._fatal: KafkaError | None = None

    def __repr__(self) -> str:
        return f"KafkaTransport({redacted(self._config)!r})"

    # -- publishing ---------------------------------------------------------

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        """Send ``records``; one result per record, in input order (see module doc)."""
        if self._fatal is not None:
            self._rebuild()
        return publish_in_waves(records, partial(self._send_wave, records))

    def _send_wave(
        self, records: Sequence[Record], indexes: list[int], results: list[SendResult | None]
    ) -> None:
        """Produce every record of one wave, then wait (bounded) for all delivery reports."""
        produce = self._producer.produce
        report = self._report
        counts: dict[str, int | SendResult] = {}  # per wave: metadata looked up once per topic
        lookup = self._partition_count
        outstanding = 0
        for i in indexes:
            record = records[i]
            partition = key_partition(record, counts, lookup)
            if isinstance(partition, SendResult):
                results[i] = partition
                continue
            if partition is None:
                partition = -1  # librdkafka's "unassigned": it spreads unkeyed records
            callback = partial(report, results, i)
            headers: Any = record.headers  # librdkafka's stubs want a list of str | bytes | None
            try:
                try:
                    produce(record.topic, record.value, record.key, partition, on_delivery=callback,
                            headers=headers)
                except BufferError:
                    # Local queue full: let earlier records drain, then try once more.
                    self._producer.poll(0.5)
                    produce(record.topic, record.value, record.key, partition, on_delivery=callback,
                            headers=headers)
                outstanding += 1
            except BufferError:
                results[i] = SendResult(Outcome.RETRY, error="producer queue full")
            except KafkaException as exc:
                results[i] = result_of(exc.args[0])
        if outstanding:
            self._producer.flush(self._delivery_timeout)

    @staticmethod
    def _report(results: list[SendResult | None], index: int, error: KafkaError | None,
                message: Any) -> None:
        if error is None:
            results[index] = SendResult(Outcome.DELIVERED, message.partition(), message.offset())
        else:
            results[index] = result_of(error)

    # -- partitions ---------------------------------------------------------

    def _partition_count(self, topic: str) -> int | SendResult:
        """The topic's partition count (cached for ``metadata_refresh`` s), or the error as a result."""
        count = self._lookup_partitions(topic)
        return result_of(count) if isinstance(count, KafkaError) else count

    def _lookup_partitions(self, topic: str) -> int | KafkaError:
        """Partition counts are cached for ``metadata_refresh`` s; errors never are."""
        now = time.monotonic()
        cached = self._partitions.get(topic)
        if cached is not None and now - cached[0] < self._metadata_refresh:
            return cached[1]
        try:
            metadata = self._producer.list_topics(topic, timeout=min(10.0, self._delivery_timeout))
        except KafkaException as exc:
            return exc.args[0]  # broker unreachable: not cached, asked again next time
        info = metadata.topics.get(topic)
        if info is None:
            return KafkaError(KafkaError._UNKNOWN_TOPIC, f"no metadata for topic {topic!r}")
        if info.error is not None:
            # Not cached, not even an unknown topic: the operator may create it and run
            # `outbox failed retry` at once, and a cached error would fail the row again
            # (with a second alert). The per-wave cache still asks once per wave.
            self._partitions.pop(topic, None)
            return info.error
        if not info.partitions:
            return KafkaError(KafkaError.LEADER_NOT_AVAILABLE, f"topic {topic!r} has no partitions yet")
        self._partitions[topic] = (now, len(info.partitions))
        return len(info.partitions)

    # -- lifecycle ----------------------------------------------------------

    def _on_error(self, error: KafkaError) -> None:
        # Fatal errors (e.g. the idempotent producer fenced) make the instance unusable.
        if error.fatal():
            self._fatal = error

    def _rebuild(self) -> None:
        self._producer.flush(0)
        self._producer = self._new_producer()
        self._fatal = None

    def _new_producer(self) -> Producer:
        """librdkafka's log lines go to Python logging (``_logging``), not raw to stderr."""
        return Producer({**self._config, "error_cb": self._on_error, "logger": self._log})

    def close(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` seconds for queued records, then drop the producer."""
        self._producer.flush(timeout)

