"""The topics an exactly-once shard's transactions wrote, kept in its lease row (``relay._unsettled``).

What must outlive a relay process: the topics are in the row before the send, they survive the
lease changing hands (the next owner reads them at its take-over), only the owner at its epoch
writes or empties them, and the row is emptied only by the settle's confirmation. On SQLite,
PostgreSQL and MariaDB: each statement is each database's own SQL.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import Outbox, create_engine
from outbox.relay._leases import Leases
from outbox.relay._unsettled import UnsettledTopics


@pytest.fixture
def outbox(proof_db_url: str) -> Iterator[Outbox]:
    engine = create_engine(proof_db_url)
    box = Outbox(engine, shards=2)
    box.create_tables()
    yield box
    engine.dispose()


def leases_of(box: Outbox, worker: str) -> Leases:
    assert isinstance(box.engine, sa.Engine)
    return Leases(box.engine, box.tables, 2, worker, ttl=30)


def test_topics_widened_by_one_owner_are_what_the_next_owner_reads_and_only_its_settle_empties(
        outbox: Outbox) -> None:
    first = leases_of(outbox, "a")
    owned = first.maintain()
    assert sorted(owned) == [0, 1]
    rows = UnsettledTopics(first)
    assert rows.taken(0, owned[0]) == frozenset()  # a new row names nothing
    assert rows.widen({0: (owned[0], {"orders", "payments"}), 1: (owned[1], {"orders"})}) == {0, 1}
    assert rows.taken(0, owned[0]) == {"orders", "payments"}
    # An epoch this relay does not hold writes nothing and empties nothing.
    assert rows.widen({0: (owned[0] + 1, {"other"})}) == set()
    assert rows.settled(1, owned[1] + 1) is False
    assert rows.taken(1, owned[1]) == {"orders"}

    first.release_all()  # the relay stops (or dies: its leases expire); the rows keep the topics
    second = leases_of(outbox, "b")
    taken = second.maintain()
    assert sorted(taken) == [0, 1] and taken[0] > owned[0]
    theirs = UnsettledTopics(second)
    assert theirs.taken(0, taken[0]) == {"orders", "payments"}
    # The old owner, woken up, can neither read, widen nor empty the new owner's row.
    assert rows.taken(0, owned[0]) is None
    assert rows.widen({0: (owned[0], {"orders"})}) == set()
    assert rows.settled(0, owned[0]) is False
    assert theirs.taken(0, taken[0]) == {"orders", "payments"}
    # The new owner's settle empties it; its next send names what it writes then.
    assert theirs.settled(0, taken[0]) is True
    assert theirs.taken(0, taken[0]) == frozenset()
    assert theirs.widen({0: (taken[0], {"audit"})}) == {0}
    assert theirs.taken(0, taken[0]) == {"audit"}
    assert theirs.taken(1, taken[1]) == {"orders"}  # shard 1 not settled yet: kept


def test_a_reshard_keeps_the_topics_a_kept_shards_row_names(outbox: Outbox) -> None:
    """``reshard`` (all relays stopped, every row settled or skipped) recreated the lease rows: a kept
    shard's row (the same transactional id: the incarnation and the shard number) lost the topics its
    transactions may have left open, so the next owner's take-over settled nothing there, and its first
    commit on such a partition would end those records committed (attack of 2026-12-05)."""
    from outbox.core._schema import reshard

    first = leases_of(outbox, "a")
    owned = first.maintain()
    rows = UnsettledTopics(first)
    assert rows.widen({0: (owned[0], {"orders"}), 1: (owned[1], {"payments"})}) == {0, 1}
    first.release_all()  # stopped while its settle failed: the row names the topics
    assert isinstance(outbox.engine, sa.Engine)
    assert reshard(outbox.engine, outbox.tables, 4, lease_ttl=0.0) == 2
    second = Leases(outbox.engine, outbox.tables, 4, "b", ttl=30)
    taken = second.maintain()
    assert sorted(taken) == [0, 1, 2, 3]
    theirs = UnsettledTopics(second)
    assert theirs.taken(0, taken[0]) == {"orders"}
    assert theirs.taken(1, taken[1]) == {"payments"}
    assert theirs.taken(2, taken[2]) == frozenset()
