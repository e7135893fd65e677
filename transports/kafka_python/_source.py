"""``KafkaPythonSource``: the inbox's ``Source`` on a kafka-python-ng ``KafkaConsumer``.

For services that already run kafka-python-ng and do not want librdkafka.
The same contract as ``transports.kafka.KafkaSource``: auto-commit off,
``commit`` commits exactly the positions given, revocations reach
``on_revoke`` before the partitions go (kafka-python-ng calls its rebalance
listener from inside ``poll``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, OffsetAndMetadata, TopicPartition
from kafka.errors import CommitFailedError, KafkaError

from .._errors import (
    CommitRefusedError,
    ConfigurationError,
    RetriableTransportError,
    TransportError,
    validate_topic,
)
from .._logsafe import safe_logger
from .._protocol import Record, RevokeCallback, SourceFeatures
from ._logging import route_kafka_logs

log = safe_logger("transports.kafka_python")


class KafkaPythonSource:
    """Delivers records of ``topics`` for ``group_id`` through kafka-python-ng.

    Keyword arguments are ``KafkaConsumer``'s own (``security_protocol``,
    ``sasl_plain_password`` …). ``enable_auto_commit`` must stay off.
    Not thread-safe: poll, commit and close from one thread.
    """

    features = SourceFeatures()
    """Both: Kafka offsets and committed positions that outlive the consumer."""

    def __init__(self, *, bootstrap_servers: str | Sequence[str], group_id: str,
                 topics: Sequence[str], **settings: Any) -> None:
        if not isinstance(group_id, str) or not group_id:
            raise ConfigurationError(f"group_id must be a non-empty str, got {group_id!r}")
        if isinstance(topics, str) or not topics:
            raise ConfigurationError(f"topics must be a non-empty list of topic names, got {topics!r}")
        if settings.get("enable_auto_commit"):
            raise ConfigurationError("enable_auto_commit must stay off: the inbox commits offsets "
                                     "itself, after its database transaction")
        self.topics = [validate_topic(t) for t in topics]
        options = {"auto_offset_reset": "earliest", **settings, "enable_auto_commit": False}
        route_kafka_logs()
        try:
            self._consumer = KafkaConsumer(bootstrap_servers=bootstrap_servers, group_id=group_id,
                                           **options)
        except (TypeError, AssertionError, KafkaError) as exc:
            raise ConfigurationError(f"invalid kafka-python-ng setting: {exc}") from None
        self._revoke_callbacks: list[RevokeCallback] = []
        self._assignment: frozenset[tuple[str, int]] = frozenset()
        self._consumer.subscribe(self.topics, listener=_Listener(self._revoked, self._assigned))

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=max(1, max_records))
        records = []
        for messages in batches.values():
            for m in messages:
                records.append(Record(
                    topic=m.topic, value=m.value, key=m.key, headers=list(m.headers or ()),
                    partition=m.partition, offset=m.offset, timestamp_ms=m.timestamp,
                ))
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        if not offsets:
            return
        try:
            self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, None)
                                   for (t, p), o in offsets.items()})
        except CommitFailedError as exc:
            raise CommitRefusedError(f"offset commit refused: {exc}") from None
        except KafkaError as exc:
            if getattr(exc, "retriable", False):
                raise RetriableTransportError(f"offset commit failed: {exc}") from None
            raise TransportError(f"offset commit failed: {exc}") from None

    def on_revoke(self, callback: RevokeCallback) -> None:
        self._revoke_callbacks.append(callback)

    def close(self) -> None:
        self._consumer.close(autocommit=False)

    def assigned(self) -> frozenset[tuple[str, int]]:
        """The (topic, partition) pairs this consumer holds now; safe to read from any thread."""
        return self._assignment  # replaced, never changed in place

    def _assigned(self, partitions: Sequence[Any]) -> None:
        self._assignment = self._assignment | {(tp.topic, tp.partition) for tp in partitions}

    def _revoked(self, partitions: Sequence[Any]) -> None:
        gone = [(tp.topic, tp.partition) for tp in partitions]
        self._assignment = self._assignment - set(gone)
        for callback in self._revoke_callbacks:
            try:
                callback(gone)
            except Exception:
                log.exception("revoke callback failed for %s", gone)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, revoked: Any, assigned: Any) -> None:
        self._revoked = revoked
        self._assigned = assigned

    def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            self._revoked(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._assigned(assigned)
