"""The positions header of a transaction's last record, without a broker: whatever topics (any name
Kafka takes, up to 249 characters of letters, digits, '.', '_' and '-'), partitions and offsets the
records went to, in any order, ``positions_of`` gives back each record's partition and the
transaction's first offset there, as a take-over's read-back needs them (``_read_back._positions``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from transports import Record
from transports.kafka._txn_headers import (
    POSITIONS_HEADER,
    TOPICS_HEADER,
    positions_of,
    with_positions,
    with_topics,
)


@dataclass
class Delivered:
    """A delivery report's message, as ``with_positions`` reads it."""

    where: tuple[str, int]
    at: int

    def topic(self) -> str:
        return self.where[0]

    def partition(self) -> int:
        return self.where[1]

    def offset(self) -> int:
        return self.at


names = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", min_size=1,
                max_size=249).filter(lambda t: t not in {".", ".."})


@st.composite
def transactions(draw: st.DrawFn) -> tuple[str, list[tuple[str, int]], dict[tuple[str, int], int]]:
    topics = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    progress = draw(names)
    records = draw(st.lists(st.tuples(st.sampled_from(topics), st.integers(0, 99_999)), min_size=1,
                            max_size=40))
    starts = {where: draw(st.integers(0, 2**63 - 1 - len(records))) for where in set(records)}
    return progress, records, starts


@settings(max_examples=300, deadline=None)
@given(transactions(), st.lists(st.tuples(st.sampled_from(["outbox-txn-positions", "OUTBOX-TXN-TOPICS",
                                                           "x"]), st.binary(max_size=8)), max_size=3))
def test_each_record_is_named_at_its_partition_and_the_transactions_first_offset_there(
        transaction: tuple[str, list[tuple[str, int]], dict[tuple[str, int], int]],
        user_headers: list[tuple[str, bytes]]) -> None:
    progress, placed, starts = transaction
    data = [Record(t, b"row", key=b"k", partition=p, headers=list(user_headers)) for t, p in placed]
    records = with_topics([*data, Record(progress, b"{}", key=b"tid", partition=0)])
    next_offset = dict(starts)
    delivered = []
    for where in placed:
        delivered.append(Delivered(where, next_offset[where]))
        next_offset[where] += 1
    last = with_positions(records, delivered)[-1]
    headers = dict(last.headers)
    partitions, places = positions_of(headers[TOPICS_HEADER], headers[POSITIONS_HEADER])
    assert [partitions[p][:2] for p in places] == placed
    assert {(t, p): o for t, p, o in partitions} == starts
    assert [n for n, _ in last.headers].count(POSITIONS_HEADER) == 1
    assert all(r.headers == user_headers for r in with_positions(records, delivered)[:-1])
