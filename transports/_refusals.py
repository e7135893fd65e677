"""Requests the broker refuses whole, and finding the record that deserved it.

Apache Kafka checks a partition's batch of records (one produce request) as a
unit: a batch over the topic's ``max.message.bytes``, or one holding a record
the topic cannot take (a keyless record on a compacted topic), is refused, and
every record of the batch gets that answer: other keys' records too (seen on
Kafka 4.3: a second key's record in the request of a record over the topic's
limit came back "message size too large"). Such a refusal of a record that
shared its request says nothing about that record. Sent again one per request,
each record gets its own answer, so a poison record fails alone and blocks only
its key; both Kafka transports do that.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._protocol import Outcome, Record, SendResult

NOT_SENT_ALONE = "refused with other records in one request, and not sent again alone in time"
"""The error of a record another's refusal took down, whose turn to go alone did not come in time:
nothing it did, so an unreachable ``RETRY`` (no attempt counted), as any record not sent is."""


def settled(results: Sequence[SendResult | None]) -> int:
    """How many records have a final answer (delivered, or failed for good)."""
    return sum(1 for r in results if r is not None and r.outcome is not Outcome.RETRY)


def resendable(records: Sequence[Record], results: Sequence[SendResult | None]) -> list[int]:
    """Indexes of the records to send again once refused requests were sorted out.

    Each key's records from its first one not delivered, unless that one failed
    (the key stops there); unkeyed records not delivered and not failed. A key
    with a record delivered behind one that was not is left alone: sending the
    earlier one again would write it behind its successor (``hold_behind_undelivered``
    has the relay send the key again from the start instead).
    """
    first: dict[tuple[str, bytes], int] = {}  # key -> index of its first record not delivered
    tangled: set[tuple[str, bytes]] = set()
    for i, (record, result) in enumerate(zip(records, results, strict=True)):
        if record.key is None:
            continue
        key = (record.topic, record.key)
        delivered = result is not None and result.outcome is Outcome.DELIVERED
        if not delivered:
            first.setdefault(key, i)
        elif key in first:
            tangled.add(key)
    again = []
    for i, (record, result) in enumerate(zip(records, results, strict=True)):
        if result is not None and result.outcome is Outcome.DELIVERED:
            continue
        if record.key is None:
            if result is None or result.outcome is Outcome.RETRY:
                again.append(i)
            continue
        key = (record.topic, record.key)
        head = results[first[key]]
        if key not in tangled and (head is None or head.outcome is Outcome.RETRY):
            again.append(i)
    return again
