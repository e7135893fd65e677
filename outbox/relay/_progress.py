"""The progress record of exactly-once mode: what it names, how it is read, and how big it may grow.

One record per shard transaction (``_exactly_once``): the ids of the shard's rows
committed and not known to be marked, the ids its own transaction sends in the order
of their records (``sent``), the relay that wrote it and its lease epoch, as JSON. A
take-over reads the last committed one and marks those rows without sending them
again; a later transaction the broker split (its progress record's marker dropped, some
data records' written) adds the rows whose records are committed (``counted``). The
record grows with ``batch_size`` (ids, not record bytes):
``check_progress_fits`` refuses a batch size whose record the producer or the topic
could refuse, since a refused progress record aborts every transaction of its shard.

The record also carries the header naming the topics its transaction writes
(``transports.kafka``'s ``TOPICS_HEADER``: how a take-over ends a transaction
the broker left open). A row's topic is its own, so a batch of one shard could
name any number of them: the names a transaction writes are kept within
``TOPICS_BYTES`` (``topics_fitting``; rows of the other topics go in the shard's
next transaction), and the size check counts that much. It carries the positions
header too (``POSITIONS_HEADER``: where each of the transaction's records went), counted
at ``POSITION_BYTES`` a record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from transports import ReadBack, Transport
from transports._errors import TransportError

from ..core._errors import ConfigurationError

ID_BYTES = 21
"""The most a row id takes in a progress record: a BIGINT's 19 digits and JSON's ", "."""

PROGRESS_BYTES = 1_000_000
"""The largest progress record counted on: about what a topic made with the cluster's defaults takes."""

PROGRESS_OVERHEAD = 1024
"""A progress record's bytes besides its ids and relay name: key, epoch, JSON, Kafka's per-record share."""


TOPICS_BYTES = 2048
"""The most the topics header's value (the names a transaction writes, comma-separated, the progress
topic's among them) may take: at least eight of Kafka's longest names (249 characters)."""

TOPICS_HEADER_BYTES = len("outbox-txn-topics") + TOPICS_BYTES + 2 * 5
"""What the topics header may add to a progress record: its name, its value, two varint lengths."""

POSITION_BYTES = 6 + 29
"""The most the positions header (``transports.kafka``'s ``POSITIONS_HEADER``) takes per record its
transaction sends: the record's partition by its place (five digits and a comma) and, when the record is
its partition's first, that partition (``topic/partition/offset,``: 2 + 5 + 19 digits, three marks)."""

POSITIONS_HEADER_BYTES = len("outbox-txn-positions") + 1 + 2 * 5
"""The positions header's bytes besides its records': its name, the ``;``, two varint lengths."""


def topics_fitting(topics: Iterable[str], progress_topic: str) -> set[str]:
    """The topics, first come first taken, whose names fit ``TOPICS_BYTES`` beside the progress topic's.

    Every topic fits alone (a name takes 249 bytes at most), so each transaction
    of a shard takes at least one more topic's rows than none; a topic left out
    keeps all its rows for the next transaction, so each key's order holds.
    """
    chosen, size = {progress_topic}, len(progress_topic)
    for topic in topics:
        if topic not in chosen and size + 1 + len(topic) <= TOPICS_BYTES:
            chosen.add(topic)
            size += 1 + len(topic)
    return chosen


def check_progress_fits(transport: Transport, batch_size: int, worker_id: str) -> None:
    """Refuse a ``batch_size`` whose progress record could outgrow what the producer sends.

    A shard's progress record names its rows committed and not known marked: with
    a hot key the whole batch is one shard's, and while a batch's mark is written
    (pipelined) the next batch's record names both. A record the producer or the
    topic refuses aborts every transaction of the shard: nothing of it would ever
    be published. Its topics header counts at its most (``TOPICS_HEADER_BYTES``).
    """
    limit = min(getattr(transport, "max_record_bytes", PROGRESS_BYTES), PROGRESS_BYTES)
    most = largest_batch(limit, worker_id)
    if batch_size > most:
        raise ConfigurationError(
            f"exactly_once with batch_size={batch_size}: a shard's progress record names up to two "
            f"batches of row ids and the batch's again ({ID_BYTES} bytes each), where each of its records "
            f"went (up to {POSITION_BYTES} bytes each) and up to {TOPICS_BYTES} bytes of topic names, "
            f"more than the {limit} bytes a record may take here; use batch_size {max(most, 0)} at most")


def largest_batch(max_record_bytes: int, worker_id: str = "w" * 200) -> int:
    """The largest ``batch_size`` whose progress record fits ``max_record_bytes`` (at most
    ``PROGRESS_BYTES``); by default for the longest relay name, when it is not known yet."""
    limit = min(max_record_bytes, PROGRESS_BYTES)
    fixed = PROGRESS_OVERHEAD + TOPICS_HEADER_BYTES + POSITIONS_HEADER_BYTES + len(worker_id.encode())
    return (limit - fixed) // (3 * ID_BYTES + POSITION_BYTES)


def progress_value(ids: list[int], sent: list[int], relay: str, epoch: int) -> bytes:
    """A progress record's value: the row ids it names, who wrote it, under which lease epoch, and
    ``sent``: the ids of the rows its transaction sends, in the order of their records (``counted``)."""
    return json.dumps({"ids": ids, "sent": sent, "relay": relay, "epoch": epoch}).encode()


def counted(read: ReadBack) -> set[int]:
    """The rows a shard's read-back shows on the wire for read_committed readers: the ids its last
    committed progress record names, and of each transaction after it that did not commit its own
    (its broker split it: the markers of some partitions written, others dropped), the rows it
    carried from before (committed earlier) and the rows whose records are committed.

    A transaction written by an earlier release (no ``sent``, no record positions) counts nothing:
    its rows are sent again, as that release did.
    """
    ids = set(ids_of(read.committed))
    for later in read.after:
        sent = sent_of(later.value)
        if sent is None or later.readable is None or len(sent) != len(later.readable):
            continue
        ids |= set(ids_of(later.value)) - set(sent)
        ids |= {row for row, readable in zip(sent, later.readable, strict=True) if readable}
    return ids


def sent_of(value: bytes) -> list[int] | None:
    """The ids of the rows a progress record's transaction sends, in record order; None when it does
    not say (written by an earlier release, or unreadable)."""
    try:
        parsed: Any = json.loads(value)
        return [int(i) for i in parsed["sent"]]
    except (ValueError, KeyError, TypeError):
        return None


def ids_of(value: bytes | None) -> list[int]:
    """The row ids a progress record names (none when there is none)."""
    if value is None:
        return []
    try:
        parsed: Any = json.loads(value)
        return [int(i) for i in parsed["ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"unreadable progress record: {exc}") from None
