"""Test helpers for transports: a conformance suite, a read-back consumer, fault injection.

``TransportConformance`` is the contract of ``transports.Transport`` as pytest
tests. Subclass it in a test module and provide two fixtures: ``transport``
(a fresh transport connected to the broker at fixture ``kafka``) and ``topic``
(a topic name no other test uses, auto-created with several partitions). Every
transport of this package passes it; a third-party transport should too.

``SourceConformance`` is the contract of ``transports.Source`` the same way
(fixtures ``make_source``, ``produce`` and ``topic``); ``KafkaSource`` and
``transports.memory.InMemorySource`` pass it.

Both suites test what the transport or source claims, as Watermill's
``Features`` switch its pub/sub tests: each reads the ``features`` the
transport declares (``TransportFeatures``, ``SourceFeatures``; none declared:
all claimed), and a test of a feature not claimed is skipped, saying which.
A claimed feature that does not hold fails its tests.

``FaultyTransport`` wraps a real transport and fails a share of sends in the two
ways real brokers do (never sent; sent but the acknowledgement lost), while
keeping the per-key contract, so relay tests can prove ordering and no loss.

``BrokerProcess`` hosts the embedded broker in a process of its own, so a test
can freeze it (SIGSTOP: connections stay open, nothing answers) and thaw it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import cast

from transports._partitioner import partition_for_key

from ._protocol import Outcome, Record, SendResult, Source, Transport, source_features, transport_features
from ._waves import NOT_SENT

INJECTED_NOT_SENT = "injected fault: not sent"
INJECTED_LOST_ACK = "injected fault: sent, acknowledgement lost"


def read_topic(bootstrap: str, topic: str, *, expected: int, timeout: float = 30.0,
               settle: float = 0.0, isolation: str = "read_committed", whole: bool = False) -> list[Record]:
    """Read ``topic`` from the beginning until ``expected`` records arrived or ``timeout`` passed.

    With ``settle`` it goes on reading until nothing arrived for that long
    (to count duplicates beyond ``expected``). ``isolation``: ``read_committed`` (librdkafka's
    default, said here: records of aborted or open transactions are never read) or
    ``read_uncommitted``.

    ``whole``: every record written before the call, however many: each
    partition is read up to the end offset it had when the read began, and a
    partition not read to its end within ``timeout`` raises. A count can be
    reached early when a topic holds duplicates (a retry of a record whose
    acknowledgement was lost): the CI of c0b54d8 stopped reading there, on a
    loaded host, and 805 of 10,000 ids looked lost. (Not for topics with
    transactions: a partition's end may then be a commit marker never read.)

    Records come back in partition order (offset order within each partition),
    with partition and offset set.
    """
    import uuid

    from confluent_kafka import Consumer

    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"read-back-{uuid.uuid4().hex}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "fetch.wait.max.ms": 10,
        "isolation.level": isolation,
        "log_level": 3,
    })
    ends: dict[int, int] = {}
    if whole:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        partitions = consumer.list_topics(topic, timeout=timeout).topics[topic].partitions
        for partition in partitions:
            ends[partition] = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                             timeout=timeout)[1]
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    else:
        consumer.subscribe([topic])
    records: list[Record] = []
    read_to = dict.fromkeys(ends, 0)  # the next offset of each partition to read
    deadline = time.monotonic() + timeout
    try:
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            if whole and all(read_to[p] >= end for p, end in ends.items()):
                break
            if not whole and len(records) >= expected and time.monotonic() - quiet_since >= settle:
                break
            batch = consumer.consume(10000, 0.2)
            if batch:
                quiet_since = time.monotonic()
            for message in batch:
                if message.error() is not None:
                    continue
                records.append(Record(
                    topic=cast(str, message.topic()), value=message.value() or b"",
                    key=message.key(), headers=cast(list[tuple[str, bytes]], list(message.headers() or [])),
                    partition=message.partition(), offset=message.offset(),
                ))
                if whole:
                    partition, offset = cast(int, message.partition()), cast(int, message.offset())
                    read_to[partition] = max(read_to[partition], offset + 1)
        short = {p: (read_to[p], end) for p, end in ends.items() if read_to[p] < end}
        if short:
            raise AssertionError(f"{topic}: partitions not read to their end within {timeout:g} s "
                                 f"(partition: (next offset, end)): {short}")
    finally:
        consumer.close()
    records.sort(key=lambda r: (r.partition, r.offset))
    return records


def behind_undelivered(records: Sequence[Record], seq: Callable[[Record], int]) -> list[Record]:
    """The records written behind an undelivered record of their key: should be none.

    ``records`` in (partition, offset) order, as ``read_topic`` returns them;
    ``seq(record)`` is the record's place in its key, counting from 0. A record
    is in order when every earlier record of its key appeared before it on the
    topic; duplicates (a retry of something already written) are fine.
    """
    seen: dict[tuple[str, bytes], set[int]] = {}
    wrong = []
    for record in records:
        if record.key is None:
            continue
        mine = seen.setdefault((record.topic, record.key), set())
        n = seq(record)
        if n > 0 and n - 1 not in mine:
            wrong.append(record)
        mine.add(n)
    return wrong


def partition_count(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Producer

    metadata = Producer({"bootstrap.servers": bootstrap, "log_level": 3}).list_topics(topic, timeout=10)
    return len(metadata.topics[topic].partitions)


class FaultyTransport:
    """Wraps a transport and fails about ``rate`` of the records, keeping the per-key contract.

    A faulted record is either not sent at all (``RETRY``, as when the broker is
    down) or sent and then reported ``RETRY`` (as when the acknowledgement times
    out after the broker wrote it: the retry becomes a duplicate). Later records
    of a faulted key in the same batch are not sent. Safe to call from one
    thread at a time, like the transports it wraps.
    """

    def __init__(self, inner: Transport, *, rate: float = 0.1, seed: int | None = None) -> None:
        if not 0 <= rate < 1:
            raise ValueError(f"rate must be in [0, 1), got {rate!r}")
        self.inner = inner
        self.rate = rate
        self._random = random.Random(seed)
        self.injected = 0

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        results: list[SendResult | None] = [None] * len(records)
        faulted: set[tuple[str, bytes]] = set()
        to_send: list[int] = []
        lost_ack: set[int] = set()
        for i, record in enumerate(records):
            if record.key is not None and (record.topic, record.key) in faulted:
                # Held behind its key's injected fault, which counts: so does this.
                results[i] = SendResult(Outcome.RETRY, error=NOT_SENT, unreachable=False)
                continue
            if self._random.random() < self.rate:
                self.injected += 1
                if record.key is not None:
                    faulted.add((record.topic, record.key))
                if self._random.random() < 0.5:
                    results[i] = SendResult(Outcome.RETRY, error=INJECTED_NOT_SENT, unreachable=False)
                    continue
                lost_ack.add(i)
            to_send.append(i)
        sent = self.inner.publish([records[i] for i in to_send]) if to_send else []
        for i, result in zip(to_send, sent, strict=True):
            if i in lost_ack and result.outcome is Outcome.DELIVERED:
                result = SendResult(Outcome.RETRY, error=INJECTED_LOST_ACK, unreachable=False)
            results[i] = result
        return results  # type: ignore[return-value]

    @property
    def features(self) -> object:
        """The wrapped transport's: the faults it injects keep its contract."""
        return transport_features(self.inner)

    def close(self, timeout: float = 10.0) -> None:
        self.inner.close(timeout)


_BROKER = """
import sys
from transports.kafka import embedded_kafka
with embedded_kafka(int(sys.argv[1]), int(sys.argv[2])) as servers:
    print(servers, flush=True)
    sys.stdin.read()  # until the parent closes stdin (or goes away)
"""


class BrokerProcess:
    """The embedded broker (librdkafka's mock cluster) in a child process; a context manager.

    ``bootstrap`` is its address; ``freeze()`` stops the process (SIGSTOP) so
    the broker neither answers nor closes connections, as a hung or partitioned
    broker does; ``thaw()`` lets it go on (SIGCONT). Topics and records live as
    long as the process. ``rtt_ms`` delays every broker response.
    """

    def __init__(self, brokers: int = 3, rtt_ms: int = 0) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _BROKER, str(brokers), str(rtt_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self._process.stdout is not None
        self.bootstrap = self._process.stdout.readline().strip()
        if not self.bootstrap:
            self.close()
            raise RuntimeError("the embedded broker process did not start")
        self.frozen = False

    @property
    def pid(self) -> int:
        return self._process.pid

    def freeze(self) -> None:
        os.kill(self._process.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.kill(self._process.pid, signal.SIGCONT)
        self.frozen = False

    def close(self) -> None:
        if self._process.poll() is None:
            self.thaw()
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _requires(features: object, of: object, *names: str) -> None:
    """Skip the calling test, naming the features ``of`` does not claim (``features``)."""
    import pytest  # only the suites need it, not the helpers beside them

    missing = [name for name in names if not getattr(features, name)]
    if missing:
        pytest.skip(f"{type(of).__name__} does not claim {', '.join(missing)} (its features)")


class TransportConformance:
    """The ``Transport`` contract as tests; subclass and provide ``transport`` and ``topic``.

    Each test of a feature runs only when the transport claims it
    (``TransportFeatures``), and is skipped with the feature's name otherwise.
    """

    oversized_value = b"x" * 1_100_000

    def read_back(self, kafka: str, topic: str, *, expected: int, settle: float = 0.0) -> list[Record]:
        """What the broker at fixture ``kafka`` holds on ``topic``, in (partition, offset) order.

        Override it (with ``partition_count_of``) for a broker that is not reached by address,
        such as ``transports.memory.InMemoryBroker``: its fixture ``kafka`` is then that broker.
        """
        return read_topic(kafka, topic, expected=expected, settle=settle)

    def partition_count_of(self, kafka: str, topic: str) -> int:
        return partition_count(kafka, topic)

    def _records(self, topic: str, keys: Sequence[str | None], tag: str = "") -> list[Record]:
        return [
            Record(topic=topic, value=f"{tag}{i}".encode(), key=None if k is None else k.encode(),
                   headers=[("n", str(i).encode())])
            for i, k in enumerate(keys)
        ]

    def test_empty_batch_returns_no_results(self, transport: Transport) -> None:
        assert transport.publish([]) == []

    def test_results_in_input_order_with_partition_and_offset(
        self, transport: Transport, kafka: str, topic: str
    ) -> None:
        _requires(transport_features(transport), transport, "offsets", "persistent")
        records = self._records(topic, ["a", "b", None, "a", "c", None, "b"])
        results = transport.publish(records)
        assert [r.outcome for r in results] == [Outcome.DELIVERED] * len(records)
        written = {(r.partition, r.offset): r for r in self.read_back(kafka, topic, expected=len(records))}
        for record, result in zip(records, results, strict=True):
            assert result.partition is not None and result.offset is not None
            found = written[(result.partition, result.offset)]
            assert (found.key, found.value, found.headers) == (record.key, record.value, record.headers)

    def test_same_key_goes_to_java_partition_in_order(
        self, transport: Transport, kafka: str, topic: str
    ) -> None:
        _requires(transport_features(transport), transport, "ordered_per_key", "offsets")
        keys = [f"k{i % 7}" for i in range(70)]
        results = transport.publish(self._records(topic, keys))
        assert all(r.outcome is Outcome.DELIVERED for r in results)
        partitions = self.partition_count_of(kafka, topic)
        by_key: dict[str, list[tuple[int, int]]] = {}
        for key, result in zip(keys, results, strict=True):
            assert result.partition == partition_for_key(key.encode(), partitions)
            assert result.offset is not None
            by_key.setdefault(key, []).append((result.partition, result.offset))
        for positions in by_key.values():
            assert positions == sorted(positions) and len({p for p, _ in positions}) == 1

    def test_unkeyed_records_are_delivered(self, transport: Transport, topic: str) -> None:
        results = transport.publish(self._records(topic, [None] * 40))
        assert all(r.outcome is Outcome.DELIVERED for r in results)

    def test_oversized_record_fails_and_stops_only_its_key(
        self, transport: Transport, kafka: str, topic: str
    ) -> None:
        _requires(transport_features(transport), transport, "rejects_oversized", "ordered_per_key",
                  "persistent")
        records = self._records(topic, ["k", "k", "k", "other", "other"])
        records[1].value = self.oversized_value
        results = transport.publish(records)
        assert [r.outcome for r in results] == [
            Outcome.DELIVERED, Outcome.FAILED, Outcome.RETRY, Outcome.DELIVERED, Outcome.DELIVERED
        ]
        assert results[1].error and results[2].error
        written = self.read_back(kafka, topic, expected=3)
        assert sorted(r.value for r in written) == [b"0", b"3", b"4"]

    def test_a_key_stopped_on_one_topic_flows_on_another(
        self, transport: Transport, kafka: str, topic: str
    ) -> None:
        """Per-key order is per (topic, key): the same key bytes elsewhere are not held."""
        _requires(transport_features(transport), transport, "rejects_oversized", "ordered_per_key",
                  "persistent")
        other = f"{topic}-other"
        records = [*self._records(topic, ["k", "k"]), *self._records(other, ["k", "k"], tag="o")]
        records[0].value = self.oversized_value
        results = transport.publish(records)
        assert [r.outcome for r in results] == [
            Outcome.FAILED, Outcome.RETRY, Outcome.DELIVERED, Outcome.DELIVERED
        ]
        assert [r.value for r in self.read_back(kafka, other, expected=2)] == [b"o0", b"o1"]

    def test_a_hot_key_is_delivered_in_order(self, transport: Transport, kafka: str, topic: str) -> None:
        """Many records of one key in one batch, among other keys: all delivered, in order."""
        _requires(transport_features(transport), transport, "ordered_per_key", "offsets", "persistent")
        keys = ["hot" if i % 4 else f"k{i}" for i in range(400)]
        records = self._records(topic, keys)
        results = transport.publish(records)
        assert [r.outcome for r in results] == [Outcome.DELIVERED] * len(records)
        hot = [(r.partition, r.offset) for k, r in zip(keys, results, strict=True) if k == "hot"]
        assert len({p for p, _ in hot}) == 1 and hot == sorted(hot) and len(set(hot)) == len(hot)
        written = [r for r in self.read_back(kafka, topic, expected=len(records)) if r.key == b"hot"]
        assert [r.value for r in written] == [r.value for r in records if r.key == b"hot"]

    def test_a_hot_key_stops_at_its_failed_record(self, transport: Transport, kafka: str, topic: str) -> None:
        """Nothing of a key is written behind its failed record, however many follow it."""
        _requires(transport_features(transport), transport, "rejects_oversized", "ordered_per_key",
                  "persistent")
        records = self._records(topic, ["hot"] * 30 + ["other"] * 3)
        records[7].value = self.oversized_value
        results = transport.publish(records)
        assert [r.outcome for r in results] == (
            [Outcome.DELIVERED] * 7 + [Outcome.FAILED] + [Outcome.RETRY] * 22 + [Outcome.DELIVERED] * 3)
        written = self.read_back(kafka, topic, expected=10, settle=0.5)
        assert [r.value for r in written if r.key == b"hot"] == [f"{i}".encode() for i in range(7)]


SourceFactory = Callable[[str, Sequence[str]], Source]
"""``make_source(group_id, topics)``: a new source on the conformance broker, closed by the fixture."""
Produce = Callable[[Sequence[Record]], None]
"""``produce(records)``: writes each record to its ``topic`` and ``partition`` (both set), in order."""


class SourceConformance:
    """The ``Source`` contract as tests; subclass and provide ``make_source``, ``produce`` and ``topic``.

    ``topic`` must have at least two partitions. What is held here is what the
    inbox relies on: each partition in offset order with what was written; a
    new group starts at the earliest record; only committed positions survive
    a restart (the rest is delivered again, from the first uncommitted
    offset); closing revokes the held partitions first. It needs both
    ``SourceFeatures`` (offsets, persistent): a source that claims fewer is
    skipped, saying which, and feeds ``Inbox.handle`` instead of ``Inbox.run``.
    """

    #: How long a poll must come back empty to show nothing more is coming.
    quiet_seconds = 1.0
    #: The longest wait for records that were written (a group join on a real broker).
    deadline_seconds = 30.0

    def _poll_until(self, source: Source, count: int) -> list[Record]:
        records: list[Record] = []
        deadline = time.monotonic() + self.deadline_seconds
        while len(records) < count and time.monotonic() < deadline:
            records.extend(source.poll(100, 0.2))
        assert len(records) >= count, f"{len(records)} of {count} records came before the deadline"
        records.extend(source.poll(100, self.quiet_seconds))  # and nothing beyond them
        return records

    @staticmethod
    def _written(topic: str, partition: int, values: Sequence[str], key: bytes | None = b"k") -> list[Record]:
        return [Record(topic=topic, value=v.encode(), key=key, headers=[("n", v.encode())],
                       partition=partition) for v in values]

    def test_delivers_as_written_and_only_committed_positions_survive_a_restart(
        self, make_source: SourceFactory, produce: Produce, topic: str
    ) -> None:
        """One test, because on a real broker every group join costs seconds."""
        written = [*self._written(topic, 0, ["a0", "a1", "a2", "a3", "a4"]),
                   *self._written(topic, 1, ["b0", "b1"], key=None)]
        produce(written)
        group = f"g-{topic}"
        first = make_source(group, [topic])  # a new group: from the earliest record
        _requires(source_features(first), first, "offsets", "persistent")
        revoked: list[tuple[str, int]] = []
        first.on_revoke(revoked.extend)
        records = self._poll_until(first, len(written))
        assert len(records) == len(written)
        for partition in (0, 1):
            mine = [r for r in records if r.partition == partition]
            expected = [w for w in written if w.partition == partition]
            assert [r.offset for r in mine] == list(range(len(expected)))
            assert [(r.topic, r.key, r.value, r.headers) for r in mine] == [
                (w.topic, w.key, w.value, w.headers) for w in expected]
        assigned = getattr(first, "assigned", None)
        if assigned is not None:
            assert {(topic, 0), (topic, 1)} <= assigned()
        first.commit({(topic, 0): 3})  # a0..a2 finished; nothing of partition 1
        first.close()
        assert {(topic, 0), (topic, 1)} <= set(revoked), "closing revokes the held partitions first"

        second = make_source(group, [topic])  # the restart: from the committed positions
        again = self._poll_until(second, 4)
        assert sorted((r.partition, r.offset, r.value) for r in again) == [
            (0, 3, b"a3"), (0, 4, b"a4"), (1, 0, b"b0"), (1, 1, b"b1")]

    def test_a_poll_hands_over_what_is_there_without_waiting_to_fill(
        self, make_source: SourceFactory, produce: Produce, topic: str
    ) -> None:
        """``poll(max_records, timeout)`` waits up to ``timeout`` for the first record only: a poll
        that waited to fill ``max_records`` would hold every record of a slow stream ``timeout``
        seconds, most of a consumer's send-to-commit latency."""
        produce(self._written(topic, 0, ["a0"]))
        source = make_source(f"g-{topic}", [topic])
        try:
            self._poll_until(source, 1)  # joined, and caught up
            produce(self._written(topic, 0, ["a1"]))
            started = time.monotonic()
            records = source.poll(1000, 10.0)
            waited = time.monotonic() - started
            assert [r.value for r in records] == [b"a1"]
            assert waited < 5.0, f"the poll waited {waited:.1f} s for more than the one record there"
        finally:
            source.close()
