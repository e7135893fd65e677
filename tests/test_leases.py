"""``Leases`` on every database: the one read of the live relays and the stored shard count, and the
forgetting of relays long dead (``outbox.relay._leases``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import Outbox, SchemaError, create_engine
from outbox.relay._leases import Leases


@pytest.fixture
def outbox(proof_db_url: str) -> Iterator[Outbox]:
    engine = create_engine(proof_db_url)
    box = Outbox(engine, shards=4)
    box.create_tables()
    yield box
    engine.dispose()


def engine_of(outbox: Outbox) -> sa.Engine:
    assert isinstance(outbox.engine, sa.Engine)
    return outbox.engine


def relays(outbox: Outbox) -> list[str]:
    t = outbox.tables.relays
    with engine_of(outbox).connect() as conn:
        return sorted(conn.scalars(sa.select(t.c.worker_id)))


def test_live_relays_split_the_shards_and_the_long_dead_are_forgotten(outbox: Outbox) -> None:
    t = outbox.tables.relays
    with engine_of(outbox).begin() as conn:  # a relay killed 11 TTLs ago, one that beat 2 TTLs ago
        now = datetime.now(UTC)
        conn.execute(sa.insert(t), [{"worker_id": "dead", "heartbeat_at": now - timedelta(seconds=330)},
                                    {"worker_id": "gone", "heartbeat_at": now - timedelta(seconds=60)}])
    first = Leases(engine_of(outbox), outbox.tables, 4, "a", ttl=30)
    assert len(first.maintain()) == 4  # alone among the live: every shard
    assert relays(outbox) == ["a", "gone"]  # the long dead forgotten, the merely dead kept
    second = Leases(engine_of(outbox), outbox.tables, 4, "b", ttl=30)
    assert second.maintain() == {} and second.share == 2  # a's shards are a's until it gives them back
    first.maintain()
    assert first.share == 2 and first.surplus == 2
    first.release_surplus()
    assert len(second.maintain()) == 2 and len(first.owned()) == 2
    assert set(first.owned()).isdisjoint(second.owned())


def test_a_changed_shard_count_stops_a_running_relay(outbox: Outbox) -> None:
    leases = Leases(engine_of(outbox), outbox.tables, 4, "a", ttl=30)
    assert len(leases.maintain()) == 4
    meta = outbox.tables.meta
    with engine_of(outbox).begin() as conn:
        conn.execute(sa.update(meta).where(meta.c.name == "shard_count").values(value="8"))
    with pytest.raises(SchemaError, match="changed from 4 to 8"):
        leases.maintain()
    assert leases.owned() == {}
