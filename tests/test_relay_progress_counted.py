"""What a take-over counts as sent from a shard's read-back (``_progress.counted``), without a broker.

The read-back gives the last committed progress record and each later transaction of the shard
that did not commit its own progress record, with which of its data records are committed (the
broker split the commit). Rows whose records are committed are on the wire: counted as sent.
"""

from __future__ import annotations

from outbox.relay._progress import counted, progress_value
from transports import ReadBack, Uncommitted


def value(ids: list[int], sent: list[int]) -> bytes:
    return progress_value(ids, sent, "w", 1)


def test_the_last_committed_record_names_what_is_sent() -> None:
    assert counted(ReadBack(value([1, 2], [2]))) == {1, 2}
    assert counted(ReadBack(None)) == set()


def test_a_split_transaction_adds_its_committed_records_and_what_it_carried_from_before() -> None:
    split = Uncommitted(value([1, 2, 5, 6, 7], [7, 5, 6]), (True, False, True))
    assert counted(ReadBack(value([1, 2], [2]), (split,))) == {1, 2, 7, 6}


def test_an_aborted_transaction_adds_only_what_it_carried_from_before() -> None:
    aborted = Uncommitted(value([3, 4], [4]), (False,))
    assert counted(ReadBack(None, (aborted,))) == {3}


def test_a_transaction_of_an_earlier_release_counts_nothing() -> None:
    """No ``sent`` in its value, no positions: its rows are sent again, as that release did."""
    old = b'{"ids": [3, 4], "relay": "w", "epoch": 1}'
    assert counted(ReadBack(value([1], [1]), (Uncommitted(old, None),))) == {1}
    assert counted(ReadBack(None, (Uncommitted(old, (True, True)),))) == set()


def test_positions_that_do_not_match_the_rows_count_nothing() -> None:
    assert counted(ReadBack(None, (Uncommitted(value([3, 4], [3, 4]), (True,)),))) == set()
