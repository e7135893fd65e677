"""The read-back side of Kafka transactions: a compacted topic made if missing (and refused if
found not compacted), and the last committed record of a key in a partition.

``last_committed`` reads the last committed record of a key in a partition of
a (compacted) topic: up to the partition's end as written when it is called
(read uncommitted, so an open transaction of another producer cannot hide a
record behind it: the read waits for it to end), backwards in growing windows
with a read_committed consumer, until a record of the key turns up or the
partition's start is reached. The relay gives each shard a partition of its own,
so the only open transaction there is the earlier owner's, which making the
new producer of its id ended. Another producer's (a progress topic shared, or
with fewer partitions than shards) that holds the read ``HELD_FOR`` s fails it
with ``HeldByOpenTransactionError`` (``_held``): the caller tries again later.

Unless the broker left it open: a broker that cannot find a partition's leader
when it writes a transaction's markers takes the partition for deleted and drops
them (Apache Kafka 4.x, seen when a restarted single broker's old registration is
fenced, which briefly leaves every partition without a leader). Nothing of that
transaction is decided on its partitions, the last stable offset stays at its
first record for good, and a read_committed read can never pass it. When the read
is held there and the record there is the key's own (its id's producer was made
anew: no transaction of the id can still be under way), ``settle`` is given the
topics that transaction wrote (``TOPICS_HEADER``); the new producer aborts it
everywhere (``KafkaTransactionalProducer.end_left_open``) and the read goes on.

On several brokers the coordinator can write a commit's markers on some partitions and drop
the others' (their leader lost): the key's record left open, aborted above, while records of
the same transaction on other partitions are committed, on the wire for read_committed
readers. ``read_back`` therefore also gives every transaction of the key after its last
committed record (read uncommitted: aborted, or left open and now ended) with which of its
records are committed: its last record names the partition and offset of each
(``POSITIONS_HEADER``), read back read_committed once everything there is decided. A data
partition held at that very record (its own marker dropped) is ended the same way. Records an
earlier release wrote name no positions: nothing of them is known committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import suppress
from typing import Any, TypeVar

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from .._errors import ConfigurationError, RetriableTransportError, TopicNotFoundError, UnsupportedBrokerError
from .._protocol import ReadBack, Uncommitted
from ._admin import ADMIN, connection_settings
from ._held import HELD_FOR, read_held
from ._transactions import POSITIONS_HEADER, TOPICS_HEADER, positions_of

log = logging.getLogger("transports.kafka")

LEADERLESS = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE})

WINDOW = 64  # records read back at first when looking for a key's last committed record

Settle = Callable[[Sequence[str]], None]
"""Ends, with the key's own producer, a transaction of the key left open on the topics given."""

SettleAt = Callable[[str, int], None]
"""Ends, with the key's own producer, a transaction of the key left open on the one partition given."""


NO_ANSWER = "no answer in time"
"""Why an admin request failed whose future was not done when the wait for it ended: concurrent.futures'
bare ``TimeoutError``, not a ``KafkaException`` (a client whose metadata still names a killed leader is
answered only at its request timeout, which a wait as long often beats). Retriable, as any outage."""


STOPPED = "stopped before the broker answered"
"""Why a wait for the broker given a ``stopping`` event ended early: the stop was asked for."""

_SLICE = 0.05
"""How often a wait for an admin request's answer looks at its ``stopping`` event."""

_METADATA_GRACE = 1.0
"""Seconds past its own timeout a metadata request asked on a thread (``listed``) is waited for."""

MOCK_CLUSTER = "mockCluster"
"""How librdkafka's mock cluster names itself: its cluster id (``rd_kafka_mock_cluster_new``) is this
and a number; Apache Kafka's is a base64 UUID."""

T = TypeVar("T")


def answer(future: Future[T], timeout: float, stopping: threading.Event | None) -> T:
    """``future.result(timeout)``, given up (``RetriableTransportError``, ``STOPPED``) once ``stopping``
    is set: a relay stopped while the broker is slow to answer, or never answers (librdkafka's mock
    cluster ignores CreateTopics), returns at once instead of waiting out the transaction timeout."""
    deadline = time.monotonic() + timeout
    while stopping is not None and not future.done() and (left := deadline - time.monotonic()) > 0:
        if stopping.wait(min(_SLICE, left)):
            raise RetriableTransportError(STOPPED)
    try:
        return future.result(max(0.0, deadline - time.monotonic()))
    finally:
        # The future keeps the exception it raises (the broker's refusal), whose traceback holds this
        # frame: a cycle with the admin client of the caller's frame, left for the collector.
        del future


def listed(admin: AdminClient, topic: str, timeout: float, stopping: threading.Event | None) -> Any:
    """``admin.list_topics(topic, timeout)``; with ``stopping``, asked on a daemon thread of its own
    ("outbox-metadata") and given up (``STOPPED``) once it is set.

    librdkafka's metadata request is one C call that nothing interrupts, and a request asked again
    in short slices is never answered by a broker slower than a slice (each answer comes after its
    request was given up). The thread keeps the admin client until the call returns (``timeout``),
    and frees it there.
    """
    if stopping is None:
        return admin.list_topics(topic, timeout=timeout)
    # The future holds the answer or the broker's error, never an exception: one raised from it
    # (``Future.result``) would be held by it, and its traceback holds this frame, which holds the
    # future and the admin client, a cycle left for the collector (module doc of
    # tests/test_transport_kafka_lifetime.py), once a lookup of every take-over in an outage.
    answered: Future[tuple[Any, KafkaError | None]] = Future()

    def ask() -> None:
        try:
            answered.set_result((admin.list_topics(topic, timeout=timeout), None))
        except KafkaException as exc:
            answered.set_result((None, exc.args[0]))
        except Exception as exc:  # not the broker's (rare): raised as it was, its traceback dropped
            answered.set_exception(exc.with_traceback(None))

    threading.Thread(target=ask, name="outbox-metadata", daemon=True).start()
    try:
        metadata, error = answer(answered, timeout + _METADATA_GRACE, stopping)
    except TimeoutError:  # concurrent.futures': list_topics did not return within its own timeout
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, NO_ANSWER)) from None
    if error is not None:
        raise KafkaException(error)
    return metadata


def ensure_compacted_topic(config: Mapping[str, Any], topic: str, partitions: int, timeout: float,
                           stopping: threading.Event | None = None) -> None:
    """Create ``topic`` with log compaction unless it exists; the cluster's default replication.

    A topic found existing whose records the broker may delete (``refuse_uncompacted``)
    is refused with ``ConfigurationError``, as is librdkafka's mock cluster, which answers
    neither the creation nor the look at the configuration. ``stopping``: once set, the wait for the
    broker ends within a moment (``RetriableTransportError``, ``STOPPED``).
    """
    admin = AdminClient({**connection_settings(config), **ADMIN})
    try:
        metadata = listed(admin, topic, timeout, stopping)
    except KafkaException as exc:
        raise RetriableTransportError(f"cannot look up topic {topic!r}: {exc.args[0].str()}") from None
    if str(metadata.cluster_id or "").startswith(MOCK_CLUSTER):
        raise UnsupportedBrokerError(
            f"cannot keep topic {topic!r} on librdkafka's mock cluster (cluster id {metadata.cluster_id}: "
            f"the embedded broker, `outbox dev-broker`): it answers no CreateTopics or DescribeConfigs "
            f"and fences no producer. Exactly once needs Apache Kafka")
    found = metadata.topics.get(topic)
    if found is not None and found.error is None and found.partitions:
        refuse_uncompacted(admin, config, topic, timeout, stopping)
        return
    new = NewTopic(topic, num_partitions=partitions, replication_factor=-1,
                   config={"cleanup.policy": "compact", "segment.ms": "3600000",
                           "min.compaction.lag.ms": "0"})
    deadline = time.monotonic() + timeout
    try:
        answer(admin.create_topics([new], operation_timeout=timeout)[topic], timeout, stopping)
    except TimeoutError:  # concurrent.futures': the future not done in time (see NO_ANSWER)
        raise RetriableTransportError(f"cannot create topic {topic!r}: {NO_ANSWER}") from None
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise RetriableTransportError(f"cannot create topic {topic!r}: {error.str()}") from None
        refuse_uncompacted(admin, config, topic, timeout, stopping)  # made meanwhile by someone else
    pause = stopping or threading.Event()
    while time.monotonic() < deadline:  # created: usable once every partition has a leader
        with suppress(KafkaException):
            found = listed(admin, topic, max(0.001, deadline - time.monotonic()), stopping).topics.get(topic)
            if (found is not None and found.error is None and found.partitions
                    and all(p.leader >= 0 for p in found.partitions.values())):
                return
        if pause.wait(0.1):
            raise RetriableTransportError(STOPPED)
    raise RetriableTransportError(f"topic {topic!r} has no leader for every partition yet")


def refuse_uncompacted(admin: AdminClient, config: Mapping[str, Any], topic: str, timeout: float,
                       stopping: threading.Event | None = None) -> None:
    """Raise ``ConfigurationError`` unless ``topic`` keeps each key's last record for good.

    The relay's progress record of a shard is the only account of rows a
    transaction committed whose mark did not: a broker that deletes it (after
    ``retention.ms``, or past ``retention.bytes``) while the shard is idle makes
    the next take-over send those rows again. Compaction keeps it; ``delete``
    beside it must keep everything (both retentions -1).
    """
    resource = ConfigResource("topic", topic)
    try:
        found = answer(admin.describe_configs([resource], request_timeout=timeout)[resource], timeout,
                       stopping)
    except TimeoutError:
        raise RetriableTransportError(
            f"cannot read the configuration of topic {topic!r}: {NO_ANSWER}") from None
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        # The topic exists (found, or its creation refused as existing): a broker that does not know
        # it yet (just made, its metadata not there) says UNKNOWN_TOPIC_OR_PART, as do others' races.
        if error.retriable() or error.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                                                 KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise RetriableTransportError(
                f"cannot read the configuration of topic {topic!r}: {error.str()}") from None
        raise ConfigurationError(f"cannot read the configuration of progress topic {topic!r} "
                                 f"({error.str()}): the relay needs DescribeConfigs on it") from None
    policy = found["cleanup.policy"].value if "cleanup.policy" in found else "delete"
    policies = {p.strip() for p in policy.split(",")}
    retention = {name: found[name].value for name in ("retention.ms", "retention.bytes") if name in found}
    finite = {name: value for name, value in retention.items() if value != "-1"}
    if "compact" in policies and ("delete" not in policies or not finite):
        return
    why = "".join(f", {name}={value}" for name, value in finite.items()) if "compact" in policies else ""
    servers = config.get("bootstrap.servers", "<broker>")
    raise ConfigurationError(
        f"progress topic {topic!r} has cleanup.policy={policy}{why}: the broker may delete a shard's "
        f"progress record, and a take-over would then send its committed rows again. Make it compacted: "
        f"kafka-configs.sh --bootstrap-server {servers} --alter --entity-type topics --entity-name {topic} "
        f"--add-config cleanup.policy=compact")


def last_committed(config: Mapping[str, Any], topic: str, partition: int, key: bytes,
                   timeout: float, settle: Settle | None = None) -> bytes | None:
    """The last committed record of ``key`` on ``topic``, or None (module doc).

    ``settle``: how a transaction of ``key`` left open is ended; without it such a
    transaction makes the read fail (``RetriableTransportError``) instead of waiting it out.
    """
    return read_back(config, topic, partition, key, timeout, settle, after=False).committed


def read_back(config: Mapping[str, Any], topic: str, partition: int, key: bytes, timeout: float,
              settle: Settle | None = None, settle_at: SettleAt | None = None, *,
              after: bool = True) -> ReadBack:
    """``last_committed``, and the transactions of ``key`` written after that record whose own record
    of ``key`` did not commit, each with which of its other records are committed (``_positions``).

    ``settle_at``: how the key's transaction left open on a partition it wrote is ended (its
    progress record decided, a data partition's marker dropped); without it the read fails there.
    """
    deadline = time.monotonic() + timeout
    settings = connection_settings(config)
    admin = AdminClient({**settings, **ADMIN})
    tp, start, end = _bounds(admin, topic, partition, deadline)
    consumer = Consumer({**settings, "group.id": "outbox-progress-reader", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True,
                         "fetch.wait.max.ms": 10, "log_level": 0})
    held = _Held(settings, tp, key, settle, deadline, end)
    committed: tuple[bytes | None, int] | None = None
    try:
        window, top = WINDOW, end
        while top > start and committed is None:
            low = max(start, top - window)
            committed = _last_of(consumer, tp, key, low, top, held)
            top, window = low, window * 4
    finally:
        consumer.close()
    since = start if committed is None else committed[1] + 1
    later = _uncommitted(settings, tp, key, since, end, deadline) if after and since < end else []
    found = tuple(Uncommitted(value, _positions(settings, headers, settle_at, deadline))
                  for value, headers in later)
    return ReadBack(None if committed is None else committed[0], found)


def _bounds(admin: AdminClient, topic: str, partition: int,
            deadline: float) -> tuple[TopicPartition, int, int]:
    """The partition of ``topic`` that ``partition`` names, its first offset and its end as written.

    A partition without a leader yet (a topic just made, a leader moving) is asked again until
    ``deadline``: a take-over must not wait a whole retry for it.
    """
    while True:
        timeout = max(0.1, deadline - time.monotonic())
        try:
            info = admin.list_topics(topic, timeout=timeout).topics.get(topic)
            if info is None or info.error is not None or not info.partitions:
                raise TopicNotFoundError(f"topic {topic!r} not found")
            tp = TopicPartition(topic, partition % len(info.partitions))
            latest, earliest = OffsetSpec.latest(), OffsetSpec.earliest()  # type: ignore[no-untyped-call]
            # Read uncommitted: the end as written, an open transaction's records included.
            uncommitted = IsolationLevel.READ_UNCOMMITTED
            end = admin.list_offsets({tp: latest}, isolation_level=uncommitted,
                                     request_timeout=timeout)[tp].result(timeout).offset
            start = admin.list_offsets({tp: earliest}, isolation_level=uncommitted,
                                       request_timeout=timeout)[tp].result(timeout).offset
            return tp, start, end
        except TimeoutError:
            raise RetriableTransportError(f"cannot read {topic!r}: {NO_ANSWER}") from None
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() not in LEADERLESS or time.monotonic() + 0.1 >= deadline:
                raise RetriableTransportError(f"cannot read {topic!r}: {error.str()}") from None
        time.sleep(0.1)


def _last_of(consumer: Consumer, tp: TopicPartition, key: bytes, low: int, end: int,
             held: _Held) -> tuple[bytes | None, int] | None:
    """The last committed record of ``key`` at offsets ``low`` to ``end`` (excluded), with its offset,
    or None."""
    consumer.assign([TopicPartition(tp.topic, tp.partition, low)])
    last: tuple[bytes | None, int] | None = None
    while True:
        if time.monotonic() >= held.deadline:
            if held.offset is not None:  # held at an open transaction until the end: whose, unknown
                raise read_held(key, tp.topic, tp.partition, held.offset, held.end, foreign=False)
            raise RetriableTransportError(
                f"could not read {tp.topic}[{tp.partition}] to offset {end} in time")
        message = consumer.poll(0.2)
        if message is None:
            held.still()
            continue
        error = message.error()
        offset = message.offset() or 0
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF and offset >= end:
                return last
            if error.code() == KafkaError._PARTITION_EOF:
                held.at(offset)  # an open transaction ahead holds the committed end back: wait for it
                continue
            raise RetriableTransportError(f"cannot read {tp.topic}: {error.str()}")
        held.moved()
        if offset >= end:
            return last
        if message.key() == key:
            last = (message.value(), offset)
        if offset == end - 1:
            return last


def _uncommitted(settings: Mapping[str, Any], tp: TopicPartition, key: bytes, since: int, end: int,
                 deadline: float) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    """The records of ``key`` at offsets ``since`` to ``end`` (excluded), read uncommitted: past the
    key's last committed record, each is a transaction of the key that did not commit it (the read
    of ``end`` waited until everything before it ended). Their values and headers, oldest first."""
    consumer = Consumer({**settings, "group.id": "outbox-progress-reader", "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted", "enable.partition.eof": True,
                         "fetch.wait.max.ms": 10, "log_level": 0})
    found: list[tuple[bytes, list[tuple[str, bytes]]]] = []
    try:
        consumer.assign([TopicPartition(tp.topic, tp.partition, since)])
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            error, offset = message.error(), message.offset() or 0
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                raise RetriableTransportError(f"cannot read {tp.topic}: {error.str()}")
            value = message.value()
            if error is None and offset < end and message.key() == key and value:
                raw: Any = message.headers() or []
                headers = [(n, v) for n, v in raw if isinstance(v, bytes)]
                found.append((value, headers))
            if offset >= end - 1 and (error is None or offset >= end):
                return found
        raise RetriableTransportError(f"could not read {tp.topic}[{tp.partition}] to offset {end} in time")
    finally:
        consumer.close()


def _positions(settings: Mapping[str, Any], headers: list[tuple[str, bytes]], settle_at: SettleAt | None,
               deadline: float) -> tuple[bool, ...] | None:
    """Which of a transaction's records (before its last) a read_committed reader gets, from its last
    record's ``headers``; None if they do not say where the records went (an earlier release's).

    The transaction's records on one partition share its marker there: the first one's offset is
    read back read_committed. Read there, it is committed; passed (aborted, or gone: compacted or
    deleted since), it is not, and its row is sent again. A read held exactly at that offset is held
    by that very transaction, left open there by the broker: it is ended (``settle_at``), never read.
    """
    named = dict(headers)
    if POSITIONS_HEADER not in named or TOPICS_HEADER not in named:
        return None
    try:
        partitions, places = positions_of(named[TOPICS_HEADER], named[POSITIONS_HEADER])
    except (ValueError, IndexError, UnicodeDecodeError):
        log.warning("a progress record's %s header is unreadable: its transaction's records are taken "
                    "for not committed", POSITIONS_HEADER)
        return None
    if not partitions:
        return ()
    readable = _committed_at(settings, partitions, settle_at, deadline)
    return tuple(readable[partitions[p]] for p in places)


def _committed_at(settings: Mapping[str, Any], partitions: list[tuple[str, int, int]],
                  settle_at: SettleAt | None, deadline: float) -> dict[tuple[str, int, int], bool]:
    """Whether the record at each (topic, partition, offset) is read committed (``_positions``)."""
    consumer = Consumer({**settings, "group.id": "outbox-progress-reader", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True,
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10, "log_level": 0})
    wanted = {(t, p): o for t, p, o in partitions}
    # A partition that no longer exists (its topic deleted since, or made again with fewer partitions)
    # has nothing of the transaction: an assigned read of it never ends, nor fails.
    counts = _partition_counts(settings, sorted({t for t, _ in wanted}), deadline)
    decided = {where: False for where in wanted if where[1] >= counts.get(where[0], 0)}
    held = _HeldAt(wanted, settle_at)
    try:
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in wanted.items() if (t, p) not in decided])
        while len(decided) < len(wanted):
            if time.monotonic() >= deadline:
                left = ", ".join(f"{t}[{p}]" for t, p in sorted(set(wanted) - set(decided)))
                raise RetriableTransportError(f"could not read a transaction's records back in time on "
                                              f"{left}: open transactions hold read_committed readers there")
            message = consumer.poll(0.2)
            held.still(decided)
            if message is None:
                continue
            where = (message.topic(), message.partition())
            if where not in wanted or where in decided:
                continue
            error, offset = message.error(), message.offset() or 0
            if error is None:
                decided[where] = offset == wanted[where]  # passed: that record is not committed
            elif error.code() == KafkaError._PARTITION_EOF:
                if offset == wanted[where]:
                    held.at(where)
                else:  # passed it; or below it, the partition's records gone (its log reset to a lower end)
                    decided[where] = False
            elif error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC,
                                  KafkaError._UNKNOWN_PARTITION):
                decided[where] = False  # gone with its topic
            else:
                raise RetriableTransportError(f"cannot read {where[0]}: {error.str()}")
    finally:
        consumer.close()
    return {(t, p, o): decided[(t, p)] for t, p, o in partitions}


def _partition_counts(settings: Mapping[str, Any], topics: Sequence[str], deadline: float) -> dict[str, int]:
    """How many partitions each of ``topics`` has now; a topic that does not exist is left out (one the
    cluster lists with another error raises ``RetriableTransportError``: a partition taken for gone
    counts its record as not committed, and its row is sent again)."""
    admin = AdminClient({**settings, **ADMIN})
    try:
        found = admin.list_topics(timeout=max(0.1, deadline - time.monotonic())).topics
    except KafkaException as exc:
        raise RetriableTransportError(f"cannot list the cluster's topics: {exc.args[0].str()}") from None
    counts: dict[str, int] = {}
    for topic in topics:
        info = found.get(topic)
        if info is None or (info.error is not None and info.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            continue
        if info.error is not None or not info.partitions:  # there, but not readable now: not taken for gone
            why = info.error.str() if info.error is not None else "no partitions listed"
            raise RetriableTransportError(f"cannot look up topic {topic!r}: {why}")
        counts[topic] = len(info.partitions)
    return counts


class _HeldAt:
    """Read-backs held at the very record they read: its partition's last stable offset is that
    record's, so the transaction open there is the record's own, its producer fenced (the read's
    caller made a new one of the id), left open by the broker. After ``HELD_FOR`` s it is ended."""

    def __init__(self, wanted: Mapping[tuple[str, int], int], settle_at: SettleAt | None) -> None:
        self._wanted, self._settle_at = wanted, settle_at
        self._since: dict[tuple[str, int], float] = {}
        self._ended: set[tuple[str, int]] = set()

    def at(self, where: tuple[str, int]) -> None:
        self._since.setdefault(where, time.monotonic())

    def still(self, decided: Mapping[tuple[str, int], bool]) -> None:
        now = time.monotonic()
        for where, since in list(self._since.items()):
            if where in decided or where in self._ended or now - since < HELD_FOR:
                continue
            topic, partition = where
            at = f"{topic}[{partition}] at offset {self._wanted[where]}"
            if self._settle_at is None:
                raise RetriableTransportError(f"a transaction of this id is left open on {at} though its "
                                              f"producer was fenced (the broker dropped its marker)")
            log.warning("a transaction was left open by the broker on %s (its marker dropped): aborted "
                        "there", at)
            self._settle_at(topic, partition)
            self._ended.add(where)


class _Held:
    """A read held at an open transaction: after ``HELD_FOR`` s, a transaction of the key itself is
    ended with ``settle`` (module doc); another producer's fails the read at once
    (``HeldByOpenTransactionError``): it ends by its commit, abort or timeout, minutes perhaps, and
    the take-over is tried again rather than hold its thread until the deadline."""

    def __init__(self, settings: Mapping[str, Any], tp: TopicPartition, key: bytes,
                 settle: Settle | None, deadline: float, end: int) -> None:
        self._settings, self._tp, self._key, self._settle = settings, tp, key, settle
        self.deadline, self.end = deadline, end
        self.offset: int | None = None
        """The last stable offset the read is held at, below the end it reads to; None while it moves."""
        self._since = 0.0
        self._looked: set[int] = set()

    def at(self, offset: int) -> None:
        """The read reached the last stable offset ``offset``, below the end it reads to."""
        self.offset, self._since = offset, time.monotonic()

    def moved(self) -> None:
        """A record came: the read is not held."""
        self.offset = None

    def still(self) -> None:
        """Nothing new came; look at the transaction holding the read once it held it ``HELD_FOR`` s."""
        offset = self.offset
        if offset is None or offset in self._looked or time.monotonic() - self._since < HELD_FOR:
            return
        self._looked.add(offset)
        first = _record_at(self._settings, self._tp, offset, self.deadline)
        if first is None:
            return  # not read in time: whose, unknown (the deadline says so)
        if first.key() != self._key:  # another id's transaction (a shared topic)
            raise read_held(self._key, self._tp.topic, self._tp.partition, offset, self.end, foreign=True)
        where = f"{self._tp.topic}[{self._tp.partition}] at offset {offset}"
        topics = dict(first.headers() or []).get(TOPICS_HEADER)
        if self._settle is None or topics is None:
            raise RetriableTransportError(
                f"a transaction of this id is left open on {where} though its producer was fenced (the "
                f"broker dropped its markers); it holds every read_committed reader there. End it: "
                f"kafka-transactions.sh --bootstrap-server <broker> find-hanging --broker-id <leader>, "
                f"then abort --topic {self._tp.topic} --partition {self._tp.partition} "
                f"--start-offset {offset}")
        names = [t for t in topics.decode().split(",") if t]
        log.warning("a transaction of %s was left open by the broker on %s (its markers dropped): "
                    "aborted on every partition of %s", self._key.decode(errors="replace"), where,
                    ", ".join(names))
        self._settle(names)


def _record_at(settings: Mapping[str, Any], tp: TopicPartition, offset: int, deadline: float) -> Any:
    """The record at ``offset`` read uncommitted (an open transaction's first), or None if none came."""
    consumer = Consumer({**settings, "group.id": "outbox-progress-reader", "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted", "log_level": 0})
    try:
        consumer.assign([TopicPartition(tp.topic, tp.partition, offset)])
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is not None and message.error() is None and (message.offset() or 0) >= offset:
                return message if message.offset() == offset else None
        return None
    finally:
        consumer.close()
