"""Sending a batch in waves: how the per-key contract is kept without client help.

Wave 1 holds the first record of every key and every unkeyed record; wave n
holds the n-th record of each key whose records 1..n-1 were all delivered. A
key is a (topic, key bytes) pair: the same key bytes on two topics are two
independent streams, and one topic's failure never holds the other back. A
record is thus never written while an earlier record of its key is
unacknowledged, whatever the broker or client retries do, and a failed record
can never be overtaken by its successor. Keys rarely repeat inside one batch,
so most batches are a single wave.

A hot key (one key with many records in a batch) costs one broker round trip
per record this way; ``KafkaTransport`` pipelines instead, on librdkafka's
gap-less idempotent producer, and only shares ``hold_behind_undelivered`` with
this module. The kafka-python-ng transport keeps waves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._partitioner import partition_for_key
from ._protocol import Outcome, Record, SendResult

NOT_SENT = "not sent: an earlier record of this key was not delivered"
NO_REPORT = "no delivery report in time"

# send_wave(indexes, results): send records[i] for i in indexes and fill results[i].
SendWave = Callable[[list[int], list[SendResult | None]], None]


def waves(records: Sequence[Record]) -> list[list[int]]:
    """Record indexes grouped so wave n holds the n-th record of each key."""
    grouped: list[list[int]] = [[]]
    seen: dict[tuple[str, bytes], int] = {}
    for i, record in enumerate(records):
        if record.key is None:
            grouped[0].append(i)
            continue
        key = (record.topic, record.key)
        n = seen.get(key, 0)
        seen[key] = n + 1
        if n == len(grouped):
            grouped.append([])
        grouped[n].append(i)
    return grouped


def key_partition(record: Record, counts: dict[str, int | SendResult],
                  lookup: Callable[[str], int | SendResult]) -> int | SendResult | None:
    """The partition Kafka's Java client picks for ``record``'s key; None if unkeyed.

    ``counts`` caches ``lookup(topic)`` (a partition count, or the error looking it
    up as a result) for one wave, so a down broker costs one lookup per topic, not
    one per record.
    """
    if record.key is None:
        return None
    count = counts.get(record.topic)
    if count is None:
        count = counts[record.topic] = lookup(record.topic)
    return count if isinstance(count, SendResult) else partition_for_key(record.key, count)


def hold_behind_undelivered(records: Sequence[Record],
                            results: Sequence[SendResult | None]) -> list[SendResult]:
    """Final results: after a key's first record that is not delivered, its later ones are ``RETRY``.

    A later record reported delivered behind an undelivered one is turned into
    ``RETRY`` too: the relay then sends the key again from its first undelivered
    record, so its successors are written again behind it (a duplicate, which
    the contract allows), never counted as done ahead of it. A held record is
    as unreachable as the one that held it, so an outage costs no attempt.
    A missing result (no report in time) is an unreachable ``RETRY``.
    """
    final: list[SendResult] = []
    blocked: dict[tuple[str, bytes], bool] = {}  # key -> its failure was unreachable
    for record, result in zip(records, results, strict=True):
        if result is None:
            result = SendResult(Outcome.RETRY, error=NO_REPORT, unreachable=True)
        if record.key is not None:
            key = (record.topic, record.key)
            if key in blocked:
                result = SendResult(Outcome.RETRY, error=NOT_SENT, unreachable=blocked[key])
            elif result.outcome is not Outcome.DELIVERED:
                blocked[key] = result.unreachable
        final.append(result)
    return final


def publish_in_waves(records: Sequence[Record], send_wave: SendWave) -> list[SendResult]:
    """Run ``send_wave`` per wave, skipping keys already not delivered; results in input order."""
    results: list[SendResult | None] = [None] * len(records)
    blocked: dict[tuple[str, bytes | None], bool] = {}  # key -> its failure was unreachable
    for wave in waves(records):
        sendable = []
        for i in wave:
            if (records[i].topic, records[i].key) in blocked:
                # Not sent: as unreachable as the record of its key that held it back.
                results[i] = SendResult(Outcome.RETRY, error=NOT_SENT,
                                        unreachable=blocked[records[i].topic, records[i].key])
            else:
                sendable.append(i)
        if not sendable:
            continue
        send_wave(sendable, results)
        for i in sendable:
            result = results[i]
            record = records[i]
            if record.key is not None and (result is None or result.outcome is not Outcome.DELIVERED):
                blocked[record.topic, record.key] = result is None or result.unreachable
    return hold_behind_undelivered(records, results)
