"""An in-memory broker with a ``Transport`` and a ``Source`` on it, for a service's unit tests.

The model is Kafka's, kept to what the outbox's contracts rely on, so code
tested against it meets no surprise on a real broker:

- a topic has N partitions (``InMemoryBroker(partitions=...)``, or
  ``create_topic``), each an ordered log whose offsets count from 0; a topic
  is created on first use, as a broker with auto-create does;
- a keyed record goes to Kafka's Java default partition of its key
  (``partition_for_key``), an unkeyed one round-robin;
- a consumer group has committed offsets, one per partition, and members: each
  partition is held by at most one member of a group at a time, handed to
  another only after its holder gave it up (its revoke callbacks ran first);
- a source reads from its group's committed offset (the earliest record for a
  new group) and commits exactly what it is told: only committed positions
  survive a restart, the rest is delivered again.

``InMemoryTransport`` keeps the ``Transport`` contract (checked by
``transports.testing.TransportConformance``) and can be told to fail
(``fail``, ``down``) so a test can see what a service does on retries and
outages. ``InMemorySource`` keeps the ``Source`` contract (checked by
``transports.testing.SourceConformance``, which the Kafka source passes too).
All three are thread-safe: an ``Inbox.run`` thread may consume while the test
publishes.

What this cannot show is a real broker's behaviour: timeouts, rebalances
under load, client settings, network faults. The project's own integration
tests keep using real servers for those.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ._errors import CommitRefusedError, ConfigurationError, InvalidTopicError, validate_topic
from ._logsafe import safe_logger
from ._partitioner import partition_for_key
from ._protocol import Outcome, Record, RevokeCallback, SendResult, SourceFeatures, TransportFeatures
from ._waves import NOT_SENT

log = safe_logger("transports.memory")

DEFAULT_PARTITIONS = 3
DEFAULT_MAX_RECORD_BYTES = 1_000_000
"""librdkafka's default ``message.max.bytes``: what a real producer refuses, this refuses too."""
_RECORD_OVERHEAD = 36  # librdkafka's per-record overhead in its size check

TopicPartition = tuple[str, int]


def record_size(record: Record) -> int:
    """The size librdkafka checks against ``message.max.bytes``: key, value, headers with lengths."""

    def varint(length: int) -> int:
        return ((length << 1).bit_length() + 6) // 7 or 1

    size = _RECORD_OVERHEAD + len(record.value) + (len(record.key) if record.key is not None else 0)
    for name, value in record.headers:
        n, v = len(name.encode()), len(value) if value is not None else 0
        size += n + v + varint(n) + varint(v)
    return size


@dataclass(slots=True)
class _Member:
    source: InMemorySource
    topics: frozenset[str]


class InMemoryBroker:
    """Topics of ordered partition logs and consumer groups' committed offsets, in this process.

    ``partitions`` is the count a topic gets when it is created on first use;
    ``max_record_bytes`` the largest record accepted (a larger one is
    ``FAILED``, as ``message.max.bytes`` makes it on Kafka).
    """

    def __init__(self, *, partitions: int = DEFAULT_PARTITIONS,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        _positive("partitions", partitions)
        _positive("max_record_bytes", max_record_bytes)
        self.default_partitions = partitions
        self.max_record_bytes = max_record_bytes
        self._logs: dict[str, list[list[Record]]] = {}
        self._appended: dict[str, list[Record]] = {}
        self._committed: dict[tuple[str, TopicPartition], int] = {}
        self._members: dict[str, list[_Member]] = {}
        self._holders: dict[tuple[str, TopicPartition], InMemorySource] = {}
        self._round_robin = itertools.count()
        self._changed = threading.Condition()

    # -- topics and records -------------------------------------------------------

    def create_topic(self, topic: str, partitions: int | None = None) -> None:
        """Create ``topic`` with ``partitions`` (default: the broker's); an existing one must agree."""
        validate_topic(topic)
        count = self.default_partitions if partitions is None else partitions
        _positive("partitions", count)
        with self._changed:
            existing = self._logs.get(topic)
            if existing is not None and len(existing) != count:
                raise ConfigurationError(f"topic {topic!r} exists with {len(existing)} partitions, "
                                         f"not {count}")
            self._topic(topic, count)

    def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (it is created if new)."""
        with self._changed:
            return len(self._topic(topic))

    def topics(self) -> list[str]:
        with self._changed:
            return sorted(self._logs)

    def records(self, topic: str) -> list[Record]:
        """Every record written to ``topic``, in the order they were written (all partitions)."""
        with self._changed:
            return [replace(r, headers=list(r.headers)) for r in self._appended.get(topic, ())]

    def partition_log(self, topic: str, partition: int) -> list[Record]:
        """The records of one partition, in offset order."""
        with self._changed:
            return [replace(r, headers=list(r.headers)) for r in self._topic(topic)[partition]]

    def append(self, record: Record) -> Record:
        """Write one record: to ``record.partition`` if set, else by key; returns it as stored.

        Raises ``InvalidTopicError``, ``ValueError`` (no such partition, too large).
        """
        validate_topic(record.topic)
        size = record_size(record)
        if size > self.max_record_bytes:
            raise ValueError(f"record of {size} bytes is larger than max_record_bytes="
                             f"{self.max_record_bytes}")
        with self._changed:
            log = self._topic(record.topic)
            if record.partition is not None:
                if not 0 <= record.partition < len(log):
                    raise ValueError(f"topic {record.topic!r} has no partition {record.partition} "
                                     f"(it has {len(log)})")
                partition = record.partition
            elif record.key is not None:
                partition = partition_for_key(record.key, len(log))
            else:
                partition = next(self._round_robin) % len(log)
            stored = Record(topic=record.topic, value=bytes(record.value), key=record.key,
                            headers=list(record.headers), partition=partition,
                            offset=len(log[partition]),
                            timestamp_ms=record.timestamp_ms or int(time.time() * 1000))
            log[partition].append(stored)
            self._appended.setdefault(record.topic, []).append(stored)
            self._changed.notify_all()
            return replace(stored, headers=list(stored.headers))

    def _topic(self, topic: str, partitions: int | None = None) -> list[list[Record]]:
        log = self._logs.get(topic)
        if log is None:
            validate_topic(topic)
            log = self._logs[topic] = [[] for _ in range(partitions or self.default_partitions)]
        return log

    # -- consumer groups ----------------------------------------------------------

    def committed(self, group: str, topic: str, partition: int) -> int | None:
        """The group's committed offset of a partition (the next record to read), or None."""
        with self._changed:
            return self._committed.get((group, (topic, partition)))

    def _join(self, group: str, source: InMemorySource, topics: Sequence[str]) -> None:
        with self._changed:
            self._members.setdefault(group, []).append(_Member(source, frozenset(topics)))
            for topic in topics:
                self._topic(topic)
            self._changed.notify_all()

    def _leave(self, group: str, source: InMemorySource) -> None:
        with self._changed:
            self._members[group] = [m for m in self._members.get(group, []) if m.source is not source]
            for place, holder in list(self._holders.items()):
                if holder is source:
                    del self._holders[place]
            self._changed.notify_all()

    def _target(self, group: str, source: InMemorySource) -> set[TopicPartition]:
        """The partitions ``source`` should hold: each subscribed partition to one member, in turn."""
        members = self._members.get(group, [])
        target: set[TopicPartition] = set()
        for topic in sorted({t for m in members for t in m.topics}):
            subscribed = [m for m in members if topic in m.topics]
            for partition in range(len(self._topic(topic))):
                if subscribed[partition % len(subscribed)].source is source:
                    target.add((topic, partition))
        return target

    def _release(self, group: str, source: InMemorySource, places: set[TopicPartition]) -> None:
        with self._changed:
            for place in places:
                if self._holders.get((group, place)) is source:
                    del self._holders[(group, place)]
            self._changed.notify_all()

    def _acquire(self, group: str, source: InMemorySource,
                 places: set[TopicPartition]) -> dict[TopicPartition, int]:
        """Take the free partitions of ``places``; returns each one's position to read from."""
        taken = {}
        with self._changed:
            for place in sorted(places):
                if (group, place) not in self._holders:
                    self._holders[(group, place)] = source
                    taken[place] = self._committed.get((group, place), 0)
        return taken

    def _commit(self, group: str, source: InMemorySource, offsets: Mapping[TopicPartition, int]) -> None:
        with self._changed:
            foreign = sorted(p for p in offsets if self._holders.get((group, p)) is not source)
            if foreign:
                raise CommitRefusedError(f"offset commit refused: {foreign} not held by this member "
                                         f"of group {group!r} (the group moved on)")
            for place, offset in offsets.items():
                end = len(self._topic(place[0])[place[1]])
                if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= end:
                    raise ValueError(f"offset {offset!r} for {place} is outside 0..{end}")
            for place, offset in offsets.items():
                self._committed[(group, place)] = offset

    def _read(self, place: TopicPartition, position: int, limit: int) -> list[Record]:
        log = self._topic(place[0])[place[1]]
        return [replace(r, headers=list(r.headers)) for r in log[position:position + limit]]

    def __repr__(self) -> str:
        return f"InMemoryBroker(topics={self.topics()!r})"


@dataclass(slots=True)
class _Fault:
    topic: str | None
    key: bytes | None
    times: int
    outcome: Outcome
    error: str
    unreachable: bool

    def matches(self, record: Record) -> bool:
        return ((self.topic is None or record.topic == self.topic)
                and (self.key is None or record.key == self.key))


class InMemoryTransport:
    """The ``Transport`` contract on an ``InMemoryBroker``, with faults a test can inject.

    ``fail(...)`` makes the next records that match fail once each (``times``
    of them); ``down = True`` answers every record ``RETRY`` without reaching
    the broker, as an outage does. A record not delivered stops the later
    records of its key in the same batch (they come back ``RETRY``), exactly
    as the Kafka transports do.
    """

    features = TransportFeatures()
    """All of them, as the Kafka transports: the broker keeps what was delivered as long as it lives."""

    max_record_setting = "InMemoryBroker(max_record_bytes=...)"

    def __init__(self, broker: InMemoryBroker | None = None) -> None:
        self.broker = broker if broker is not None else InMemoryBroker()
        self.down = False
        self.closed = False
        self.injected = 0
        """How many records an injected failure or outage answered (a test can check it struck)."""
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()

    @property
    def max_record_bytes(self) -> int:
        return self.broker.max_record_bytes

    def fail(self, *, topic: str | None = None, key: bytes | str | None = None, times: int = 1,
             outcome: Outcome = Outcome.RETRY, error: str = "injected failure",
             unreachable: bool = False) -> None:
        """Fail the next ``times`` records of ``topic`` and ``key`` (None: any) with ``outcome``.

        ``RETRY`` is what a relay retries later; ``FAILED`` is final (the
        relay stops the key); ``unreachable`` marks a ``RETRY`` as "the broker
        did not answer" (an outage, which costs no attempt).
        """
        _positive("times", times)
        if not isinstance(outcome, Outcome) or outcome is Outcome.DELIVERED:
            raise ConfigurationError(f"outcome must be Outcome.RETRY or Outcome.FAILED, got {outcome!r}")
        if unreachable and outcome is not Outcome.RETRY:
            raise ConfigurationError("only a RETRY can be unreachable")
        raw = key.encode() if isinstance(key, str) else key
        with self._lock:
            self._faults.append(_Fault(topic, raw, times, outcome, error, unreachable))

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        if self.closed:
            raise RuntimeError("publish() on a closed InMemoryTransport")
        results: list[SendResult] = []
        stopped: dict[tuple[str, bytes], bool] = {}  # key -> its stop was unreachable
        with self._lock:
            for record in records:
                place = (record.topic, record.key) if record.key is not None else None
                if place is not None and place in stopped:
                    results.append(SendResult(Outcome.RETRY, error=NOT_SENT, unreachable=stopped[place]))
                    continue
                result = self._send(record)
                if result.outcome is not Outcome.DELIVERED and place is not None:
                    stopped[place] = result.unreachable
                results.append(result)
        return results

    def _send(self, record: Record) -> SendResult:
        if self.down:
            self.injected += 1
            return SendResult(Outcome.RETRY, error="injected outage: the broker is down", unreachable=True)
        for fault in self._faults:
            if fault.matches(record):
                self.injected += 1
                fault.times -= 1
                if fault.times == 0:
                    self._faults.remove(fault)
                return SendResult(fault.outcome, error=fault.error, unreachable=fault.unreachable)
        try:
            stored = self.broker.append(replace(record, partition=None, offset=None))
        except (InvalidTopicError, ValueError) as exc:
            return SendResult(Outcome.FAILED, error=str(exc))
        return SendResult(Outcome.DELIVERED, partition=stored.partition, offset=stored.offset)

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"InMemoryTransport({self.broker!r})"


class InMemorySource:
    """The ``Source`` contract on an ``InMemoryBroker``, for consumer group ``group_id``.

    Joins the group when built; each ``poll`` first gives up partitions that
    now belong to another member (revoke callbacks first, so the inbox commits
    what it finished) and takes free ones, reading each from the group's
    committed offset. ``commit`` stores exactly the positions given, and
    raises ``CommitRefusedError`` for a partition this source no longer holds
    (nothing is stored, as on Kafka). ``close`` revokes and leaves.
    """

    features = SourceFeatures()
    """Both, as the Kafka sources: offsets, and committed positions the broker keeps while it lives."""

    def __init__(self, broker: InMemoryBroker, *, group_id: str, topics: Sequence[str]) -> None:
        if not isinstance(group_id, str) or not group_id:
            raise ConfigurationError(f"group_id must be a non-empty str, got {group_id!r}")
        if isinstance(topics, str) or not topics:
            raise ConfigurationError(f"topics must be a non-empty list of topic names, got {topics!r}")
        self.broker = broker
        self.group_id = group_id
        self.topics = [validate_topic(t) for t in topics]
        self._positions: dict[TopicPartition, int] = {}
        self._assignment: frozenset[TopicPartition] = frozenset()
        self._revoke_callbacks: list[RevokeCallback] = []
        self._closed = False
        broker._join(group_id, self, self.topics)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        """Up to ``max_records`` records, waiting up to ``timeout`` seconds for the first."""
        if self._closed:
            raise RuntimeError("poll() on a closed InMemorySource")
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            self._rebalance()
            records = self._take(max(1, max_records))
            left = deadline - time.monotonic()
            if records or left <= 0:
                return records
            with self.broker._changed:
                self.broker._changed.wait(min(left, 0.05))

    def _rebalance(self) -> None:
        broker = self.broker
        with broker._changed:
            target = broker._target(self.group_id, self)
        gone = self._assignment - target
        if gone:
            self._revoked(sorted(gone))
            broker._release(self.group_id, self, set(gone))
            self._assignment -= gone
            for place in gone:
                self._positions.pop(place, None)
        wanted = target - self._assignment
        if wanted:
            taken = broker._acquire(self.group_id, self, set(wanted))
            self._positions.update(taken)
            self._assignment = self._assignment | frozenset(taken)

    def _take(self, limit: int) -> list[Record]:
        records: list[Record] = []
        with self.broker._changed:
            for place in sorted(self._assignment):
                if len(records) >= limit:
                    break
                batch = self.broker._read(place, self._positions[place], limit - len(records))
                self._positions[place] += len(batch)
                records.extend(batch)
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Commit "everything before these offsets is done" for this group."""
        if offsets:
            self.broker._commit(self.group_id, self, offsets)

    def on_revoke(self, callback: RevokeCallback) -> None:
        self._revoke_callbacks.append(callback)

    def assigned(self) -> frozenset[TopicPartition]:
        """The (topic, partition) pairs this source holds now."""
        return self._assignment

    def _revoked(self, gone: list[TopicPartition]) -> None:
        for callback in self._revoke_callbacks:
            try:
                callback(gone)
            except Exception:  # as KafkaSource: logged, and the partitions go all the same
                log.exception("revoke callback failed for %s", gone)

    def close(self) -> None:
        """Give up every partition (revoke callbacks first) and leave the group; idempotent."""
        if self._closed:
            return
        if self._assignment:
            self._revoked(sorted(self._assignment))
        self._closed = True
        self._assignment = frozenset()
        self.broker._leave(self.group_id, self)

    def __repr__(self) -> str:
        return f"InMemorySource(group_id={self.group_id!r}, topics={self.topics!r})"


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
