"""The progress record of exactly-once mode: what it names, how it is read, and how big it may grow.

One record per shard transaction (``_exactly_once``): the ids of the shard's rows
committed and not known to be marked, and what each of those rows is (``tags``: a tag of
its message id, ``message_tag``), the ids its own transaction sends in the order of their
records (``sent``), the relay that wrote it and its lease epoch, as JSON. A take-over
reads the last committed one and marks those rows without sending them again, each only
while the row of its id in the database holds the message the record names
(``_shard_producer``: a database restored from a backup gives the ids its original sent
to other messages); a later transaction the broker split (its progress record's marker
dropped, some data records' written) adds the rows whose records are committed
(``counted``). The record grows with ``batch_size`` (ids and tags, not record bytes):
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

import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from transports import ReadBack, Transport
from transports._errors import TransportError

from ..core._errors import ConfigurationError

ID_BYTES = 21
"""The most a row id takes in a progress record: a BIGINT's 19 digits and JSON's ", "."""

TAG_BYTES = 8
"""What a row's tag takes in a progress record: 8 hex digits (32 bits) of its message id's hash, in
one string parallel to the ids (``message_tag``)."""

UNKNOWN_TAG = "-" * TAG_BYTES
"""The tag of a row whose message is not known (its record carried no message id): no row's tag
(``message_tag`` is hex), so a take-over sends that row again rather than mark it unsent."""

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

    A shard's progress record names its rows committed and not known marked, each with its
    message's tag (``TAG_BYTES``): with
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
            f"batches of row ids ({ID_BYTES} bytes each) with a {TAG_BYTES}-byte tag of each one's message, "
            f"the batch's ids again, where each of its records "
            f"went (up to {POSITION_BYTES} bytes each) and up to {TOPICS_BYTES} bytes of topic names, "
            f"more than the {limit} bytes a record may take here; use batch_size {max(most, 0)} at most")


def largest_batch(max_record_bytes: int, worker_id: str = "w" * 200) -> int:
    """The largest ``batch_size`` whose progress record fits ``max_record_bytes`` (at most
    ``PROGRESS_BYTES``); by default for the longest relay name, when it is not known yet."""
    limit = min(max_record_bytes, PROGRESS_BYTES)
    fixed = PROGRESS_OVERHEAD + TOPICS_HEADER_BYTES + POSITIONS_HEADER_BYTES + len(worker_id.encode())
    return (limit - fixed) // (3 * ID_BYTES + 2 * TAG_BYTES + POSITION_BYTES)


def message_tag(message_id: uuid.UUID | str) -> str:
    """What a progress record names a row's message by: 8 hex digits of a hash of its id's canonical text.

    A hash, not the id's first digits: the relay's ids are UUIDv7, whose first 8 hex digits are the
    top of a millisecond clock, the same for every message of about a minute (those of a restored
    copy and of its original alike). Another message's row passes for the one named only by a 2^-32
    coincidence per row.
    """
    text = str(message_id)
    try:
        text = str(uuid.UUID(text))  # MySQL's CHAR(32) reads back without dashes
    except ValueError:
        text = text.lower()
    return hashlib.blake2b(text.encode(), digest_size=TAG_BYTES // 2).hexdigest()


def progress_value(named: Mapping[int, str], sent: list[int], relay: str, epoch: int) -> bytes:
    """A progress record's value: the row ids it names in id order with the tag of each one's message
    (``message_tag``, one string of ``TAG_BYTES`` a row), who wrote it, under which lease epoch, and
    ``sent``: the ids of the rows its transaction sends, in the order of their records (``counted``)."""
    ids = sorted(named)
    return json.dumps({"ids": ids, "tags": "".join(named[i] for i in ids), "sent": sent, "relay": relay,
                       "epoch": epoch}).encode()


def counted(read: ReadBack) -> dict[int, str | None]:
    """The rows a shard's read-back shows on the wire for read_committed readers, each with the tag of
    the message the record names it by (None: a record of an earlier release, which names ids only):
    the rows its last committed progress record names, and of each transaction after it that did not
    commit its own (its broker split it: the markers of some partitions written, others dropped), the
    rows it carried from before (committed earlier) and the rows whose records are committed.

    A transaction written by an earlier release (no ``sent``, no record positions) counts nothing:
    its rows are sent again, as that release did.
    """
    rows = named_by(read.committed)
    for later in read.after:
        sent = sent_of(later.value)
        if sent is None or later.readable is None or len(sent) != len(later.readable):
            continue
        carried = named_by(later.value)
        on_wire = set(carried) - set(sent)
        on_wire |= {row for row, readable in zip(sent, later.readable, strict=True) if readable}
        rows.update((row, carried.get(row)) for row in on_wire)
    return rows


def identified(named: Mapping[int, str | None], held: Mapping[int, str]) -> tuple[dict[int, str], list[int]]:
    """Of the rows a progress read names (``counted``), those whose ids this database's rows (``held``:
    id and message tag, of the rows there are) hold the messages named, with their tags; and the ids
    whose rows hold other messages.

    A row of another message under a named id was never sent: the record is another database's
    (one restored from a backup and the original keep one incarnation, so one transactional id). A
    row gone (retention deletes published rows) needs nothing. A record of an earlier release names
    ids only (None): its rows are taken as named, the tags this database's.
    """
    ours = {row: tag for row, tag in held.items() if row in named and named[row] in (None, tag)}
    return ours, sorted(row for row in held if row in named and row not in ours)


def sent_of(value: bytes) -> list[int] | None:
    """The ids of the rows a progress record's transaction sends, in record order; None when it does
    not say (written by an earlier release, or unreadable)."""
    try:
        parsed: Any = json.loads(value)
        return [int(i) for i in parsed["sent"]]
    except (ValueError, KeyError, TypeError):
        return None


def named_by(value: bytes | None) -> dict[int, str | None]:
    """The row ids a progress record names, each with its message's tag (none when there is no record;
    None tags when it was written by an earlier release, which names ids only)."""
    if value is None:
        return {}
    try:
        parsed: Any = json.loads(value)
        ids = [int(i) for i in parsed["ids"]]
        tags = parsed.get("tags")
        if tags is None:
            return dict.fromkeys(ids)
        if not isinstance(tags, str) or len(tags) != TAG_BYTES * len(ids):
            raise ValueError(f"{len(ids)} ids but tags of {len(tags)} characters")
        return {row: tags[TAG_BYTES * n:TAG_BYTES * (n + 1)] for n, row in enumerate(ids)}
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"unreadable progress record: {exc}") from None
