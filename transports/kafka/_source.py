"""``KafkaSource``: the inbox's ``Source`` on a confluent-kafka consumer.

Offsets are never committed behind the inbox's back: auto-commit and the
automatic offset store are off, and ``commit`` commits exactly the positions
it is given, synchronously. The rebalance callbacks are wired to
``on_revoke``, so the inbox can finish in-flight work and commit before the
partitions go. librdkafka errors are translated here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from transports._errors import (
    CommitRefusedError,
    ConfigurationError,
    RetriableTransportError,
    TransportError,
    validate_topic,
)
from transports._protocol import Record, RevokeCallback

from ._logging import ClientErrors, LibrdkafkaLog
from ._settings import check_with_librdkafka, librdkafka_config, redacted

log = logging.getLogger("transports.kafka")

# Owned by the inbox: a user value would break "commit only what is finished".
_FORCED = {"enable.auto.commit": False, "enable.auto.offset.store": False}
# A commit refused because the group moved on: nothing committed; the next owner replays.
_STALE_COMMIT = {
    KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError._NO_OFFSET, KafkaError._STATE,
}


class KafkaSource:
    """Delivers records of ``topics`` for consumer group ``group_id``.

    Takes kafka-python-ng style settings (``session_timeout_ms``,
    ``security_protocol``, ``sasl_plain_password`` …) or raw librdkafka keys;
    a bad one raises ``ConfigurationError`` here. ``auto_offset_reset``
    defaults to ``"earliest"``: a new group starts with the oldest record
    rather than silently skipping what was published before it joined.
    Not thread-safe: poll, commit and close from one thread (the inbox does).
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str | Sequence[str],
        group_id: str,
        topics: Sequence[str],
        settings: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(group_id, str) or not group_id:
            raise ConfigurationError(f"group_id must be a non-empty str, got {group_id!r}")
        if isinstance(topics, str) or not topics:
            raise ConfigurationError(f"topics must be a non-empty list of topic names, got {topics!r}")
        self.topics = [validate_topic(t) for t in topics]
        config = librdkafka_config(settings, bootstrap_servers=bootstrap_servers,
                                   group_id=group_id, **kwargs)
        for key, forced in _FORCED.items():
            if key in config and str(config[key]).lower() not in (str(forced).lower(), "0"):
                raise ConfigurationError(f"{key} must stay off: the inbox commits offsets itself, "
                                         "after its database transaction")
        config = {"auto.offset.reset": "earliest", **config, **_FORCED}
        check_with_librdkafka(config, "consumer")
        self.config = config
        self._revoke_callbacks: list[RevokeCallback] = []
        self._assignment: frozenset[tuple[str, int]] = frozenset()
        self._errors = ClientErrors("consumer")
        self._consumer = Consumer({**config, "logger": LibrdkafkaLog(), "error_cb": self._errors})
        self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._revoked)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to ``max_records`` records; rebalance callbacks run inside this call."""
        records = []
        for msg in self._consumer.consume(max(1, max_records), timeout):
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                if error.fatal():
                    raise TransportError(f"Kafka consumer failed: {error.str()}")
                self._errors(error)  # once per change, not once per poll; librdkafka retries
                continue
            timestamp_type, timestamp = msg.timestamp()
            # A consumed message always has a topic; value and header values are bytes
            # (None only for tombstones and null headers, which the inbox rejects itself).
            records.append(Record(
                topic=cast(str, msg.topic()), value=cast(bytes, msg.value()), key=msg.key(),
                headers=cast("list[tuple[str, bytes]]", list(msg.headers() or ())), partition=msg.partition(),
                offset=msg.offset(), timestamp_ms=timestamp if timestamp_type else None,
            ))
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Commit "everything before these offsets is done", synchronously.

        Raises ``CommitRefusedError`` when the group refused it (a rebalance
        moved on): nothing was committed, and the caller must not record it.
        """
        if not offsets:
            return
        positions = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        try:
            self._consumer.commit(offsets=positions, asynchronous=False)
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() in _STALE_COMMIT:
                raise CommitRefusedError(f"offset commit refused: {error.str()}") from None
            if error.retriable():
                raise RetriableTransportError(f"offset commit failed: {error.str()}") from None
            raise TransportError(f"offset commit failed: {error.str()}") from None

    def on_revoke(self, callback: RevokeCallback) -> None:
        self._revoke_callbacks.append(callback)

    def close(self) -> None:
        """Leave the group (partitions go to the others at once) and close."""
        self._consumer.close()

    def assigned(self) -> frozenset[tuple[str, int]]:
        """The (topic, partition) pairs this consumer holds now; safe to read from any thread."""
        return self._assignment  # replaced, never changed in place

    def _assigned(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        added = {(tp.topic, tp.partition) for tp in partitions}
        self._assignment = self._assignment | added
        self._errors.cleared()
        log.info("assigned %s", sorted(added))

    def _revoked(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = [(tp.topic, tp.partition) for tp in partitions]
        self._assignment = self._assignment - set(gone)
        for callback in self._revoke_callbacks:
            try:
                callback(gone)
            except Exception:  # librdkafka would swallow it; say so instead
                log.exception("revoke callback failed for %s", gone)

    def __repr__(self) -> str:
        return f"KafkaSource({redacted(self.config)!r})"
