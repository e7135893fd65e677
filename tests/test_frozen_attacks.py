"""Attacks on the frozen-database watches (``told_if_late``): faults their own tests do not list.

A database that is slow but not frozen (a lease row locked by another transaction for longer than
the bound), a stop while a watched call hangs: each outage told once each way, nothing lost, and
nothing told by a watch once the worker it watched for has stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, cast

import pytest
import sqlalchemy as sa
from _relay_helpers import (
    SEQ,
    Running,
    ScriptedTransport,
    owned_leases,
    pending,
    publish,
    rows,
    schema_outboxes,
    wait_for,
)
from inbox_support import AlertLog, applied, apply_effect, business
from inbox_support import record as inbox_record
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session
from test_inbox_holes import running as inbox_running
from test_inbox_holes import wait_for as inbox_wait_for

from outbox import Inbox, Message, Outbox, Relay, create_engine, relay_metrics
from outbox.core._outage import OutageTracker
from outbox.inbox import _gaps as gaps_module
from outbox.inbox._gaps import GapSweeper
from outbox.inbox._outage import OutageLog
from outbox.relay import tenant_relay_metrics
from outbox.tenants import Tenant, TenantLabels, TenantRelay
from outbox.testing import LocalPostgres
from transports import Record
from transports.memory import InMemoryBroker, InMemorySource, InMemoryTransport

HEADER = "x-tenant"
TTL = 1.0
"""The lease TTL of these relays: their watch's bound is ``UNANSWERED_AT_LEAST`` (5 s)."""


def told(caplog: pytest.LogCaptureFixture, worker: str, text: str) -> int:
    return sum(1 for r in caplog.records if f"relay {worker}: database" in r.getMessage()
               and text in r.getMessage())


def waiting_on_a_lock(engine: sa.Engine, statement: str) -> int:
    """Sessions of ``engine``'s PostgreSQL waiting on a lock in a statement starting ``statement``."""
    with engine.connect() as conn:
        return int(conn.scalar(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE :statement"), {"statement": statement + "%"}) or 0)


def seq(record: Record) -> int:
    return int(dict(record.headers)[SEQ])


def timers_ended(within: float = 15.0) -> None:
    """Every ``threading.Timer`` (the watches') has fired or been cancelled."""
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer):
            thread.join(within)
            assert not thread.is_alive()


def lock_heartbeat(pg: sa.Engine, outbox: Outbox, worker: str) -> sa.Connection:
    """A transaction holding ``worker``'s heartbeat row: its lease renewal waits on it."""
    relays = outbox.tables.relays
    holder = pg.connect()
    holder.begin()
    holder.execute(sa.select(relays.c.worker_id).where(relays.c.worker_id == worker).with_for_update())
    return holder


@pytest.mark.postgres
def test_a_lease_row_locked_past_the_bound_is_told_once_each_way_and_loses_nothing(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Not frozen, slow: the renewal waits on a row lock for longer than its bound. The project
    counts a lock wait as an outage (55P03); told once, ended once, and the rows published meanwhile
    and after are all sent, in order."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox = Outbox(pg, shards=1)
    outbox.create_tables()
    transport = ScriptedTransport()
    running = Running(Relay(outbox, transport, worker_id="locked", lease_ttl=TTL, poll_interval=0.1,
                            metrics=relay_metrics(CollectorRegistry())), stop_timeout=5)
    try:
        publish(outbox, "orders", ["k"])
        wait_for(lambda: not rows(outbox, status="pending"), 20, "the first row published")
        holder = lock_heartbeat(pg, outbox, "locked")
        try:
            wait_for(lambda: waiting_on_a_lock(pg, "INSERT INTO outbox_relays"), 10, "the renewal waiting")
            publish(outbox, "orders", ["k"])
            wait_for(lambda: told(caplog, "locked", "unreachable") == 1, 10, "the lock wait told")
            publish(outbox, "orders", ["k"])
        finally:
            holder.rollback()
            holder.close()
        wait_for(lambda: told(caplog, "locked", "reachable again") == 1, 10, "its end told")
        publish(outbox, "orders", ["k"])
        wait_for(lambda: not rows(outbox, status="pending"), 20, "every row published")
    finally:
        running.stop()
    assert [r.key for r in transport.sent] == [b"k"] * 4
    assert [r.value for r in transport.sent] == [r.value for r in sorted(transport.sent, key=seq)]
    assert len(rows(outbox)) == 4 and rows(outbox, status="pending") == []
    assert told(caplog, "locked", "unreachable") == 1
    assert told(caplog, "locked", "reachable again") == 1


def stopped_while_hanging(pg: sa.Engine, outbox: Outbox, worker: str, running: Running,
                         caplog: pytest.LogCaptureFixture, *, batches_too: bool = False) -> list[str]:
    """``worker``'s heartbeat row locked until its renewal waits on it (``batches_too``: its messages
    table too, until its batch loop waits on it as well), then ``running`` stopped within its bound;
    what was told of the database once ``run`` returned and every watch ended."""
    holder = lock_heartbeat(pg, outbox, worker)
    try:
        if batches_too:
            holder.execute(sa.text(f"LOCK TABLE {outbox.tables.messages.name} IN ACCESS EXCLUSIVE MODE"))
        wait_for(lambda: waiting_on_a_lock(pg, "") >= 1 + batches_too, 10, "the renewal waiting")
        assert running.stop(close=False) < 5 + 1
        after_stop = len(caplog.records)
        timers_ended()  # the hanging renewal's watch: past its 5 s
        return [r.getMessage() for r in caplog.records[after_stop:] if "unreachable" in r.getMessage()]
    finally:
        holder.rollback()
        holder.close()


@pytest.mark.postgres
@pytest.mark.parametrize("behind", [False, True], ids=["loop-ended", "loop-left-behind"])
def test_a_relay_stopped_while_its_renewal_hangs_tells_nothing_after_its_run_returned(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture, behind: bool) -> None:
    """Stopped 0-5 s into a renewal that hangs (a lock here, a frozen server alike): ``run`` returns
    within its bound, and the renewal's watch must not tell an outage (a WARNING, a counted outage)
    of a relay that has stopped, seconds after its last line said so. Also when its batch loop hangs
    too and is left behind at the stop (``run`` returns at its 1 s ``stop_timeout``): the loop's own
    end never came to say the run was over."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox = Outbox(pg, shards=1)
    outbox.create_tables()
    relay = Relay(outbox, ScriptedTransport(), worker_id="stopped", lease_ttl=TTL, poll_interval=0.1,
                  metrics=relay_metrics(CollectorRegistry()))
    running = Running(relay, stop_timeout=1 if behind else 5)
    wait_for(lambda: relay.leases.owned(), 20, "the relay's lease")
    assert stopped_while_hanging(pg, outbox, "stopped", running, caplog, batches_too=behind) == []
    assert relay.metrics.outages.labels("database")._value.get() == 0


@pytest.mark.postgres
def test_a_fleet_stopped_while_its_renewal_hangs_tells_nothing_after_its_run_returned(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """The fleet's renewal round of a database hangs (a tenant's heartbeat row locked here, a frozen
    server alike) and the fleet is stopped before its watch's bound: ``run`` returns, and the watch
    closes no gate and tells no outage after that."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outboxes = schema_outboxes(pg, ["t1", "t2"], shards=1)
    broker = InMemoryBroker()
    relay = TenantRelay([Tenant(name, name) for name in outboxes], lambda: InMemoryTransport(broker),
                        database=pg, workers=2, worker_id="stopped-fleet", poll_interval=0.1,
                        lease_ttl=TTL, refresh_every=0.5,
                        metrics=tenant_relay_metrics(TenantLabels(), CollectorRegistry()))
    running = Running(relay, stop_timeout=5)
    wait_for(lambda: all(owned_leases(o) == 1 for o in outboxes.values()), 20, "the tenants' leases")
    assert stopped_while_hanging(pg, outboxes["t1"], "stopped-fleet", running, caplog) == []
    registry = relay.metrics.registry
    assert not registry.get_sample_value("outbox_relay_outages_total", {"dependency": "database"})


def plain_inbox(pg: sa.Engine, group: str) -> tuple[Inbox, InMemoryBroker, InMemorySource]:
    """An inbox of ``group`` on ``pg`` applying topic ``orders`` (``apply_effect``), and its source."""
    inbox = Inbox(pg, group=group, alert=AlertLog())
    inbox.create_tables()
    business.create_all(pg)

    @inbox.handler("orders")
    def handler(session: Session, message: Message) -> None:
        apply_effect(session, message)

    broker = InMemoryBroker(partitions=1)
    return inbox, broker, InMemorySource(broker, group_id=group, topics=["orders"])


@pytest.mark.postgres
def test_an_inbox_stopped_while_its_sweep_read_hangs_tells_nothing_after_its_run_returned(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """The gap sweep's read hangs (its table locked here, a frozen server alike) and the inbox is
    stopped before the read's 10 s bound: ``run`` returns, and the read's watch must not say the
    database is unavailable after that."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    inbox, broker, source = plain_inbox(pg, "stopped")
    holder = pg.connect()
    try:
        with inbox_running(inbox, source):
            broker.append(inbox_record("orders", "k", 1))
            inbox_wait_for(lambda: applied(pg) == [("k", 1)], "the first message applied")
            holder.begin()
            holder.execute(sa.text("LOCK TABLE inbox_held IN ACCESS EXCLUSIVE MODE"))
            wait_for(lambda: waiting_on_a_lock(pg, "SELECT inbox_held"), 10, "the sweep's read waiting")
        after_stop = len(caplog.records)
        timers_ended()  # the hanging read's watch: past its 10 s
    finally:
        holder.rollback()
        holder.close()
    assert [r.getMessage() for r in caplog.records[after_stop:] if "unavailable" in r.getMessage()] == []


@pytest.mark.slow  # a server of its own, frozen
def test_a_short_freeze_tells_nothing_and_two_freezes_in_a_row_are_told_once_each_way_each(
        own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture) -> None:
    """A freeze shorter than the bound (3 s of 5 s) is a slow database: nothing told, nothing lost.
    Then frozen past the bound, thawed, and frozen again as soon as its end is told: two outages,
    each told once each way, never "reachable again" from work begun before the second freeze while
    it lasts; every row published meanwhile is sent, in order."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    transport = ScriptedTransport()
    running = Running(Relay(outbox, transport, worker_id="refrozen", lease_ttl=2.0, poll_interval=0.1,
                            metrics=relay_metrics(CollectorRegistry())), stop_timeout=5)
    try:
        publish(outbox, "orders", ["k"])
        wait_for(lambda: not rows(outbox, status="pending"), 20, "the first row published")
        own_postgres.freeze()
        try:
            time.sleep(3.0)  # the freeze's length (shorter than the bound), not a wait for anything
        finally:
            own_postgres.thaw()
        publish(outbox, "orders", ["k"])
        wait_for(lambda: not rows(outbox, status="pending"), 20, "the row after the short freeze")
        assert told(caplog, "refrozen", "unreachable") == 0
        for n in (1, 2):
            own_postgres.freeze()
            try:
                wait_for(lambda n=n: told(caplog, "refrozen", "unreachable") == n, 10, f"outage {n} told")
                assert told(caplog, "refrozen", "reachable again") == n - 1
            finally:
                own_postgres.thaw()
            if n == 1:  # frozen again as soon as the first outage's end is told
                wait_for(lambda: told(caplog, "refrozen", "reachable again") == 1, 10, "outage 1 ended")
        wait_for(lambda: told(caplog, "refrozen", "reachable again") == 2, 30, "outage 2 ended")
        publish(outbox, "orders", ["k"])
        wait_for(lambda: not rows(outbox, status="pending"), 30, "the row after the thaws")
    finally:
        running.stop()
        engine.dispose()
    assert [r.key for r in transport.sent] == [b"k"] * 3
    assert [seq(r) for r in transport.sent] == [1, 2, 3]
    assert told(caplog, "refrozen", "unreachable") == 2
    assert told(caplog, "refrozen", "reachable again") == 2


def ended_by_earlier_work(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The outages ``OutageTracker.answered`` ends with work whose start is unknown or before the
    outage was told (filled as the test runs): work begun before an outage says nothing of now."""
    wrong: list[str] = []
    answered = OutageTracker.answered

    def checked(tracker: OutageTracker, started: float | None = None) -> None:
        since = tracker._since
        answered(tracker, started)
        if since is not None and tracker._since is None and (started is None or started < since):
            wrong.append(f"{tracker.what}: ended by work started {started}, told at {since}")

    monkeypatch.setattr(OutageTracker, "answered", checked)
    return wrong


@pytest.mark.slow  # a server of its own, frozen
@pytest.mark.postgres
def test_a_fleet_with_one_of_two_databases_frozen_tells_only_its_outage_and_opens_it_with_no_traffic(
        pg: sa.Engine, own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two databases, one frozen past the bound: the other's tenants keep being published and its gate
    never closes; the frozen one's outage is told once and ended after the thaw (no row published to
    its tenants meanwhile), once, by work begun after it was told (not the renewal round that hung
    through it); its rows published after that are sent."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    wrong = ended_by_earlier_work(monkeypatch)
    healthy = schema_outboxes(pg, ["h1"], shards=1)["h1"]
    frozen_setup = create_engine(own_postgres.url)
    frozen = schema_outboxes(frozen_setup, ["f1"], shards=1)["f1"]
    fleet_engine = create_engine(own_postgres.url, pool_size=4, max_overflow=0)
    for conn in [fleet_engine.connect() for _ in range(4)]:
        conn.close()
    broker = InMemoryBroker()
    relay = TenantRelay([Tenant("h1", "h1"), Tenant("f1", "f1", database=fleet_engine)],
                        lambda: InMemoryTransport(broker), database=pg, workers=2, worker_id="two-dbs",
                        poll_interval=0.1, lease_ttl=2.0, refresh_every=0.5,
                        metrics=tenant_relay_metrics(TenantLabels(), CollectorRegistry()))
    running = Running(relay, stop_timeout=10)
    closed: list[int] = []
    try:
        wait_for(lambda: sorted(relay.tenants) == ["f1", "h1"], 30, "both tenants served")
        gates = {db.engine.url.port: db.gate for db in relay._databases.values()}
        healthy_gate, frozen_gate = gates[pg.url.port], gates[fleet_engine.url.port]
        for outbox in (healthy, frozen):
            with outbox.begin() as session:
                outbox.publish(session, "orders", {"n": 1}, key="k")
        wait_for(lambda: pending(healthy) == 0 and pending(frozen) == 0, 30, "the first rows")
        own_postgres.freeze()
        try:
            wait_for(lambda: told(caplog, "two-dbs", "unreachable") == 1, 10, "the frozen one told")
            for n in range(2, 5):
                with healthy.begin() as session:
                    healthy.publish(session, "orders", {"n": n}, key="k")
                wait_for(lambda: pending(healthy) == 0, 10, "the healthy tenant published")
                if healthy_gate.down:
                    closed.append(n)
        finally:
            own_postgres.thaw()
        wait_for(lambda: told(caplog, "two-dbs", "reachable again") == 1, 20, "its end told")
        wait_for(lambda: not frozen_gate.down, 10, "its gate open, no row published to its tenant")
        with frozen.begin() as session:
            frozen.publish(session, "orders", {"n": 2}, key="k")
        wait_for(lambda: pending(frozen) == 0, 30, "the frozen tenant's row after the thaw")
    finally:
        running.stop()
        fleet_engine.dispose()
        frozen_setup.dispose()
    assert closed == []
    assert wrong == []
    assert told(caplog, "two-dbs", "unreachable") == 1
    assert told(caplog, "two-dbs", "reachable again") == 1
    assert len(broker.records("orders")) == 6


@pytest.mark.slow  # a server of its own, frozen
@pytest.mark.postgres
def test_an_inbox_tenant_whose_database_is_frozen_holds_up_no_other_tenants_sweep(
        pg: sa.Engine, own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture) -> None:
    """Tenant b's database (a server of its own) frozen past the read's bound while tenant a's (the
    shared server) answers: only b's outage is told, once each way; meanwhile a's messages apply, a's
    sweep parks a gap that outlived ``gap_timeout`` and its parked keys are counted; after the thaw,
    b's messages apply."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    with pg.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA t_a"))
    b_engine = create_engine(own_postgres.url)
    tenants = [Tenant("a", schema="t_a"), Tenant("b", database=own_postgres.url)]
    inbox = Inbox(pg, group="two", tenants=tenants, tenant_header=HEADER, alert=AlertLog(), gap_timeout=2.0)
    inbox.create_tables()
    a_tables = pg.execution_options(schema_translate_map={None: "t_a"})
    for tenant, tables in (("a", a_tables), ("b", b_engine)):
        inbox.create_tables(tenant=tenant)
        business.create_all(tables)

    @inbox.handler("orders")
    def handler(session: Session, message: Message) -> None:
        apply_effect(session, message)

    def message(tenant: str, key: str, seq: int) -> Record:
        r = inbox_record("orders", key, seq)
        r.headers.append((HEADER, tenant.encode()))
        return r

    def told_of(what: str, text: str) -> int:
        return sum(1 for r in caplog.records if r.getMessage().startswith(what + text))

    broker = InMemoryBroker(partitions=1)
    source = InMemorySource(broker, group_id="two", topics=["orders"])
    router = inbox.router
    assert router is not None
    try:
        with inbox_running(inbox, source) as errors:
            broker.append(message("a", "k", 1))
            broker.append(message("b", "k", 1))
            inbox_wait_for(lambda: applied(a_tables) == [("k", 1)] and applied(b_engine) == [("k", 1)],
                           "the first messages applied", errors=errors)
            own_postgres.freeze()
            try:
                broker.append(message("a", "gap", 2))  # seq 1 never comes: parked after 2 s
                broker.append(message("a", "k", 2))
                inbox_wait_for(lambda: applied(a_tables) == [("k", 1), ("k", 2)], "a applied meanwhile",
                               errors=errors)
                inbox_wait_for(lambda: router.parked_key_count() == 1, "a's gap parked and counted",
                               timeout=15, errors=errors)
                inbox_wait_for(lambda: told_of("the database of tenant b ", "unavailable") == 1,
                               "b's outage told", timeout=15, errors=errors)
            finally:
                own_postgres.thaw()
            inbox_wait_for(lambda: told_of("the database of tenant b ", "available again") == 1,
                           "b's outage ended", timeout=30, errors=errors)
            broker.append(message("b", "k", 2))
            inbox_wait_for(lambda: applied(b_engine) == [("k", 1), ("k", 2)], "b applied after the thaw",
                           timeout=30, errors=errors)
    finally:
        b_engine.dispose()
    assert told_of("the database of tenant b ", "unavailable") == 1
    assert told_of("the database of tenant b ", "available again") == 1
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()
            and "tenant b" not in r.getMessage()] == []


@pytest.mark.postgres
def test_an_inbox_table_locked_past_the_read_bound_is_told_once_each_way_and_loses_nothing(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Not frozen, slow: ``inbox_held`` locked ACCESS EXCLUSIVE (a migration, a VACUUM FULL, a DDL
    queued behind a long transaction) past the sweep read's 10 s bound. Told once (the read cannot
    tell a lock from a frozen server), ended once after the lock goes, by a read begun after it was
    told; the messages that came meanwhile apply, in order."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    inbox, broker, source = plain_inbox(pg, "locked")
    holder = pg.connect()
    try:
        with inbox_running(inbox, source) as errors:
            broker.append(inbox_record("orders", "k", 1))
            inbox_wait_for(lambda: applied(pg) == [("k", 1)], "the first message applied", errors=errors)
            holder.begin()
            holder.execute(sa.text("LOCK TABLE inbox_held IN ACCESS EXCLUSIVE MODE"))
            broker.append(inbox_record("orders", "k", 2))
            broker.append(inbox_record("orders", "k", 3))
            inbox_wait_for(lambda: "the database unavailable" in caplog.text, "the lock wait told",
                           timeout=15, errors=errors)
            holder.rollback()
            inbox_wait_for(lambda: "the database available again" in caplog.text, "its end told",
                           timeout=15, errors=errors)
            inbox_wait_for(lambda: applied(pg) == [("k", 1), ("k", 2), ("k", 3)], "every message applied",
                           errors=errors)
    finally:
        holder.rollback()
        holder.close()
    lines = [r.getMessage() for r in caplog.records if "available" in r.getMessage()]
    assert [line.split(" (")[0].split(" after")[0] for line in lines] == [
        "the database unavailable", "the database available again"], lines


class Sessions:
    """What ``GapSweeper._read`` needs of ``Sessions``: ``run(fn, *args)`` in this thread."""

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def test_a_sweep_read_left_unanswered_during_the_transactions_outage_does_not_take_it_over(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A full disk told by the transactions (reads still work), then one read slow past the bound (a
    lock): the reads' next answer ended the transactions' outage, and the next write that fails told
    it again. Only an outage the reads' watch told is the reads' to end."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    monkeypatch.setattr(gaps_module, "UNANSWERED", 0.05)
    outages = OutageLog()
    outages.failed("database or disk is full")  # a transaction's
    told = threading.Event()
    monkeypatch.setattr(outages, "failed", lambda why, failed=outages.failed: (failed(why), told.set())[0])
    sweeper = GapSweeper(Sessions(), cast(Any, None), cast(Any, None), 60.0, 30.0, outages)
    assert sweeper._read(told.wait, 10)  # answered once its watch told it
    assert sweeper._read(list) == []  # the next read, answered at once
    assert outages.down, "the transactions' outage was ended by a read"
    assert [r.getMessage()[:36] for r in caplog.records] == ["the database unavailable (database o"]


def test_a_server_frozen_under_the_sweeps_parked_key_count_is_told(
        sqlite_db: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The sweep's last read, the parked keys' count, went unwatched: a server that froze under it
    held the sweep thread for good, so no later (watched) read began either, and nothing was ever
    told (the plain inbox's frozen-database test failed so, now and then, under load). The count
    that never answers stands in for the freeze here; the read's bound is shortened to 0.2 s."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    monkeypatch.setattr(gaps_module, "UNANSWERED", 0.2)
    engine = create_engine(sqlite_db)
    inbox, broker, source = plain_inbox(engine, "counted")
    thawed = threading.Event()
    count = inbox.storage.keys.parked_count
    frozen = threading.Event()

    def parked_count(session: Session) -> int:
        if frozen.is_set():
            thawed.wait(30)
        return count(session)

    monkeypatch.setattr(inbox.storage.keys, "parked_count", parked_count)
    try:
        with inbox_running(inbox, source) as errors:
            broker.append(inbox_record("orders", "k", 1))
            inbox_wait_for(lambda: applied(engine) == [("k", 1)], "the message applied", errors=errors)
            frozen.set()
            inbox_wait_for(lambda: "the database unavailable" in caplog.text, "the count's freeze told",
                           timeout=10, errors=errors)
            thawed.set()
            inbox_wait_for(lambda: "the database available again" in caplog.text, "its end told",
                           timeout=10, errors=errors)
    finally:
        thawed.set()
        engine.dispose()


@pytest.mark.postgres
def test_a_tenant_database_frozen_under_its_first_batch_is_told(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant's place is closed until its tables are checked, and was opened only once its batch
    settled: the sweep leaves a closed place alone, so a server that froze under that first batch
    was never read by the sweep, and never told (the tenant frozen-database test failed so, now and
    then). A handler and the sweep's read that wait until released stand in for the freeze; the
    read's bound is shortened to 0.2 s."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    monkeypatch.setattr(gaps_module, "UNANSWERED", 0.2)
    with pg.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA t_a"))
    inbox = Inbox(pg, group="first", tenants=[Tenant("a", schema="t_a")], tenant_header=HEADER,
                  alert=AlertLog())
    inbox.create_tables()
    inbox.create_tables(tenant="a")
    tables = pg.execution_options(schema_translate_map={None: "t_a"})
    business.create_all(tables)
    thawed = threading.Event()

    @inbox.handler("orders")
    def handler(session: Session, message: Message) -> None:
        thawed.wait(30)
        apply_effect(session, message)

    held = type(inbox.storage.held)
    ready = held.ready

    def frozen_ready(self: Any, session: Session, limit: int) -> Any:
        thawed.wait(30)
        return ready(self, session, limit)

    monkeypatch.setattr(held, "ready", frozen_ready)
    broker = InMemoryBroker(partitions=1)
    source = InMemorySource(broker, group_id="first", topics=["orders"])
    first = inbox_record("orders", "k", 1)
    first.headers.append((HEADER, b"a"))
    try:
        with inbox_running(inbox, source) as errors:
            broker.append(first)
            inbox_wait_for(lambda: "the database of tenant a unavailable" in caplog.text,
                           "the freeze under the first batch told", timeout=10, errors=errors)
            thawed.set()
            inbox_wait_for(lambda: applied(tables) == [("k", 1)], "the message applied", errors=errors)
            inbox_wait_for(lambda: "the database of tenant a available again" in caplog.text, "its end told",
                           timeout=10, errors=errors)
    finally:
        thawed.set()


@pytest.mark.slow  # a server of its own, frozen
def test_a_relay_and_an_inbox_stopped_after_their_watches_told_a_freeze_stop_in_time_and_quietly(
        own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen until both the relay's renewal watch and the inbox's sweep watch told it, then both
    stopped (as SIGTERM would): each ``run`` returns within its bound; after the thaw, what they left
    behind (the hung renewal, the release, the sweep's read) raises nothing on any thread and logs
    no error, and no watch tells anything more."""
    caplog.set_level(logging.INFO)
    raised: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(repr(args.exc_value)))
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    relay = Running(Relay(outbox, ScriptedTransport(), worker_id="quiet", lease_ttl=TTL, poll_interval=0.1,
                          metrics=relay_metrics(CollectorRegistry())), stop_timeout=5)
    inbox, broker, source = plain_inbox(engine, "quiet")
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            inbox.run(source, install_signal_handlers=False, stop_timeout=5)
        except BaseException as exc:
            errors.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    frozen = False
    try:
        broker.append(inbox_record("orders", "k", 1))
        inbox_wait_for(lambda: applied(engine) == [("k", 1)], "the message applied", errors=errors)
        wait_for(lambda: relay.relay.leases.owned(), 20, "the relay's lease")
        own_postgres.freeze()
        frozen = True
        wait_for(lambda: "relay quiet: database unreachable" in caplog.text
                 and "the database unavailable" in caplog.text, 15, "both told")
        asked = time.monotonic()
        inbox.stop()
        assert relay.stop(close=False, clean=True) < 5 + 1
        consumer.join(10)
        assert not consumer.is_alive() and errors == []
        assert time.monotonic() - asked < 5 + 5 + 1
        after_stop = len(caplog.records)
        own_postgres.thaw()
        frozen = False
        timers_ended()
        wait_for(lambda: "gave its leases back" in caplog.text or "released" in caplog.text, 15,
                 "the relay's release, which went on, done")
        for thread in threading.enumerate():  # the sweep thread left behind, its read answered
            if thread.name == "outbox-inbox-sweep":
                thread.join(10)
                assert not thread.is_alive(), "the inbox's sweep goes on after its run returned"
    finally:
        if frozen:
            own_postgres.thaw()
        engine.dispose()
    late = [f"{r.levelname} {r.getMessage()}" for r in caplog.records[after_stop:]
            if r.levelno >= logging.ERROR or " unavailable" in r.getMessage()
            or " unreachable" in r.getMessage()]
    assert late == [] and raised == []
