"""The read-back side of Kafka transactions: the last committed record of a key in a partition, and
what of the key's later transactions is committed (the progress topic's check is ``_progress_topic``'s).

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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from .._errors import RetriableTransportError, TopicNotFoundError
from .._protocol import ReadBack, Uncommitted
from ._admin import ADMIN, NO_ANSWER, connection_settings
from ._held import HELD_FOR, read_held
from ._txn_headers import POSITIONS_HEADER, TOPICS_HEADER, positions_of

log = logging.getLogger("transports.kafka")

LEADERLESS = frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE})

WINDOW = 64  # records read back at first when looking for a key's last committed record

Settle = Callable[[Sequence[str]], None]
"""Ends, with the key's own producer, a transaction of the key left open on the topics given."""

SettleAt = Callable[[str, int], None]
"""Ends, with the key's own producer, a transaction of the key left open on the one partition given."""


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
