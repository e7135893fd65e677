"""The broker edge: primitive records in, per-record results out.

This is the strict point of cut-off between the framework and a broker client:
only the types here cross it, and broker errors are translated into
``SendResult`` outcomes or ``outbox`` errors by the transport itself.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class Record:
    """A broker record: bytes and string headers, nothing framework-specific."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    partition: int | None = None
    offset: int | None = None
    timestamp_ms: int | None = None


class Outcome(enum.Enum):
    """What became of one record handed to ``Transport.publish``."""

    DELIVERED = "delivered"
    """Acknowledged by the broker; ``partition`` and ``offset`` are set."""
    RETRY = "retry"
    """Not acknowledged, may succeed later (broker down, timeout, not sent)."""
    FAILED = "failed"
    """Can never succeed as it is (too large, unknown topic, not authorised)."""


@dataclass(slots=True, frozen=True)
class SendResult:
    outcome: Outcome
    partition: int | None = None
    offset: int | None = None
    error: str | None = None
    unreachable: bool = False
    """For ``RETRY``: the broker did not answer (timeout, connection down) or answered that the
    cluster cannot take writes now (too few in-sync replicas), as opposed to answering with an
    error about this record. A batch the broker delivered nothing of
    whose retries are all unreachable is an outage: the relay does not count an attempt."""


@dataclass(frozen=True, slots=True)
class TransportFeatures:
    """What a transport promises beyond ``publish``'s signature, as Watermill's ``Features`` say it.

    A transport declares them as its ``features`` attribute; one that declares
    none is taken to promise them all (the Kafka transports' contract, which
    ``Transport`` was written for: ``transport_features``).
    ``transports.testing.TransportConformance`` runs the tests of what is
    claimed and skips, naming the feature, what is not.
    """

    ordered_per_key: bool = True
    """The records of one (topic, key) are written in the order given, to one partition (Kafka's
    Java default partitioner), and nothing of a key is written behind its record that was not
    delivered. The relay's per-key order rests on it."""
    offsets: bool = True
    """A delivered record's ``SendResult`` names the partition and offset the broker gave it."""
    persistent: bool = True
    """A record reported delivered is held by the broker: another client reads it back."""
    rejects_oversized: bool = True
    """A record over the size limit (``max_record_bytes``) comes back ``FAILED``, never cut or split."""
    transactions: bool = False
    """It offers ``transactional(transactional_id)`` (``Transactions``): records written in one
    broker transaction, all read by a read_committed consumer or none, and a newer producer of the
    same id fencing every older one. The relay's exactly-once mode needs it. Never assumed: a
    transport that declares no features does not promise it (it needs those methods too)."""


@dataclass(frozen=True, slots=True)
class SourceFeatures:
    """What a source promises beyond its methods' signatures; declared as its ``features`` attribute.

    A source that declares none is taken to promise them all (both Kafka
    sources do: ``source_features``). ``transports.testing.SourceConformance``
    runs the tests of what is claimed and skips, naming the feature, what is not.
    """

    offsets: bool = True
    """Each record carries its ``partition`` and ``offset``; each partition is delivered in offset
    order; ``commit`` takes, per (topic, partition), the offset of the next record to read
    ("everything before it is finished"). ``Inbox.run`` rests on it: its offset tracker commits up
    to the lowest offset not yet finished. A source without it (a queue that acknowledges each
    message) feeds ``Inbox.handle`` from a loop of its own, acknowledging a record once ``handle``
    returned; ``Inbox.run`` refuses it rather than never commit."""
    persistent: bool = True
    """Committed positions outlive the source: a new source of the same group resumes after them,
    and what was not committed is delivered again."""


def transport_features(transport: object) -> TransportFeatures:
    """The features ``transport`` declares (``features``), or all of them when it declares none."""
    declared: Any = getattr(transport, "features", None)
    return declared if isinstance(declared, TransportFeatures) else TransportFeatures()


def source_features(source: object) -> SourceFeatures:
    """The features ``source`` declares (``features``), or all of them when it declares none."""
    declared: Any = getattr(source, "features", None)
    return declared if isinstance(declared, SourceFeatures) else SourceFeatures()


@runtime_checkable
class Transport(Protocol):
    """Publishes batches of records and reports one result per record.

    Contract every implementation keeps (checked by
    ``transports.testing.TransportConformance``):

    - results come back in the order of the records given;
    - records with the same key are written in the order given, to one partition;
    - once a record of a key is not delivered, the later records of that key in
      the same batch are not written either (they come back as ``RETRY``), so a
      retry can never land behind its successor.

    A transport may also offer ``max_record_bytes: int``, the largest record it
    can send, counted as librdkafka counts it for ``message.max.bytes`` (key,
    value, headers with their lengths, 36 bytes per record), and
    ``max_record_setting: str``, the client setting that decides it. A relay
    refuses to start on a transport that cannot send every record the outbox
    accepts (both Kafka transports offer them).

    It says what it promises beyond these signatures with a ``features``
    attribute (``TransportFeatures``: ordered per key, offsets, persistent,
    rejects oversized); without one, it is taken to promise all of them.
    """

    def publish(self, records: Sequence[Record]) -> list[SendResult]: ...

    def close(self, timeout: float = 10.0) -> None: ...


class TransactionOutcome(enum.Enum):
    """What became of one broker transaction (``TransactionalProducer.send``)."""

    COMMITTED = "committed"
    """Every record is on the topic, readable by a read_committed consumer; results are ``DELIVERED``."""
    ABORTED = "aborted"
    """None of it will ever be read committed; each record's result says why (``FAILED`` for the
    record the broker refused for good, ``RETRY`` for the others)."""
    FENCED = "fenced"
    """A newer producer of the same transactional id took over: this one is finished, nothing of
    its open transaction will be read committed."""
    UNKNOWN = "unknown"
    """The commit was asked for and its answer is not known (timeout, broker gone): the
    producer is finished; a new one of the same id (which settles the transaction) and the
    progress the transaction carried tell whether it committed."""


@dataclass(frozen=True, slots=True)
class TransactionResult:
    """One transaction's outcome, and one result per record given, in order."""

    outcome: TransactionOutcome
    results: list[SendResult]
    error: str | None = None
    answered: int = 0
    """Of a transaction given up for want of time (not committed, not fenced): how many of its
    records the broker acknowledged before it was, on connections that held: 0 when one was lost or
    refused meanwhile (a broker killed is an outage, not a pace), or when the broker went silent,
    throttling nothing (a host crashed, a network partition). More than none means the broker
    answers, too slowly for a transaction this big: the caller sends smaller ones (``_exactly_once``'s
    pace)."""


@dataclass(frozen=True, slots=True)
class Uncommitted:
    """A transaction of a key, after the key's last committed record, whose record of the key is not
    committed (aborted, or left open by the broker and ended by the read: ``Transactions.read_back``).

    ``value``: that record's. ``readable``: one flag per record the transaction wrote before it, in the
    order given to ``TransactionalProducer.send``: whether a read_committed reader gets it. Some are
    when the coordinator decided a commit and the broker wrote the markers of only some partitions.
    None when the transaction did not say where its records went (written by an earlier release).
    """

    value: bytes
    readable: tuple[bool, ...] | None


@dataclass(frozen=True, slots=True)
class ReadBack:
    """What ``Transactions.read_back`` found of a key: its last committed record's value (None if none),
    and the transactions of the key after it that did not commit that record, oldest first."""

    committed: bytes | None
    after: tuple[Uncommitted, ...] = ()


@runtime_checkable
class TransactionalProducer(Protocol):
    """One ``transactional.id``'s producer: each ``send`` is one broker transaction.

    Made by ``Transactions.transactional``, which fences every older producer
    of the id (Kafka's ``init_transactions``). Per-key order holds inside a
    transaction as in ``Transport.publish``; a record naming its ``partition``
    goes there (modulo the topic's partition count). Not safe for several threads.
    """

    def send(self, records: Sequence[Record]) -> TransactionResult: ...

    def close(self) -> None: ...


@runtime_checkable
class Transactions(Protocol):
    """What a transport with ``TransportFeatures.transactions`` offers besides ``publish``."""

    @property
    def transaction_timeout(self) -> float:
        """Seconds a transaction, and each broker call around one (fencing, reading progress back),
        may take before it is given up: the user's knob for a broker slower than the default
        (``KafkaTransport``: its ``delivery_timeout``)."""
        ...

    def transactional(self, transactional_id: str, timeout: float, *, one_per_request: bool = False,
                      left_open: Collection[str] = ()) -> TransactionalProducer:
        """A producer of ``transactional_id``, every older one fenced; raises
        ``RetriableTransportError`` when the broker does not answer within ``timeout``.
        ``one_per_request``: each broker request holds one record, so a refusal is its own.
        ``left_open``: topics where earlier producers of the id, perhaps in processes gone since, may
        have left records of transactions that did not commit open; what is open on every partition of
        them is ended before the producer is returned (``RetriableTransportError`` if it cannot be),
        so that none of its commits ends such records committed."""
        ...

    def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float,
                               stopping: threading.Event | None = None) -> None:
        """Create ``topic`` (log compaction, the cluster's replication) unless it exists. ``stopping``:
        once set, the wait for the broker ends within a moment (``RetriableTransportError``)."""
        ...

    def read_back(self, topic: str, partition: int, key: bytes, timeout: float) -> ReadBack:
        """The last committed record of ``key`` in ``topic``'s ``partition`` (read_committed), and the
        transactions of ``key`` written after it whose record of the key did not commit, each with
        which of its other records are committed (a ``partition`` beyond the topic's count wraps
        around, as a ``Record``'s does). ``key`` is the transactional id of the producers writing it,
        whose newest producer was made before the call: no transaction of the id is still under way.

        Reads up to everything written before the call, waiting (``timeout``) for open
        transactions ahead of it to end; raises ``RetriableTransportError`` if it cannot."""
        ...


RevokeCallback = Callable[[Sequence[tuple[str, int]]], None]


@runtime_checkable
class Source(Protocol):
    """Delivers records from subscribed topics and commits consumed positions.

    The positions are Kafka's, and the protocol says so: records carry a
    partition and an offset, and ``commit`` takes, per (topic, partition), the
    offset of the next record to read, so committing means "everything before
    this is finished". A source declares what it promises with a ``features``
    attribute (``SourceFeatures``: ``offsets``, ``persistent``); one without
    ``offsets`` declares it has no such positions and is fed to
    ``Inbox.handle`` by its own loop instead of ``Inbox.run`` (docs/transports.md).
    ``on_revoke`` is called from inside ``poll`` before partitions are taken
    away, so in-flight work can be finished or abandoned first.

    A source may also offer ``assigned() -> frozenset[tuple[str, int]]``, the
    partitions it holds now (both Kafka sources do); a worker's ``/readyz``
    reports "no partitions assigned" from it, and skips that check without it. It may
    offer ``unavailable() -> str | None``, why the broker cannot serve it now (the Kafka
    source: its group's coordinator out of reach for longer than a session timeout),
    which ``Inbox.run`` logs once as a broker outage, and once when it ends.
    """

    def poll(self, max_records: int, timeout: float) -> list[Record]: ...

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None: ...

    def on_revoke(self, callback: RevokeCallback) -> None: ...

    def close(self) -> None: ...
