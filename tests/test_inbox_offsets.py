"""The offset tracker: commit only up to the lowest record not yet finished."""

from __future__ import annotations

from outbox.inbox._offsets import OffsetTracker

TP = ("orders", 0)


def test_commits_up_to_the_lowest_unfinished_offset() -> None:
    tracker = OffsetTracker()
    for offset in range(10, 15):
        tracker.received([(TP, offset)])
    assert tracker.committable() == {TP: 10}
    tracker.finished([(TP, 12)])
    tracker.finished([(TP, 11)])
    assert tracker.committable() == {TP: 10}  # 10 still runs: 11 and 12 must wait
    tracker.finished([(TP, 10)])
    assert tracker.committable() == {TP: 13}
    tracker.committed({TP: 13})
    assert tracker.committable() == {}  # nothing moved since
    tracker.finished([(TP, 14), (TP, 13)])  # a batch finishing out of offset order
    assert tracker.committable() == {TP: 15}  # all done: one past the highest received
    assert tracker.lag() == {TP: 2}


def test_partitions_are_independent_and_forgotten_on_revoke() -> None:
    tracker = OffsetTracker()
    other = ("orders", 1)
    tracker.received([(TP, 0)])
    tracker.received([(other, 7)])
    tracker.finished([(other, 7)])
    assert tracker.committable() == {TP: 0, other: 8}
    assert tracker.committable(only=[other]) == {other: 8}
    tracker.forget([TP])
    tracker.finished([(TP, 0)])  # a late finish of a revoked partition is ignored
    assert tracker.committable() == {other: 8}
