"""The topics an exactly-once shard's transactions wrote, kept in its lease row (``relay._unsettled``).

What must outlive a relay process: the topics are in the row before the send, they survive the
lease changing hands (the next owner reads them at its take-over), only the owner at its epoch
writes or empties them, and the row is emptied only by the settle's confirmation. On SQLite,
PostgreSQL and MariaDB: each statement is each database's own SQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from outbox import Outbox, create_engine
from outbox.cli import app
from outbox.relay import shard_leases
from outbox.relay._leases import Leases
from outbox.relay._unsettled import UnsettledTopics


@pytest.fixture
def outbox(proof_db_url: str) -> Iterator[Outbox]:
    engine = create_engine(proof_db_url)
    box = Outbox(engine, shards=2)
    box.create_tables()
    yield box
    engine.dispose()


def reshard(url: str, shards: int) -> None:
    """``outbox init-db --reshard``, as an operator runs it (every relay stopped, every row settled)."""
    result = CliRunner().invoke(app, ["init-db", "--db", url, "--reshard", str(shards)])
    assert result.exit_code == 0, result.output


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


def test_a_reshard_keeps_the_topics_a_kept_shards_row_names(outbox: Outbox, proof_db_url: str) -> None:
    """``reshard`` (all relays stopped, every row settled or skipped) recreated the lease rows: a kept
    shard's row (the same transactional id: the incarnation and the shard number) lost the topics its
    transactions may have left open, so the next owner's take-over settled nothing there, and its first
    commit on such a partition would end those records committed (attack of 2026-12-05)."""
    first = leases_of(outbox, "a")
    owned = first.maintain()
    rows = UnsettledTopics(first)
    assert rows.widen({0: (owned[0], {"orders"}), 1: (owned[1], {"payments"})}) == {0, 1}
    first.release_all()  # stopped while its settle failed: the row names the topics
    reshard(proof_db_url, 4)
    second = Leases(outbox.engine, outbox.tables, 4, "b", ttl=30)
    taken = second.maintain()
    assert sorted(taken) == [0, 1, 2, 3]
    theirs = UnsettledTopics(second)
    assert theirs.taken(0, taken[0]) == {"orders"}
    assert theirs.taken(1, taken[1]) == {"payments"}
    assert theirs.taken(2, taken[2]) == frozenset()


def test_a_shard_removed_by_a_reshard_names_its_topics_again_when_a_later_reshard_brings_it_back(
        outbox: Outbox, proof_db_url: str) -> None:
    """A shard removed by ``reshard`` (2 -> 1) keeps its transactional id's name: brought back
    (1 -> 2), its next owner's take-over must still end what its transactions may have left open.
    ``reshard`` deleted the removed shard's row, and the topics it named, with it; it keeps it now,
    and no relay leases it while the count leaves it out."""
    first = leases_of(outbox, "a")
    owned = first.maintain()
    assert UnsettledTopics(first).widen({1: (owned[1], {"payments"})}) == {1}
    first.release_all()
    reshard(proof_db_url, 1)
    leases = outbox.tables.leases
    with outbox.engine.begin() as conn:  # shard 0 leased by a relay gone quiet: only shard 1's row is free
        conn.execute(sa.update(leases).where(leases.c.shard == 0).values(
            owner="gone", expires_at=datetime.now(UTC) + timedelta(hours=1)))
    alone = Leases(outbox.engine, outbox.tables, 1, "c", ttl=30)
    assert alone.maintain() == {}  # shard 1's row is kept, and not leased while the count leaves it out
    alone.release_all()
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(leases).where(leases.c.shard == 0).values(owner=None))
    assert [lease.shard for lease in shard_leases(outbox, 1)[0]] == [0]
    reshard(proof_db_url, 2)
    second = leases_of(outbox, "b")
    taken = second.maintain()
    assert UnsettledTopics(second).taken(1, taken[1]) == {"payments"}


def test_a_widen_racing_a_take_over_is_either_fenced_or_read_by_the_new_owner(proof_db_url: str) -> None:
    """Angle of the 2026-12-05 attack: the owner's lease lapsed (not taken yet) while it widens its row,
    and another relay takes the shard at the same moment. Either the widen is fenced (the owner then
    sends nothing), or the new owner's take-over reads the topic: never a widen that held and a
    take-over that read a row without it. Repeated, both started together (a barrier)."""
    engine = create_engine(proof_db_url)
    try:
        box = Outbox(engine, shards=2)
        box.create_tables()
        leases = box.tables.leases
        first = leases_of(box, "a")
        assert sorted(first.maintain()) == [0, 1]
        rows = UnsettledTopics(first)
        for _ in range(30):
            with engine.begin() as conn:
                conn.execute(sa.update(leases).where(leases.c.shard == 0).values(
                    owner="a", epoch=100, unsettled_topics=None, expires_at=datetime(2000, 1, 1, tzinfo=UTC)))
            second = leases_of(box, "b")
            barrier = threading.Barrier(2)
            widened: list[set[int]] = []

            def widen(into: list[set[int]] = widened, at: threading.Barrier = barrier) -> None:
                at.wait()
                into.append(rows.widen({0: (100, {"orders"})}))

            thread = threading.Thread(target=widen)
            thread.start()
            barrier.wait()
            taken = second.maintain()
            thread.join()
            if 0 in taken:
                named = UnsettledTopics(second).taken(0, taken[0])
                assert named is not None
                if widened[0] == {0}:
                    assert "orders" in named
            second.release_all()
    finally:
        engine.dispose()
