"""On PostgreSQL the relay's fetch is one round trip, and a session it set up is given back as it was.

The fetch's settings (no sort, no JIT, the zone 'UTC') are set once per connection
(``outbox.relay._session``), so that the fetch runs alone in autocommit: next to a
backlog that keeps the database busy, every round trip waits for its CPU (issue 39).
The application may share the relay's pool; its sessions must come back to it with
its own values, whatever the relay set.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _in_process import outbox_in_process
from _pgbouncer import transaction_pooler
from _relay_helpers import Running, ScriptedTransport, owned_leases, publish, rows, wait_for
from conftest import resolved
from typer.testing import CliRunner

import outbox.relay
import outbox.tenants
import transports.kafka
from outbox import Outbox, Relay, create_engine
from outbox.cli import app
from outbox.relay import transaction_pooled_options
from outbox.tenants import Tenant, TenantRelay
from transports.kafka import KafkaTransport

pytestmark = pytest.mark.postgres

LONG_TTL = 600.0
"""A lease TTL whose renewal (every third of it) never comes due within a test, however slow the host:
with the default 10 s, a loaded CI host took the 3.3 s between two steps, and the traced step
renewed its leases besides fetching (CI of b1a6040)."""

SETTINGS = "SELECT current_setting('TimeZone'), current_setting('enable_sort'), current_setting('jit')"


@pytest.fixture
def one_connection(postgres_db: str) -> Iterator[sa.Engine]:
    """An engine whose pool holds one connection: the relay and the application share it."""
    engine = create_engine(postgres_db, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _round_trips(engine: sa.Engine, action: Callable[[], object]) -> list[str]:
    """The messages that wait for the server's answer (a simple Query, or an extended query's Sync)
    that the pool's one connection sent while ``action`` ran, from libpq's protocol trace. Taken
    from ``engine`` (the relay's: anything else would have the relay's session given back)."""
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        pgconn = driver.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            action()
        finally:
            pgconn.untrace()
        trace.seek(0)
        sent = [line for line in trace.read().splitlines() if re.search(r"\tF\t\d+\t(Query|Sync)\b", line)]
    return sent


def test_a_fetch_is_one_round_trip(one_connection: sa.Engine) -> None:
    outbox = Outbox(one_connection)
    outbox.create_tables()
    relay = Relay(outbox, ScriptedTransport(), worker_id="w", lease_ttl=LONG_TTL)
    try:
        relay.run_once()  # leases taken, the session set up
        relay.run_once()
        sent = _round_trips(relay.engine, relay.run_once)  # leases not due: the fetch alone
    finally:
        relay.close()
    assert len(sent) == 1, "\n".join(sent)


def test_the_application_gets_its_session_back_from_the_relay(one_connection: sa.Engine) -> None:
    outbox = Outbox(one_connection)
    outbox.create_tables()
    with one_connection.connect() as conn:  # the application's own session settings, committed
        conn.exec_driver_sql("SET TIME ZONE 'America/Argentina/Buenos_Aires'; SET jit = on; "
                             "SET enable_sort = on")
        conn.commit()
        theirs = conn.exec_driver_sql(SETTINGS).one()
    relay = Relay(outbox, ScriptedTransport(), worker_id="w")
    try:
        for _ in range(2):
            publish(outbox, "t", ["k"])
            relay.run_once()  # the fetch sets the session up; the mark runs on it too
            assert not rows(outbox, status="pending")
            with one_connection.connect() as conn:
                assert conn.exec_driver_sql(SETTINGS).one() == theirs
                conn.rollback()  # the settings came back outside this transaction: they stay
            with one_connection.connect() as conn:
                assert conn.exec_driver_sql(SETTINGS).one() == theirs
                assert conn.exec_driver_sql("SELECT now()::text").scalar_one().endswith("-03")
        relay.run_once()
        with relay.engine.connect() as conn:  # the relay's own connections keep its settings
            assert conn.exec_driver_sql(SETTINGS).one() == ("UTC", "off", "off")
    finally:
        relay.close()


def test_through_a_transaction_mode_pooler_the_relay_sets_nothing_on_a_session(postgres_db: str) -> None:
    """A session is the pooler's to hand to another client: the settings hold for the fetch's
    transaction alone (its four round trips)."""
    engine = create_engine(postgres_db, pool_size=1, max_overflow=0,  # as docs/operations.md says
                           execution_options={"outbox_transaction_pooled": True})
    try:
        outbox = Outbox(engine)
        outbox.create_tables()
        with engine.connect() as conn:
            theirs = conn.exec_driver_sql(SETTINGS).one()
        relay = Relay(outbox, ScriptedTransport(), worker_id="w", lease_ttl=LONG_TTL)
        try:
            publish(outbox, "t", ["k"])
            relay.run_once()
            assert not rows(outbox, status="pending")
            relay.run_once()
            sent = _round_trips(relay.engine, relay.run_once)
            with relay.engine.connect() as conn:
                assert conn.exec_driver_sql(SETTINGS).one() == theirs
        finally:
            relay.close()
    finally:
        engine.dispose()
    assert len(sent) == 4, "\n".join(sent)
    assert any("SET LOCAL enable_sort" in line for line in sent)


@pytest.mark.parametrize("pooled", [True, False])
def test_a_fleet_told_its_databases_are_transaction_pooled_sets_nothing_on_a_session(
        postgres_db: str, pooled: bool) -> None:
    """``TenantRelay(transaction_pooled=True)`` (``outbox relay --tenants --transaction-pooled``):
    the engine the fleet makes for a database named by URL is marked, so no connection of its pool
    keeps the fetch's settings once the fleet has published (unmarked, the fetch's connection does:
    the case that shows this test can tell)."""
    engine = create_engine(postgres_db)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql('CREATE SCHEMA "acme"')
            theirs = tuple(conn.exec_driver_sql(SETTINGS).one())
        acme = Outbox(engine, schema="acme")
        acme.create_tables()
        publish(acme, "t", ["k1", "k2"])
        fleet = TenantRelay([Tenant("acme", schema="acme", database=postgres_db)],
                            lambda: ScriptedTransport(), workers=1, poll_interval=0.1,
                            transaction_pooled=pooled)
        running = Running(fleet)
        try:
            wait_for(lambda: not rows(acme, status="pending"), 30, "the fleet to publish")
        finally:
            running.stop(close=False)
        try:
            [database] = fleet._databases.values()
            # Every connection of its pool, as they are: a raw DBAPI connection is handed out without
            # the checkout event that gives the application its session back (docs/operations.md).
            held = [database.engine.raw_connection() for _ in range(fleet.pool_size)]
            try:
                kept = set()
                for conn in held:
                    cursor = conn.cursor()
                    cursor.execute(SETTINGS)
                    kept.add(tuple(cursor.fetchone()))
                    conn.rollback()
            finally:
                for conn in held:
                    conn.close()
        finally:
            fleet.close()
    finally:
        engine.dispose()
    if pooled:
        assert kept == {theirs}
    else:
        assert ("UTC", "off", "off") in kept


@pytest.mark.parametrize("tenants", [False, True])
def test_outbox_relay_transaction_pooled_marks_the_relays_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        tenants: bool) -> None:
    """``outbox relay --transaction-pooled`` (with ``--tenants`` too) reaches the relay: its engine is
    marked, and the fleet is told to mark the engines it makes."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert CliRunner().invoke(app, ["init-db", "--db", url]).exit_code == 0
    seen: dict[str, Any] = {}

    class Stub:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            source = args[0] if not tenants else kwargs["database"]
            engine = source.engine if isinstance(source, Outbox) else source
            seen.update(marked=engine.get_execution_options().get("outbox_transaction_pooled"),
                        told=kwargs.get("transaction_pooled"))

        def stop(self) -> None: ...
        def run(self) -> None: ...
        def close(self) -> None: ...

    class NoProducer(KafkaTransport):  # librdkafka's threads would outlive the command
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...
        def close(self, timeout: float | None = None) -> None: ...

    monkeypatch.setattr(outbox.relay, "Relay", Stub)
    monkeypatch.setattr(transports.kafka, "KafkaTransport", NoProducer)
    monkeypatch.setattr(outbox.tenants, "TenantRelay", Stub)
    # What the command tunes for its process would stay with the test's: the frozen heap fails
    # every in-process command test after it on this worker (tests/_in_process.py).
    monkeypatch.setattr("outbox.cli._relay.tune_gc_for_batches", lambda: None)
    monkeypatch.setattr(outbox.tenants, "tune_switch_interval", lambda: None)
    args = ["relay", "--db", url, "--bootstrap-servers", "127.0.0.1:9", "--transaction-pooled"]
    result = outbox_in_process(capfd, *args, *(["--tenants", "acme"] if tenants else []), cwd=tmp_path)
    assert seen.get("marked") is True, (result.returncode, result.stderr[-2000:])
    if tenants:
        assert seen["told"] is True


@pytest.fixture
def through_pgbouncer(postgres_db: str) -> Iterator[str]:
    """``postgres_db`` through a PgBouncer of the test's own in transaction mode, one server connection."""
    yield from resolved(lambda: transaction_pooler(postgres_db))


def test_through_pgbouncer_a_fleet_finds_its_listen_deaf_and_polls_instead_of_backing_off(
        postgres_db: str, through_pgbouncer: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a transaction-mode PgBouncer a LISTEN succeeds and hears nothing. Believed, it let an
    idle tenant's polls back off as if a notification would wake it, and a message written after
    some idle seconds waited for the backed-off poll (up to a minute). The listener's probe finds it
    deaf: the tenant is polled every poll interval, and the reason is logged once.

    Counted as polls after the probe, not timed as one message: polled every 0.1 s, twenty polls
    take seconds (a minute allowed: 3 s a fetch); backed off (0.2, 0.4, 0.8 ... s apart, less a
    quarter at most) the tenth alone would come more than 75 s after the first. (Timed, a message
    written 7 s in had to go within 1.5 s where a backed-off poll came 2.4 s or more later: a
    margin a loaded host could eat.)"""
    from outbox.relay import RelayStep

    polls: list[float] = []
    original = RelayStep.run_batch

    def counted(step: RelayStep, *, wait: bool, **kwargs: Any) -> Any:
        polls.append(time.monotonic())
        return original(step, wait=wait, **kwargs)

    monkeypatch.setattr(RelayStep, "run_batch", counted)

    def deaf() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no notification came back" in r.getMessage()]

    engine = create_engine(postgres_db)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql('CREATE SCHEMA "acme"')
        acme = Outbox(engine, schema="acme")
        acme.create_tables()
        fleet = TenantRelay([Tenant("acme", schema="acme", database=through_pgbouncer)],
                            lambda: ScriptedTransport(), workers=1, poll_interval=0.1,
                            transaction_pooled=True)
        running = Running(fleet)
        try:
            wait_for(deaf, 30, "the listener's probe to find it deaf")
            found_deaf = len(polls)
            wait_for(lambda: len(polls) >= found_deaf + 20, 60,
                     "twenty polls after the probe (every 0.1 s; backed off, nine at most)")
            publish(acme, "t", ["k1"])  # straight to PostgreSQL: its notification reaches no one
            wait_for(lambda: not rows(acme, status="pending"), 20, "the fleet to publish")
        finally:
            running.stop()
    finally:
        engine.dispose()
    assert len(deaf()) == 1, deaf()


@pytest.mark.parametrize("marked", [True, False])
def test_through_pgbouncer_the_next_client_gets_the_servers_settings_not_the_relays(
        postgres_db: str, through_pgbouncer: str, marked: bool) -> None:
    """A real PgBouncer in transaction mode, one server connection for every client: the client
    after the relay gets the server connection the relay used. With the engine marked
    (``--transaction-pooled``) it gets the server's own settings; unmarked, the relay's (no sort,
    no JIT, the zone 'UTC') would reach it: the hazard the mark is for, shown here so that this
    test can tell."""
    direct = create_engine(postgres_db, poolclass=sa.NullPool)
    with direct.connect() as conn:
        servers = tuple(conn.exec_driver_sql(SETTINGS).one())
    direct.dispose()
    no_prepared = {"prepare_threshold": None}  # PgBouncer before 1.21 keeps no prepared statement
    engine = create_engine(through_pgbouncer, connect_args=no_prepared,
                           execution_options={"outbox_transaction_pooled": True} if marked else {})
    other = create_engine(through_pgbouncer, connect_args=no_prepared, poolclass=sa.NullPool)
    try:
        outbox = Outbox(engine)
        outbox.create_tables()
        relay = Relay(outbox, ScriptedTransport(), worker_id="w")
        try:
            publish(outbox, "t", ["k1", "k2"])
            relay.run_once()
            relay.run_once()
            # Before anything of the relay's pool runs again: its next checkout by the application
            # (``rows``) would give the session back, settings and all.
            with other.connect() as conn:
                theirs = tuple(conn.exec_driver_sql(SETTINGS).one())
            assert not rows(outbox, status="pending")
        finally:
            relay.close()
    finally:
        other.dispose()
        engine.dispose()
    if marked:
        assert theirs == servers
    else:  # PgBouncer puts a client's TimeZone back itself, not the others
        assert theirs[1:] == ("off", "off") and servers[1:] != ("off", "off")




@pytest.mark.parametrize("made_by", ["outbox relay", "outbox relay --tenants"])
def test_through_pgbouncer_an_engine_made_for_transaction_pooling_prepares_nothing(
        through_pgbouncer: str, made_by: str) -> None:
    """``--transaction-pooled`` on a psycopg URL: the engines the command makes (a relay's, a fleet's)
    prepare no statement. psycopg prepares a statement on its fifth run on a connection, naming it
    ``_pg3_0``, ``_pg3_1``, … per client connection; behind a PgBouncer that keeps no prepared
    statement (before 1.21, or without ``max_prepared_statements``) another client's statement of
    that name is already on the server connection the relay's transaction gets ("prepared statement
    "_pg3_0" already exists"), or its own is not ("does not exist"). Here another client prepared
    first, on the pooler's one server connection; the relay then fetches and marks many times."""
    url = sa.make_url(through_pgbouncer).set(drivername="postgresql+psycopg").render_as_string(
        hide_password=False)
    bystander = sa.create_engine(url, poolclass=sa.NullPool)  # psycopg's defaults: prepares on run 5
    with bystander.connect() as conn:
        for _ in range(6):
            conn.exec_driver_sql("SELECT 1 WHERE 1 = %(one)s", {"one": 1}).all()
            conn.commit()
        prepared = conn.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements").scalar_one()
    assert prepared >= 1, "the bystander prepared nothing: this test could not tell"
    bystander.dispose()
    pooled = transaction_pooled_options(url)  # what outbox relay --transaction-pooled makes its engine with
    app_outbox = Outbox(create_engine(url, **pooled))
    app_outbox.create_tables()
    if made_by == "outbox relay":
        relay = Relay(Outbox(create_engine(url, **pooled)), ScriptedTransport())
        try:
            for round_ in range(8):
                publish(app_outbox, "t", [f"k{round_}"])
                relay.run_once()
                assert not rows(app_outbox, status="pending")
        finally:
            relay.close()
            relay.outbox.engine.dispose()
        assert owned_leases(app_outbox) == 0, "the relay could not release its leases"
    else:
        fleet = TenantRelay([Tenant("default", database=url)], lambda: ScriptedTransport(), workers=1,
                            poll_interval=0.05, transaction_pooled=True)
        running = Running(fleet)
        try:
            for round_ in range(8):
                publish(app_outbox, "t", [f"k{round_}"])
                wait_for(lambda: not rows(app_outbox, status="pending"), 20, f"round {round_} published")
        finally:
            running.stop()
        assert owned_leases(app_outbox) == 0, "the fleet could not release its leases"
    app_outbox.engine.dispose()
