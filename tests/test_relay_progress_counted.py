"""What a take-over counts as sent from a shard's read-back (``_progress.counted``), without a broker.

The read-back gives the last committed progress record and each later transaction of the shard
that did not commit its own progress record, with which of its data records are committed (the
broker split the commit). Rows whose records are committed are on the wire: counted as sent, each
with the tag of the message the record names it by (None from an earlier release's record).
"""

from __future__ import annotations

import json
import uuid

import pytest

from outbox import TransportError
from outbox.relay._progress import TAG_BYTES, counted, identified, message_tag, named_by, progress_value
from transports import ReadBack, Uncommitted


def tag(row: int) -> str:
    return f"{row:08x}"


def value(ids: list[int], sent: list[int]) -> bytes:
    return progress_value({row: tag(row) for row in ids}, sent, "w", 1)


def tagged(*rows: int) -> dict[int, str | None]:
    return {row: tag(row) for row in rows}


def test_the_last_committed_record_names_what_is_sent() -> None:
    assert counted(ReadBack(value([1, 2], [2]))) == tagged(1, 2)
    assert counted(ReadBack(None)) == {}


def test_a_split_transaction_adds_its_committed_records_and_what_it_carried_from_before() -> None:
    split = Uncommitted(value([1, 2, 5, 6, 7], [7, 5, 6]), (True, False, True))
    assert counted(ReadBack(value([1, 2], [2]), (split,))) == tagged(1, 2, 7, 6)


def test_an_aborted_transaction_adds_only_what_it_carried_from_before() -> None:
    aborted = Uncommitted(value([3, 4], [4]), (False,))
    assert counted(ReadBack(None, (aborted,))) == tagged(3)


def test_a_transaction_of_an_earlier_release_counts_nothing() -> None:
    """No ``sent`` in its value, no positions: its rows are sent again, as that release did."""
    old = b'{"ids": [3, 4], "relay": "w", "epoch": 1}'
    assert counted(ReadBack(value([1], [1]), (Uncommitted(old, None),))) == tagged(1)
    assert counted(ReadBack(None, (Uncommitted(old, (True, True)),))) == {}


def test_positions_that_do_not_match_the_rows_count_nothing() -> None:
    assert counted(ReadBack(None, (Uncommitted(value([3, 4], [3, 4]), (True,)),))) == {}


def test_a_record_of_an_earlier_release_names_ids_only() -> None:
    """No ``tags``: its rows are taken by id, as that release took them (``_shard_producer``)."""
    old = b'{"ids": [3, 4], "sent": [4], "relay": "w", "epoch": 1}'
    assert counted(ReadBack(old)) == {3: None, 4: None}
    split = Uncommitted(old, (True,))
    assert counted(ReadBack(value([1], [1]), (split,))) == {1: tag(1), 3: None, 4: None}


def test_tags_that_do_not_match_the_ids_are_an_unreadable_record() -> None:
    with pytest.raises(TransportError, match="unreadable progress record"):
        named_by(b'{"ids": [3, 4], "tags": "0000000a", "sent": [], "relay": "w", "epoch": 1}')


def test_a_tag_tells_messages_of_one_minute_apart() -> None:
    """The relay's message ids are UUIDv7: two of one minute share their first 8 hex digits, the top of
    their clock. Their tags differ; each id's text tags alike (MySQL reads one back without dashes)."""
    first, second = uuid.UUID("01a2497f-67d0-716b-bae8-895b3fcd0ad2"), uuid.UUID(
        "01a2497f-67ce-7ff1-923e-39ad5d7d1afb")
    assert str(first)[:8] == str(second)[:8]
    assert message_tag(first) != message_tag(second)
    assert message_tag(first) == message_tag(first.hex) == message_tag(str(first).upper())
    assert len(message_tag(first)) == TAG_BYTES


def test_a_take_over_marks_a_named_row_only_where_it_holds_the_message_named() -> None:
    """``identified``: the database's rows of the ids named, with their messages' tags. A row of
    another message under a named id (a restored copy's new row) is left to be sent; a row gone
    (retention) is not marked; a record of an earlier release takes its rows by id, tagged as the
    database has them."""
    named: dict[int, str | None] = {1: tag(1), 2: tag(2), 3: tag(3)}
    assert identified(named, {1: tag(1), 2: "ffffffff"}) == ({1: tag(1)}, [2])  # 3 gone
    assert identified({4: None, 5: None}, {4: "0000abcd"}) == ({4: "0000abcd"}, [])
    assert identified({}, {1: tag(1)}) == ({}, [])  # a row not named is nothing of the take-over's


def test_a_relay_of_the_previous_release_reads_a_new_record_as_it_did() -> None:
    """It read ``ids`` and ``sent`` and nothing else: the tags beside them change nothing for it."""
    parsed = json.loads(progress_value({7: tag(7), 3: tag(3)}, [7], "w", 2))
    assert (parsed["ids"], parsed["sent"], parsed["relay"], parsed["epoch"]) == ([3, 7], [7], "w", 2)
