"""The fleet's lease renewal (``outbox.tenants._renewal``): what a round costs, and whom a failure touches.

An idle fleet's cost is mostly this round (every TTL/3, for every tenant), so
its statements per tenant are bounded here; the chunk's tenants share one
transaction, so one tenant's failure must undo none of the others' renewals.
A real fleet on a real PostgreSQL; the round is watched from
``LeaseRenewal.renew``.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, owned_leases, schema_outboxes, wait_for

from outbox import Outbox, SchemaError, create_engine
from outbox.tenants import Tenant, TenantRelay
from outbox.tenants._renewal import LeaseRenewal, renew_together
from transports.memory import InMemoryBroker, InMemoryTransport

pytestmark = pytest.mark.postgres

ROOMY = 1_000_000 + 256
"""A producer limit with room for the tenant header above the stored limit (1,000,000)."""


def fleet(names: list[str], engine: sa.Engine, **kwargs: Any) -> TenantRelay:
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    return TenantRelay(names, lambda: InMemoryTransport(broker), database=engine, tenant_header="x-tenant",
                       refresh_every=60, **kwargs)


def expiries(outbox: Outbox) -> list[datetime]:
    t = outbox.tables.leases
    assert isinstance(outbox.engine, sa.Engine)
    with outbox.engine.connect() as conn:
        return list(conn.scalars(sa.select(t.c.expires_at).where(t.c.owner.is_not(None)).order_by(t.c.shard)))


def failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The relay's own failure lines: not librdkafka's, whose client left alive by an earlier test of
    the worker may log "Connect to … failed" for its broker gone (clean CI of 528726f)."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("outbox") and "failed" in r.getMessage()]


def test_a_renewal_round_on_postgresql_is_one_statement_a_chunk(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 idle tenants holding their leases: a round is one statement for each chunk of 32 tenants
    (``_leases_shared``: every tenant's heartbeat, renewal and read of the live relays), no savepoints.
    Before, it was three a tenant (heartbeat, read, renewal), and before that seven."""
    names = [f"s{i:02d}" for i in range(40)]
    outboxes = schema_outboxes(pg, names, shards=1)
    inside = threading.local()
    statements: list[str] = []
    rounds: list[tuple[int, int]] = []  # (tenants renewed, statements), one per round
    renew = LeaseRenewal.renew

    def counted(self: LeaseRenewal, db: Any, engine: sa.Engine) -> None:
        tenants = sum(1 for unit in db.units.values() if unit.step is not None)
        before = len(statements)
        inside.on = True
        try:
            renew(self, db, engine)
        finally:
            inside.on = False
        rounds.append((tenants, len(statements) - before))

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if getattr(inside, "on", False):
            statements.append(statement)

    monkeypatch.setattr(LeaseRenewal, "renew", counted)
    sa.event.listen(pg, "before_cursor_execute", count)
    running = Running(fleet(names, pg, poll_interval=60, lease_ttl=1.5))
    try:
        wait_for(lambda: all(owned_leases(o) == 1 for o in outboxes.values()), 30, "every tenant's lease")
        first = len(rounds) + 1  # a round that may have taken a lease is over
        wait_for(lambda: len(rounds) >= first + 9, 30, "nine rounds more")
        steady = rounds[first:first + 9]
    finally:
        running.stop()
        sa.event.remove(pg, "before_cursor_execute", count)
    assert all(tenants == 40 for tenants, _ in steady), steady
    assert all(n == 2 for _, n in steady), steady  # 2 chunks; three a tenant would be 120
    assert not [s for s in statements if s.upper().startswith(("SAVEPOINT", "RELEASE"))]


def test_one_tenants_failing_renewal_undoes_none_of_the_others_in_its_chunk(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``b`` (between ``a`` and ``c`` in one chunk) fails its renewal with a database error, its leases
    table gone for the round: that round still renews ``a``'s and ``c``'s leases, and only ``b`` fails."""
    outboxes = schema_outboxes(pg, ["a", "b", "c"], shards=2)
    armed = threading.Event()
    seen: dict[str, list[timedelta]] = {}
    renew = LeaseRenewal.renew

    def watched(self: LeaseRenewal, db: Any, engine: sa.Engine) -> None:
        if not armed.is_set():
            renew(self, db, engine)
            return
        before = {name: expiries(outboxes[name]) for name in ("a", "c")}
        with pg.begin() as conn:
            conn.exec_driver_sql('ALTER TABLE "b".outbox_leases RENAME TO outbox_leases_away')
        try:
            renew(self, db, engine)
        finally:
            with pg.begin() as conn:
                conn.exec_driver_sql('ALTER TABLE "b".outbox_leases_away RENAME TO outbox_leases')
        after = {name: expiries(outboxes[name]) for name in ("a", "c")}
        for name in ("a", "c"):
            seen[name] = [later - earlier for earlier, later in zip(before[name], after[name], strict=True)]
        armed.clear()

    caplog.set_level(logging.WARNING, logger="outbox.relay")
    monkeypatch.setattr(LeaseRenewal, "renew", watched)
    running = Running(fleet(["a", "b", "c"], pg, poll_interval=60, lease_ttl=3.0))
    try:
        wait_for(lambda: all(owned_leases(o) == 2 for o in outboxes.values()), 30, "every tenant's leases")
        armed.set()
        wait_for(lambda: not armed.is_set(), 10, "the round in which b fails")
        time.sleep(5)
    finally:
        running.stop()
    assert failures(caplog) and all("tenant b " in m for m in failures(caplog)), failures(caplog)
    assert set(seen) == {"a", "c"}
    for name, moved in seen.items():
        assert len(moved) == 2 and all(m.total_seconds() > 0 for m in moved), (name, moved)


def test_a_renewal_in_one_statement_keeps_every_lease_promise(pg: sa.Engine) -> None:
    """Two tenants' leases renewed by one statement (``LeaseRenewal._renew_chunk``, the fleet's
    round on PostgreSQL): each renews only the leases it holds at its epoch (a lease another relay
    took is lost, not renewed), a relay that gave its leases back is left alone (no heartbeat brings
    it back), and a changed shard count fails the tenant whose count changed at its next turn."""
    outboxes = schema_outboxes(pg, ["a", "b"], shards=2)
    relay = fleet(["a", "b"], pg, worker_id="fleet-1", lease_ttl=30)
    woken: list[Any] = []
    renewal = LeaseRenewal(ttl=30, schedule=cast(Any, SimpleNamespace(wake=woken.append)),
                           stopping=threading.Event(), worker_id="fleet-1", answered=lambda *_: None)
    try:
        relay.run_once()  # each tenant's first step takes its leases
        found = {name: relay.relay_of(name) for name in ("a", "b")}
        steps = {name: step for name, step in found.items() if step is not None}
        units = {name: SimpleNamespace(tenant=SimpleNamespace(schema=name), step=step, lease_failure=None)
                 for name, step in steps.items()}

        def round_of(*names: str) -> list[dict[int, int] | None]:
            with pg.connect() as conn:
                return renewal._renew_chunk(conn, [(cast(Any, units[n]), steps[n]) for n in names])

        def heartbeats(schema: str) -> list[str]:
            with pg.connect() as conn:
                return list(conn.scalars(sa.text(f'SELECT worker_id FROM "{schema}".outbox_relays')))

        assert set(steps) == {"a", "b"} and all(len(step.leases.owned()) == 2 for step in steps.values())
        before = expiries(outboxes["b"])
        with pg.begin() as conn:  # another relay took a's shard 0 over (as after an expiry): a new epoch
            conn.exec_driver_sql("UPDATE a.outbox_leases SET owner = 'fleet-2', epoch = epoch + 1 "
                                 "WHERE shard = 0")
        held_a, held_b = round_of("a", "b")
        assert held_a is not None and set(held_a) == {1} and set(steps["a"].leases.owned()) == {1}
        assert held_b is not None and set(held_b) == {0, 1}
        assert all(later > earlier for earlier, later in zip(before, expiries(outboxes["b"]), strict=True))
        with pg.connect() as conn:
            assert conn.scalar(sa.text("SELECT owner FROM a.outbox_leases WHERE shard = 0")) == "fleet-2"

        steps["b"].leases.release_all()
        assert round_of("a", "b")[1] == {}
        assert heartbeats("b") == [] and heartbeats("a") == ["fleet-1"]

        with pg.begin() as conn:
            conn.exec_driver_sql("UPDATE a.outbox_meta SET value = '4' WHERE name = 'shard_count'")
        assert round_of("a") == [None] and woken == [units["a"]]
        assert units["a"].lease_failure is not None
        failed_step, failure = units["a"].lease_failure  # the step it renewed, and why it could not
        assert failed_step is steps["a"]
        assert isinstance(failure, SchemaError) and "changed from 2 to 4" in str(failure)
        assert steps["a"].leases.owned() == {}
    finally:
        relay.close()


def one_statement_renewal(worker_id: str) -> tuple[LeaseRenewal, list[Any]]:
    """A ``LeaseRenewal`` whose rounds the test runs itself (``_renew_chunk``), and whom it woke."""
    woken: list[Any] = []
    renewal = LeaseRenewal(ttl=30, schedule=cast(Any, SimpleNamespace(wake=woken.append)),
                           stopping=threading.Event(), worker_id=worker_id, answered=lambda *_: None)
    return renewal, woken


def unit_of(name: str, step: Any) -> Any:
    return SimpleNamespace(tenant=SimpleNamespace(schema=name), step=step, lease_failure=None)


def test_a_tenant_whose_lock_is_held_long_shortens_no_other_tenants_lease_in_its_chunk(pg: sa.Engine) -> None:
    """A shared renewal takes its chunk's ``Leases`` locks one after another; ``b``'s is held longer
    than a TTL (its own renewal waiting on a row lock, a release). ``a``, locked first, must still be
    renewed for a TTL from when the statement runs: with the round's time taken at ``a``'s lock, its
    lease was renewed into the past, free for any other relay to take at once."""
    outboxes = schema_outboxes(pg, ["a", "b"], shards=2)
    relay = fleet(["a", "b"], pg, worker_id="fleet-1", lease_ttl=2.0)
    renewal, _ = one_statement_renewal("fleet-1")
    holding, release = threading.Event(), threading.Event()

    def hold_b() -> None:
        with steps["b"].leases.shared_round():
            holding.set()
            release.wait(30)

    try:
        relay.run_once()  # each tenant's first step takes its leases
        steps = {name: relay.relay_of(name) for name in ("a", "b")}
        assert all(step is not None and len(step.leases.owned()) == 2 for step in steps.values())
        holder = threading.Thread(target=hold_b, daemon=True)
        holder.start()
        assert holding.wait(10)
        threading.Timer(3.0, release.set).start()  # b's lock held 1.5 TTLs
        with pg.connect() as conn:
            held = renewal._renew_chunk(conn, [(unit_of(n, steps[n]), steps[n]) for n in ("a", "b")])
        renewed_at = datetime.now(tz=UTC)
        holder.join(10)
        assert held[0] is not None and set(held[0]) == {0, 1}
        left = [(expiry - renewed_at).total_seconds() for expiry in expiries(outboxes["a"])]
        assert len(left) == 2 and all(seconds > 1.0 for seconds in left), left  # about a TTL (2 s) left
    finally:
        release.set()
        relay.close()


def test_a_fleet_frozen_inside_its_shared_renewal_does_not_hold_the_fleet_that_takes_its_leases(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet frozen between its chunk's renewal statement and the COMMIT (SIGSTOP, a VM stall) holds
    the renewed lease rows locked: another fleet that takes those leases once they expired waits on
    them (and, in its own renewal thread, holds every tenant of its chunk with it) for as long as the
    frozen one sleeps. PostgreSQL ends the renewal's transaction left idle for a lease TTL, at least
    5 s (``_leases_shared``), as it ends a single relay's lease transactions."""
    schema_outboxes(pg, ["a"], shards=2)
    relay = fleet(["a"], pg, worker_id="frozen-fleet", lease_ttl=1.0)
    renewal, _ = one_statement_renewal("frozen-fleet")
    frozen, thaw = threading.Event(), threading.Event()
    real = renew_together

    def renew_then_freeze(conn: sa.Connection, members: list[Any]) -> list[Any]:
        answers = real(conn, members)
        if threading.current_thread().name == "frozen":  # the chunk's rows locked, its COMMIT not sent
            frozen.set()
            thaw.wait(60)
        return answers

    monkeypatch.setattr("outbox.tenants._renewal.renew_together", renew_then_freeze)
    ended: list[BaseException | None] = []

    def run_frozen() -> None:
        try:
            with pg.connect() as conn:
                renewal._renew_chunk(conn, [(unit_of("a", step), step)])
            ended.append(None)
        except BaseException as exc:  # its connection ended under it
            ended.append(exc)

    taker = fleet(["a"], pg, worker_id="taker-fleet", lease_ttl=1.0)
    taken: list[dict[int, int]] = []
    stop = threading.Event()

    def take() -> None:  # its tenant's steps: each renews its leases and takes up to its share
        while not stop.is_set() and len(taken[-1] if taken else {}) < 2:
            taker.run_once()
            step = taker.relay_of("a")
            taken.append(step.leases.owned() if step is not None else {})
            stop.wait(0.2)

    worker = threading.Thread(target=run_frozen, name="frozen", daemon=True)
    taking = threading.Thread(target=take, daemon=True)
    try:
        relay.run_once()  # its first step takes both leases
        step = relay.relay_of("a")
        assert step is not None and len(step.leases.owned()) == 2
        worker.start()
        assert frozen.wait(30)
        taking.start()
        wait_for(lambda: bool(taken) and len(taken[-1]) == 2, 20, "the taker holding both leases")
    finally:
        thaw.set()  # without the bound, the taker waits for this
        stop.set()
        worker.join(30)
        taking.join(30)
        taker.close()
        relay.close()
    assert isinstance(ended[0], sa.exc.DBAPIError) and getattr(ended[0].orig, "sqlstate", None) == "25P03"


@pytest.mark.mysql
def test_a_lease_renewed_after_its_expiry_leaves_the_take_free_to_run_on_mariadb(mysql_db: str) -> None:
    """On MariaDB a chunk's heartbeats and renewals share one transaction, and taking free shards up to
    the share is a transaction of its own. A lease renewed after its expiry (a late round) looks free to
    the take while the renewal holds its row: taken inside the chunk's transaction, the take's UPDATE
    waited for that row, held by its own thread, until MariaDB's lock wait timeout (50 s), every tenant
    of the database unrenewed meanwhile (the clean CI's ``test_two_fleets_split…[databases]`` hung so).
    Taken after the COMMIT it sees the lease renewed and takes the shard that is free."""
    engine = create_engine(mysql_db)
    outbox = Outbox(engine, shards=4)
    outbox.create_tables()
    leases = outbox.tables.leases
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = TenantRelay([Tenant("m", database=mysql_db)], lambda: InMemoryTransport(broker),
                        tenant_header="x-tenant", refresh_every=60, poll_interval=60, lease_ttl=3.0,
                        worker_id="fleet-m")

    def owners() -> list[str | None]:
        with engine.connect() as conn:
            return list(conn.scalars(sa.select(leases.c.owner).order_by(leases.c.shard)))

    running = Running(relay)
    try:
        wait_for(lambda: owners() == ["fleet-m"] * 4, 30, "the fleet holding every lease")
        with engine.begin() as conn:  # shard 0 past its expiry, about to be renewed; shard 3 lost
            conn.exec_driver_sql("UPDATE outbox_leases SET expires_at = expires_at - INTERVAL 1 HOUR "
                                 "WHERE shard = 0")
            conn.exec_driver_sql("UPDATE outbox_leases SET owner = NULL WHERE shard = 3")
        wait_for(lambda: owners() == ["fleet-m"] * 4, 10, "shard 3 taken again")  # 50 s, inside it
    finally:
        running.stop()
        engine.dispose()
