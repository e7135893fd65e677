"""The broker edge: primitive records in, per-record results out.

This is the strict point of cut-off between the framework and a broker client:
only the types here cross it, and broker errors are translated into
``SendResult`` outcomes or ``outbox`` errors by the transport itself.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


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
    """For ``RETRY``: the broker did not answer (timeout, connection down), as opposed to
    answering with an error about this record. A batch the broker delivered nothing of
    whose retries are all unreachable is an outage: the relay does not count an attempt."""


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
    """

    def publish(self, records: Sequence[Record]) -> list[SendResult]: ...

    def close(self, timeout: float = 10.0) -> None: ...


RevokeCallback = Callable[[Sequence[tuple[str, int]]], None]


@runtime_checkable
class Source(Protocol):
    """Delivers records from subscribed topics and commits consumed positions.

    ``commit`` takes, per (topic, partition), the offset of the next record to
    read, so committing means "everything before this is finished".
    ``on_revoke`` is called from inside ``poll`` before partitions are taken
    away, so in-flight work can be finished or abandoned first.

    A source may also offer ``assigned() -> frozenset[tuple[str, int]]``, the
    partitions it holds now (both Kafka sources do); a worker's ``/readyz``
    reports "no partitions assigned" from it, and skips that check without it.
    """

    def poll(self, max_records: int, timeout: float) -> list[Record]: ...

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None: ...

    def on_revoke(self, callback: RevokeCallback) -> None: ...

    def close(self) -> None: ...
