"""``Leases`` on every database: the one read of the live relays and the stored shard count, and the
forgetting of relays long dead (``outbox.relay._leases``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, publish, wait_for

from outbox import Outbox, Relay, SchemaError, create_engine
from outbox.relay._leases import SHARDS_AT_ONCE, Leases
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


def statements_of(engine: sa.Engine, run: Callable[[], object]) -> list[str]:
    """The statements ``engine`` sent while ``run()`` ran."""
    sent: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        sent.append(statement.lstrip().upper())

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    return sent


def held(outbox: Outbox) -> dict[int, tuple[str | None, int]]:
    """Shard -> (owner, epoch), as stored."""
    t = outbox.tables.leases
    with engine_of(outbox).connect() as conn:
        rows = conn.execute(sa.select(t.c.shard, t.c.owner, t.c.epoch))
        return {shard: (owner, epoch) for shard, owner, epoch in rows}


@pytest.mark.parametrize("shards", [16, 1024])
def test_a_release_is_a_statement_for_many_shards_not_one_a_shard(proof_db_url: str, shards: int) -> None:
    """A fleet stopping gives back every tenant's leases within ``RELEASE_WITHIN``: at one UPDATE a
    shard, 500 tenants of 16 shards on one PostgreSQL took 5.4-6.0 s. One UPDATE for up to
    ``SHARDS_AT_ONCE`` shards, and the membership row, in one transaction."""
    engine = create_engine(proof_db_url)
    box = Outbox(engine, shards=shards)
    box.create_tables()
    try:
        leases = Leases(engine, box.tables, shards, "a", ttl=60)
        assert len(leases.maintain()) == shards
        sent = statements_of(engine, leases.release_all)
        updates = [s for s in sent if s.startswith("UPDATE")]
        assert len(updates) == -(-shards // SHARDS_AT_ONCE), updates
        assert [s.split()[0] for s in sent if s.split()[0] in ("UPDATE", "DELETE", "COMMIT")] == [
            "DELETE", *["UPDATE"] * len(updates)], sent  # the relay's row first: a heartbeat's order
        assert leases.owned() == {} and relays(box) == []
        assert all(owner is None for owner, _ in held(box).values())
    finally:
        engine.dispose()


def test_a_release_gives_back_only_the_shards_it_holds_at_the_epoch_it_holds_them(outbox: Outbox) -> None:
    """The fence of a release: a shard another relay took once this one's lease expired (a stall)
    stays the other's, and one this relay's id holds at another epoch (a namesake took it again
    since) stays where it is."""
    engine = engine_of(outbox)
    a = Leases(engine, outbox.tables, 4, "a", ttl=60)
    assert a.maintain() == {0: 1, 1: 1, 2: 1, 3: 1}
    t = outbox.tables.leases
    with engine.begin() as conn:  # a stalled: its leases of 1 and 3 expired, and b takes them
        conn.execute(sa.update(t).where(t.c.shard.in_([1, 3]))
                     .values(expires_at=datetime.now(UTC) - timedelta(seconds=5)))
    b = Leases(engine, outbox.tables, 4, "b", ttl=60)
    assert b.maintain() == {1: 2, 3: 2}
    with engine.begin() as conn:  # a namesake of a took 2 again
        conn.execute(sa.update(t).where(t.c.shard == 2).values(epoch=7))
    a.release_all()
    assert held(outbox) == {0: (None, 1), 1: ("b", 2), 2: ("a", 7), 3: ("b", 2)}
    assert a.owned() == {} and relays(outbox) == ["b"]


def two_relays(url: str, *, relays_engine: Callable[[sa.Engine], sa.Engine] = lambda e: e,
               shards: int = 16) -> tuple[Outbox, Leases, Leases, sa.Engine]:
    """``shards`` split by two relays on engines of their own (two processes; ``relays_engine`` of
    each engine, ``at_read_committed`` for the relay's level): a holds the first half, b the
    second. The outbox is on a's engine; b's is returned."""
    a_engine, b_engine = create_engine(url), create_engine(url)
    box = Outbox(a_engine, shards=shards)
    box.create_tables()
    a = Leases(relays_engine(a_engine), box.tables, shards, "a", ttl=60)
    b = Leases(relays_engine(b_engine), box.tables, shards, "b", ttl=60)
    assert len(a.maintain()) == shards
    b.maintain()
    a.maintain()
    a.release_surplus()
    half = shards // 2
    assert sorted(b.maintain()) == list(range(half, shards)) and sorted(a.owned()) == list(range(half))
    return box, a, b, b_engine


def at_read_committed(engine: sa.Engine) -> sa.Engine:
    """``engine`` at the level a relay runs its transactions at (``relay_engine``)."""
    return engine.execution_options(isolation_level="READ COMMITTED")


def waits_at_most(engine: sa.Engine, seconds: int) -> None:
    """Every connection ``engine`` opens from now on gives up a row lock wait after ``seconds``."""
    postgres = engine.dialect.name == "postgresql"
    setting = (f"SET lock_timeout = '{seconds}s'" if postgres
               else f"SET SESSION innodb_lock_wait_timeout = {seconds}")

    @sa.event.listens_for(engine, "connect")
    def bounded(dbapi_connection: Any, _record: object) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(setting)
        cursor.close()
        if postgres:
            dbapi_connection.commit()

    engine.dispose()  # the pooled connections were opened without it


def test_a_release_does_not_wait_on_the_lease_rows_another_relay_holds_locked(server_db_url: str) -> None:
    """Another relay's transaction holds its own lease rows locked (its take, confirm or marks, each
    row by primary key): a release reads and locks only its own rows, and goes through. On MariaDB
    a release of 8 shards of 16 by ``shard IN (...)`` alone scanned the whole table (and at
    REPEATABLE READ locked every row it read); by ``(shard, epoch) IN`` alone too (0ba74e9)."""
    box, a, _, b_engine = two_relays(server_db_url)
    a_engine = engine_of(box)
    waits_at_most(a_engine, 2)
    t = box.tables.leases
    try:
        with b_engine.connect() as blocker, blocker.begin():
            for shard in range(8, 16):
                row = sa.select(t.c.owner).where(t.c.shard == shard).with_for_update()
                assert blocker.execute(row).scalar() == "b"
            started = time.monotonic()
            a.release_all()  # a lock wait fails it after 2 s
            assert time.monotonic() - started < 2
        assert a.owned() == {} and relays(box) == ["b"]
        assert {shard: owner for shard, (owner, _) in held(box).items()} == {
            **{shard: None for shard in range(8)}, **{shard: "b" for shard in range(8, 16)}}
    finally:
        a_engine.dispose()
        b_engine.dispose()


# -- another relay at the same moment: paused mid-transaction, its rows locked ------------------------

def beside(engine: sa.Engine, starts: str, paused: tuple[str, Callable[[], object]],
           then: tuple[str, Callable[[], object]], *, wait: float = 1.0,
           ) -> tuple[dict[str, BaseException | None], float]:
    """Run ``paused`` (a name and a call) until ``engine``'s next statement starting with ``starts``
    has run, its transaction left open; run ``then`` beside it for up to ``wait`` seconds (into any
    wait on the paused side's locks); then let both end. What each raised (None: nothing), and how
    long ``then`` ran before the paused side went on."""
    stopped, go = threading.Event(), threading.Event()

    def pause(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith(starts) and not stopped.is_set():
            stopped.set()
            go.wait(20)

    # Left in place: taken out while it runs, the event's own iteration would fail; it pauses once.
    sa.event.listen(engine, "after_cursor_execute", pause)
    outcome: dict[str, BaseException | None] = {}

    def run(name: str, call: Callable[[], object]) -> threading.Thread:
        def go_on() -> None:
            try:
                call()
                outcome[name] = None
            except BaseException as exc:
                outcome[name] = exc
        thread = threading.Thread(target=go_on, daemon=True)
        thread.start()
        return thread

    threads = [run(*paused)]
    try:
        assert stopped.wait(20)
        started = time.monotonic()
        threads.append(run(*then))
        threads[1].join(wait)
        took = time.monotonic() - started
    finally:
        go.set()
    for thread in threads:
        thread.join(30)
    return outcome, took


@pytest.mark.parametrize("paused", ["release after its DELETE", "heartbeat after forgetting"])
@pytest.mark.parametrize("level", ["as created", "relay's"])
def test_a_release_and_another_relays_heartbeat_at_once_do_not_deadlock(
        server_db_url: str, paused: str, level: str) -> None:
    """A release is one transaction: the relay's row, then its lease rows, the order of a heartbeat
    (its row, the relays long dead, the renewal). The other order deadlocked on MariaDB (0ba74e9): a
    heartbeat forgetting the long dead by ``heartbeat_at`` then locked every relay row it read, the
    releasing one's too, and waited for its renewal's lease rows, which the release locked before
    it came to its relay row (now it deletes them by primary key, ``Leases._forget``).
    Each side is stopped between its statements while the other runs, at the engine's level
    (REPEATABLE READ on MariaDB) and at the relay's (READ COMMITTED, ``relay_engine``)."""
    box, a, b, b_engine = two_relays(
        server_db_url, relays_engine=(lambda e: e) if level == "as created" else at_read_committed)
    a_engine = engine_of(box)
    first = a_engine if paused.startswith("release") else b_engine  # stopped after its DELETE
    b._forget_at = datetime.min.replace(tzinfo=UTC)  # its heartbeat forgets the long dead this round
    with a_engine.begin() as conn:  # one to forget: its DELETE is where the heartbeat stops
        conn.execute(sa.insert(box.tables.relays).values(
            worker_id="dead", heartbeat_at=datetime.now(UTC) - timedelta(seconds=700)))
    one, other = (("release", a.release_all), ("heartbeat", b.maintain))
    if first is b_engine:
        one, other = other, one
    outcome, _ = beside(first, "DELETE", one, other)
    try:
        assert outcome == {"release": None, "heartbeat": None}, outcome
        assert a.owned() == {} and relays(box) == ["b"]
        assert sorted(b.maintain()) == list(range(16))
    finally:
        a_engine.dispose()
        b_engine.dispose()


@pytest.mark.parametrize("level", ["as created", "relay's"])
def test_two_relays_renewing_at_once_do_not_deadlock(server_db_url: str, level: str) -> None:
    """Two relays' renewals at once, one stopped between its UPDATE and its COMMIT while the other
    runs: on MariaDB the renewal's locking read of ``shard IN`` (half the table) scanned every row
    and waited on the other relay's, even at READ COMMITTED, while the other's read waited on its
    own: a deadlock, and one renewal failed (``Leases._renewals`` forces the primary key)."""
    box, a, b, b_engine = two_relays(
        server_db_url, relays_engine=(lambda e: e) if level == "as created" else at_read_committed)
    a_engine = engine_of(box)
    # a's lease rows renewed, its transaction open
    outcome, _ = beside(a_engine, "UPDATE", ("a", a.maintain), ("b", b.maintain))
    try:
        assert outcome == {"a": None, "b": None}, outcome
        assert sorted(a.owned()) == list(range(8)) and sorted(b.owned()) == list(range(8, 16))
    finally:
        a_engine.dispose()
        b_engine.dispose()


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
    sleeps. PostgreSQL ends a lease transaction left idle for a TTL (``Leases.locking``)."""
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


@pytest.mark.postgres
def test_a_take_behind_another_relays_take_still_going_is_no_database_outage(pg: sa.Engine) -> None:
    """Another relay is taking shards: its take locks them one UPDATE at a time and holds them to its
    COMMIT (``Leases._take``), 512 round trips for a quarter of 2048 shards, past 5 s on a loaded host.
    A relay's take of the same free shards waits on those rows: contention, not an outage. A lock
    bound on the lease statements (``lock_timeout`` of a TTL, 5 s at least: tried in bf2fb6c and
    reverted) failed that wait as 55P03, a database outage: four relays of 2048 shards and a TTL
    of 2 s joining and leaving on a loaded host logged "database unreachable (LockNotAvailable)"
    six times in 75 s. Here the other relay's take is its first UPDATE, held open until this
    relay's round is done (8 s at most). (From the attack on bf2fb6c, 2e8662f.)"""
    box = Outbox(pg, shards=4)
    box.create_tables()
    leases = Leases(pg, box.tables, 4, "b", ttl=2.0)
    done, failed = threading.Event(), []

    def round_() -> None:
        try:
            leases.maintain()
        except Exception as exc:
            failed.append(exc)
        finally:
            done.set()

    leases.maintain()
    leases.release_all()  # its rows made, every shard free
    t = box.tables.leases
    with pg.connect() as other:
        other.execute(sa.update(t).where(t.c.shard == 0).values(
            owner="a", epoch=t.c.epoch + 1, expires_at=datetime.now(UTC) + timedelta(minutes=1)))
        thread = threading.Thread(target=round_, daemon=True)
        thread.start()
        done.wait(8)
        other.commit()
    thread.join(20)
    assert not failed, failed
    assert sorted(leases.owned()) == [1, 2, 3]


STOP_BOUND = 10.0
"""``run``'s default ``stop_timeout``."""


def waiting_on_a_lock(engine: sa.Engine, statement: str) -> int:
    """How many sessions of ``engine``'s PostgreSQL wait on a lock in a statement starting ``statement``."""
    with engine.connect() as conn:
        return int(conn.scalar(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE :statement"), {"statement": statement + "%"}) or 0)


def running_on_four_shards(pg: sa.Engine, broker: InMemoryBroker) -> tuple[Outbox, Relay, Running]:
    """A relay of its defaults (stop bound ``STOP_BOUND``) running on four shards it holds."""
    box = Outbox(pg, shards=4)
    box.create_tables()
    relay = Relay(box, InMemoryTransport(broker), poll_interval=0.1)
    running = Running(relay, stop_timeout=STOP_BOUND)
    wait_for(lambda: len(relay.leases.owned()) == 4, 20, "the relay's leases")
    return box, relay, running


@pytest.mark.postgres
def test_a_relay_of_the_default_lease_ttl_stopped_while_its_lease_table_is_locked_keeps_its_stop_bound(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A single relay at its defaults (lease TTL 10 s, stop bound 10 s) stopped while another
    transaction holds its lease table locked (``LOCK TABLE``, a migration), its lease thread's
    renewal waiting on the lock and holding the ``Leases`` lock meanwhile. The stop joined that
    thread for 10 s, then queued its release behind the renewal: it ran into its bound ("did not
    finish within 10s") and never said the leases were left to expire. The release now runs on a
    closer waited for ``RELEASE_WITHIN`` (3 s), as a fleet's; its last line names the shards, and
    the release goes on once the lock is gone. (From the attack on bf2fb6c, 2e8662f.)"""
    box, relay, running = running_on_four_shards(pg, InMemoryBroker())
    caplog.set_level(logging.INFO, logger="outbox.relay")
    with pg.connect() as holder:
        holder.exec_driver_sql("LOCK TABLE outbox_leases IN SHARE MODE")
        wait_for(lambda: waiting_on_a_lock(pg, "UPDATE outbox_leases"), 10, "the renewal behind the lock")
        took = running.stop(close=False)
        said = [r.getMessage() for r in caplog.records
                if "stopped" in r.getMessage() or "did not finish" in r.getMessage()]
        holder.rollback()
    relay.close()  # waits for the release that went on
    assert took < STOP_BOUND, (took, said)
    last = said[-1] if said else ""
    assert "stopped; its leases of shards [0, 1, 2, 3] were not given back within 3s" in last, said
    assert "expire within the lease TTL" in last, said
    assert relay.leases.owned() == {} and relays(box) == []


@pytest.mark.postgres
def test_a_run_started_while_the_previous_runs_release_goes_on_says_it_waits_for_it(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A run() started again after a stop whose release outlived its bound (the lease table locked;
    a half-open connection holds it for the kernel's retransmission timeout, ~15 min) waits for that
    release before it takes leases: right, but silently. Its "started with shards" line never came,
    and nothing said why the relay did nothing. It says so once; the run goes on when the release
    ends. (From the attack on 1fde36c.)"""
    broker = InMemoryBroker()
    box, relay, running = running_on_four_shards(pg, broker)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    with pg.connect() as holder:
        holder.exec_driver_sql("LOCK TABLE outbox_leases IN SHARE MODE")
        wait_for(lambda: waiting_on_a_lock(pg, "UPDATE outbox_leases"), 10, "the renewal behind the lock")
        running.stop(close=False)
        again = Running(relay, stop_timeout=STOP_BOUND)
        said = wait_for(lambda: [r.getMessage() for r in caplog.records
                                 if "waits for the release of its previous run" in r.getMessage()],
                        5, "a line saying the new run waits for the release")
        holder.rollback()
    wait_for(lambda: len(relay.leases.owned()) == 4, 20, "the new run's leases")
    publish(box, "orders", ["k"])
    wait_for(lambda: len(broker.records("orders")) == 1, 20, "the new run's delivery")
    again.stop()
    assert len(said) == 1, said
    assert relay.leases.owned() == {} and relays(box) == []


@pytest.mark.parametrize("shards", [16, 2048])
@pytest.mark.parametrize("paused", ["renewal", "release"])
def test_a_renewal_beside_another_relays_open_renewal_or_release_does_not_wait_on_its_rows(
        server_db_url: str, shards: int, paused: str) -> None:
    """a stopped inside its renewal or its release (after its first UPDATE); b renews meanwhile. On
    MariaDB an IN of 1,000 shards or more became a join that no index hint kept on the primary key:
    b's locking read scanned and waited on a's rows (and two such renewals deadlocked)."""
    box, a, b, b_engine = two_relays(server_db_url, relays_engine=at_read_committed, shards=shards)
    a_engine = engine_of(box)
    waits_at_most(b_engine, 3)
    try:
        inside = a.maintain if paused == "renewal" else a.release_all
        outcome, took = beside(a_engine, "UPDATE", ("a", inside), ("b", b.maintain), wait=10)
        assert outcome == {"a": None, "b": None}, outcome
        assert took < 3, took
        assert len(b.owned()) >= shards // 2
    finally:
        a_engine.dispose()
        b_engine.dispose()


@pytest.mark.postgres
def test_a_release_beside_another_relays_take_of_its_expired_shards_does_not_deadlock(
        postgres_db: str) -> None:
    """a stalled past its TTL on shards 2 and 3; b takes them (in shard order) while a, back,
    releases everything. One UPDATE visits the rows in its plan's order (a small table's heap
    order: 3 before 2 here), so the release locked 0, 1, 3 and waited on 2 while b, holding 2,
    waited on 3: a deadlock that rolled back a's whole release, its live shards 0 and 1 too."""
    a_engine, b_engine = create_engine(postgres_db), create_engine(postgres_db)
    box = Outbox(a_engine, shards=4)
    box.create_tables()
    t = box.tables.leases
    a = Leases(at_read_committed(a_engine), box.tables, 4, "a", ttl=60)
    assert a.maintain() == {0: 1, 1: 1, 2: 1, 3: 1}
    for shard in (3, 2):  # 3's new row version now comes before 2's in the heap
        with a_engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.shard == shard)
                         .values(expires_at=datetime.now(UTC) - timedelta(seconds=5)))
    with a_engine.begin() as conn:
        conn.exec_driver_sql(f"ANALYZE {t.name}")
    b = Leases(at_read_committed(b_engine), box.tables, 4, "b", ttl=60)
    try:  # b paused once it took shard 2, its transaction open
        outcome, _ = beside(b_engine, "UPDATE", ("take", b.maintain), ("release", a.release_all))
        assert outcome == {"take": None, "release": None}, outcome
        assert set(b.owned()) == {2, 3} and a.owned() == {}
        assert [owner for owner, _ in held(box).values()].count(None) == 2
    finally:
        a_engine.dispose()
        b_engine.dispose()


@pytest.mark.parametrize("paused", ["INSERT", "UPDATE"])
def test_a_heartbeat_that_forgets_the_dead_does_not_wait_on_the_live_relays_rows(
        server_db_url: str, paused: str) -> None:
    """b paused inside its heartbeat, its own relay row locked; a's heartbeat forgets the long dead
    meanwhile. On MariaDB the DELETE by ``heartbeat_at`` (no index) locked every relay row, waiting
    on b's, and two heartbeats forgetting at once deadlocked."""
    box, a, b, b_engine = two_relays(server_db_url, relays_engine=at_read_committed)
    a_engine = engine_of(box)
    waits_at_most(a_engine, 3)
    a._forget_at = datetime.min.replace(tzinfo=UTC)  # its next round forgets
    try:  # b paused inside its heartbeat (INSERT) or its renewal (UPDATE)
        outcome, took = beside(b_engine, paused, ("b", b.maintain), ("a", a.maintain), wait=10)
        assert outcome == {"a": None, "b": None}, outcome
        assert took < 3, took
    finally:
        a_engine.dispose()
        b_engine.dispose()
