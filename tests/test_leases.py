"""``Leases`` on every database: the one read of the live relays and the stored shard count, and the
forgetting of relays long dead (``outbox.relay._leases``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _relay_helpers import publish

from outbox import Outbox, Relay, SchemaError, create_engine
from outbox.relay._leases import Leases
from transports.memory import InMemoryBroker, InMemoryTransport


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


def test_a_relay_frozen_inside_its_renewal_does_not_hold_the_relay_that_takes_its_shards(
        postgres_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay frozen between its renewal's UPDATE and its COMMIT (SIGSTOP, a VM stall) holds its lease
    rows locked: the relay that takes them once they expired would wait on them for as long as it
    sleeps. PostgreSQL ends a lease transaction left idle for a TTL (``Leases._locking``)."""
    engine = create_engine(postgres_db)
    box = Outbox(engine, shards=2)
    box.create_tables()
    zombie = Leases(engine, box.tables, 2, "zombie", ttl=1.0)
    assert zombie.maintain() == {0: 1, 1: 1}
    frozen, thaw = threading.Event(), threading.Event()
    real_renew = zombie._renew

    def renew_then_freeze(conn: sa.Connection, expires: datetime) -> list[tuple[int, int]]:
        renewed = real_renew(conn, expires)
        frozen.set()  # its lease rows locked, its COMMIT not sent
        thaw.wait(60)
        return renewed

    monkeypatch.setattr(zombie, "_renew", renew_then_freeze)
    ended: list[BaseException | None] = []

    def run_zombie() -> None:
        try:
            zombie.maintain()
            ended.append(None)
        except BaseException as exc:  # its connection ended under it
            ended.append(exc)

    worker = threading.Thread(target=run_zombie, daemon=True)
    worker.start()
    taker = Leases(engine, box.tables, 2, "taker", ttl=1.0)
    taken: list[dict[int, int]] = []
    stop = threading.Event()

    def take() -> None:
        while not stop.is_set() and len(taken[-1] if taken else {}) < 2:
            taken.append(taker.maintain())
            stop.wait(0.2)

    taking = threading.Thread(target=take, daemon=True)
    try:
        assert frozen.wait(30)
        taking.start()
        deadline = time.monotonic() + 20
        while not (taken and len(taken[-1]) == 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert taken and taken[-1] == {0: 2, 1: 2}, f"the taker holds {taken[-1] if taken else None}"
    finally:
        thaw.set()  # without the bound, the taker waits for this
        stop.set()
        worker.join(30)
        taking.join(30)
    assert isinstance(ended[0], sa.exc.DBAPIError) and getattr(ended[0].orig, "sqlstate", None) == "25P03"
    engine.dispose()


@pytest.mark.postgres
def test_a_lease_ttl_past_what_postgresql_bounds_an_idle_transaction_by_still_relays(pg: sa.Engine) -> None:
    """A relay's lease and mark transactions end themselves when left idle for a lease TTL
    (``idle_in_transaction_session_timeout``), which PostgreSQL takes up to 2^31-1 ms (~24.8 days). A
    lease TTL of 30 days worked before that bound existed; with it uncapped, PostgreSQL refused the
    SET LOCAL of every lease and mark transaction, and such a relay could neither hold a lease nor
    mark a row. The bound is capped instead."""
    box = Outbox(pg, shards=2)
    box.create_tables()
    month = 30 * 24 * 3600.0
    leases = Leases(pg, box.tables, 2, "patient", ttl=month)
    assert leases.maintain() == {0: 1, 1: 1}
    leases.release_all()
    publish(box, "orders", ["k"])
    broker = InMemoryBroker()
    relay = Relay(box, InMemoryTransport(broker), worker_id="patient-relay", lease_ttl=month)
    try:
        batch = relay.run_once()
    finally:
        relay.close()
    assert (batch.fetched, batch.published) == (1, 1), batch
    assert len(broker.records("orders")) == 1
