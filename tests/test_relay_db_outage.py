"""Database outages in ``Relay.run`` that the big outage test does not reach.

A relay started while the database is down must wait for it, not exit; a
relay that owns no shards must count and log one outage as one, not flap
between "unreachable" and "reachable again" on every poll. The server is a
PostgreSQL (or MariaDB) of the test's own, stopped and started on the same port.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from _relay_helpers import ScriptedTransport, publish, rows, wait_for
from prometheus_client import CollectorRegistry

from outbox import Outbox, Relay, create_engine, relay_metrics
from outbox.testing import LocalMariaDB, LocalPostgres

pytestmark = pytest.mark.slow  # each test stops and starts a server of its own: 5-10 s


def assert_one_outage(relay: Relay, caplog: pytest.LogCaptureFixture, worker: str) -> None:
    """One outage counted, and one log line each way: not one per poll or lease period."""
    assert outages(relay) == 1
    assert lines(caplog, worker, "database unreachable") == 1
    assert lines(caplog, worker, "database reachable again") == 1


def running(relay: Relay) -> threading.Thread:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    return thread


def outages(relay: Relay) -> float:
    return relay.metrics.outages.labels("database")._value.get()


def lines(caplog: pytest.LogCaptureFixture, worker: str, text: str) -> int:
    return sum(1 for r in caplog.records if f"relay {worker}:" in r.getMessage() and text in r.getMessage())


def test_a_relay_started_while_the_database_is_down_waits_for_it(
    own_server: LocalPostgres | LocalMariaDB, caplog: pytest.LogCaptureFixture
) -> None:
    own_postgres = own_server  # PostgreSQL, then MariaDB
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox = Outbox(create_engine(own_postgres.url))
    outbox.create_tables()
    publish(outbox, "orders", ["k1", None])
    relay = Relay(outbox, ScriptedTransport(), worker_id="late", poll_interval=0.1, lease_ttl=1.5,
                  metrics=relay_metrics(CollectorRegistry()))
    own_postgres.stop()
    thread = running(relay)
    try:
        time.sleep(3)
        assert thread.is_alive(), "run() ended while the database was down"
        assert lines(caplog, "late", "database unreachable") == 1
        own_postgres.start()
        deadline = time.monotonic() + 15
        while len(rows(outbox, status="published")) < 2:
            assert time.monotonic() < deadline, "not published after the database came back"
            time.sleep(0.05)
    finally:
        relay.stop()
        thread.join(20)
    assert not thread.is_alive()
    assert_one_outage(relay, caplog, "late")
    outbox.engine.dispose()  # type: ignore[union-attr]


@pytest.mark.postgres
def test_a_relay_without_shards_counts_one_outage_once(
    own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox = Outbox(create_engine(own_postgres.url), shards=1)
    outbox.create_tables()
    holder = Relay(outbox, ScriptedTransport(), worker_id="a-holder", lease_ttl=60,
                   metrics=relay_metrics(CollectorRegistry()))
    holder.run_once()  # holds the only shard; sorts first, so its fair share is 1
    idle = Relay(outbox, ScriptedTransport(), worker_id="b-idle", poll_interval=0.1, lease_ttl=1.5,
                 metrics=relay_metrics(CollectorRegistry()))
    thread = running(idle)
    try:
        time.sleep(1)
        assert thread.is_alive() and idle.leases.owned() == {}
        own_postgres.stop()
        time.sleep(4)  # eight lease periods and forty polls
        own_postgres.start()
        deadline = time.monotonic() + 10
        while lines(caplog, "b-idle", "database reachable again") == 0:
            assert time.monotonic() < deadline, "the outage never ended"
            time.sleep(0.1)
        time.sleep(1)
    finally:
        idle.stop()
        thread.join(20)
    assert not thread.is_alive()
    assert_one_outage(idle, caplog, "b-idle")
    outbox.engine.dispose()  # type: ignore[union-attr]


@pytest.mark.postgres
def test_a_relay_whose_mark_the_database_ended_for_idleness_recovers_as_from_one_outage(
    postgres_db: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay stalled inside its mark's transaction past its idle bound (a lease TTL, at least 5 s:
    ``RelayStatements.end_if_idle``) finds it ended by PostgreSQL (25P03, its connection closed) when
    it resumes. That is one database outage, told once each way and counted once, not a failure with
    a traceback; its rows stay pending and are sent again (at least once), and every one is marked."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox = Outbox(create_engine(postgres_db), shards=2)
    outbox.create_tables()
    publish(outbox, "orders", ["k1", "k2", None])
    transport = ScriptedTransport()
    relay = Relay(outbox, transport, worker_id="stalled", poll_interval=0.1, lease_ttl=1.0,
                  metrics=relay_metrics(CollectorRegistry()))
    sql = relay._step._batch.sql
    real_published = sql.published
    stalled = threading.Event()

    def published_then_stall(conn: Any, owner: str, marks: Any, now: Any) -> int:
        marked = real_published(conn, owner, marks, now)
        if marks.ids and not stalled.is_set():  # once: its rows locked, its COMMIT not sent
            stalled.set()
            time.sleep(6.5)  # past the 5 s bound
        return marked

    monkeypatch.setattr(sql, "published", published_then_stall)
    thread = running(relay)
    try:
        wait_for(lambda: len(rows(outbox, status="published")) == 3, 30, "every row marked after the stall")
    finally:
        relay.stop()
        thread.join(20)
    assert stalled.is_set() and not thread.is_alive()
    assert len(transport.sent) >= 6  # each row sent again: its first mark was undone
    assert_one_outage(relay, caplog, "stalled")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    outbox.engine.dispose()  # type: ignore[union-attr]


@pytest.mark.parametrize("work", ["lease renewal", "fetch"])
def test_work_begun_before_a_database_outage_was_told_does_not_end_it(
        sqlite_db: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, work: str) -> None:
    """A restart under the relay: the writer's statement fails and tells the outage, and a lease
    renewal or a fetch that began before, on another connection, answers just after. Taken for the
    database back, it told the outage's end, and the next statement, against the stopped server,
    told a second outage: one restart told twice each way (the official-style CI of b0c620a,
    ``test_exactly_once_start_db_attacks.py::…read_back_and_its_marks…[restarted]``). Only work
    begun after the outage was told ends it."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    relay = Relay(outbox, ScriptedTransport(), worker_id="late-answer",
                  metrics=relay_metrics(CollectorRegistry()))
    relay.run_once()  # its leases taken
    tracker = relay.outages.database

    def told_meanwhile(real: Any) -> Any:
        def answered_after_the_outage_was_told(*args: Any, **kwargs: Any) -> Any:
            answer = real(*args, **kwargs)
            tracker.failed("the server went away while this was under way")
            return answer
        return answered_after_the_outage_was_told

    if work == "lease renewal":
        monkeypatch.setattr(relay.leases, "maintain", told_meanwhile(relay.leases.maintain))
        relay._step.maintain_leases()
    else:
        batch = relay._step._batch
        monkeypatch.setattr(batch.sql, "fetch_params", told_meanwhile(batch.sql.fetch_params))
        relay.run_once()
    assert tracker.down, f"a {work} begun before the outage was told ended it"
    assert "reachable again" not in caplog.text
    monkeypatch.undo()
    relay.run_once()  # begun after: it ends the outage
    assert not tracker.down
    assert caplog.text.count("database reachable again") == 1
    relay.close()
    engine.dispose()
