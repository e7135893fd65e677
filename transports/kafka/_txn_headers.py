"""The two headers of a transaction's last record: which topics it wrote, and where each record went.

``TOPICS_HEADER`` lets a later producer of the id end a transaction the broker left open on
every partition of those topics (``KafkaTransactionalProducer.end_left_open``);
``POSITIONS_HEADER`` lets a read-back tell the committed records from the others when the
broker split a commit (``_read_back.read_back``). Written by the producer, read by the
read-back: neither needs the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .._protocol import Record

TOPICS_HEADER = "outbox-txn-topics"
"""Header of a transaction's last record: the topics the transaction writes, comma-separated."""

POSITIONS_HEADER = "outbox-txn-positions"
"""Header of a transaction's last record: the partition and offset of each of its other records
(``with_positions``), so a read-back can tell which are committed when the broker split it."""


def with_topics(records: Sequence[Record]) -> Sequence[Record]:
    """``records``, the last one carrying ``TOPICS_HEADER``: the topics of all of them."""
    if not records:
        return records
    topics = ",".join(sorted({r.topic for r in records})).encode()
    last = records[-1]
    headers = [(n, v) for n, v in last.headers if n != TOPICS_HEADER] + [(TOPICS_HEADER, topics)]
    return [*records[:-1], replace(last, headers=headers)]


def with_positions(records: Sequence[Record], delivered: Sequence[Any]) -> Sequence[Record]:
    """``records``, the last one carrying ``POSITIONS_HEADER``: where each of the others went.

    ``delivered``: their delivery reports' messages, in order. The value names each partition
    written, ``topic/partition/offset`` (the topic by its place in ``TOPICS_HEADER``'s sorted list,
    the offset the transaction's first record there), then, after ``;``, each record's partition
    by its place in that list: ``0/3/1200,1/0/87;0,0,1``.
    """
    topics = {t: i for i, t in enumerate(sorted({r.topic for r in records}))}
    places: dict[tuple[str, int], int] = {}
    firsts: list[str] = []
    order: list[str] = []
    for message in delivered:
        where = (message.topic(), message.partition())
        place = places.get(where)
        if place is None:  # the first of the partition's in produce order: its lowest offset there
            place = places[where] = len(firsts)
            firsts.append(f"{topics[where[0]]}/{where[1]}/{message.offset()}")
        order.append(str(place))
    last = records[-1]
    headers = [(n, v) for n, v in last.headers if n != POSITIONS_HEADER]
    headers.append((POSITIONS_HEADER, f"{','.join(firsts)};{','.join(order)}".encode()))
    return [*records[:-1], replace(last, headers=headers)]


def positions_of(topics: bytes, positions: bytes) -> tuple[list[tuple[str, int, int]], list[int]]:
    """A ``POSITIONS_HEADER``'s partitions (topic, partition, the transaction's first offset there),
    and each record's partition by its place among them (``topics``: the ``TOPICS_HEADER`` beside it).
    Raises ``ValueError`` if it is not one."""
    names = sorted(t for t in topics.decode().split(",") if t)
    firsts, _, order = positions.decode().partition(";")
    partitions = []
    for first in filter(None, firsts.split(",")):
        topic, partition, offset = first.split("/")
        partitions.append((names[int(topic)], int(partition), int(offset)))
    places = [int(p) for p in order.split(",") if p]
    if any(not 0 <= p < len(partitions) for p in places):
        raise ValueError(f"a record's partition is not among the {len(partitions)} named")
    return partitions, places
