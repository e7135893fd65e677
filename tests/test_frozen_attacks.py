"""Attacks on the frozen-database watches (``told_if_late``): faults their own tests do not list.

A database that is slow but not frozen (a lease row locked by another transaction for longer than
the bound), a stop while a watched call hangs: each outage told once each way, nothing lost, and
nothing told by a watch once the worker it watched for has stopped.
"""

from __future__ import annotations

import logging
import threading

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, ScriptedTransport, owned_leases, publish, rows, schema_outboxes, wait_for
from inbox_support import AlertLog, applied, apply_effect, business
from inbox_support import record as inbox_record
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session
from test_inbox_holes import running as inbox_running
from test_inbox_holes import wait_for as inbox_wait_for

from outbox import Inbox, Message, Outbox, Relay, relay_metrics
from outbox.core._wire import SEQ
from outbox.relay import tenant_relay_metrics
from outbox.tenants import Tenant, TenantLabels, TenantRelay
from transports import Record
from transports.memory import InMemoryBroker, InMemorySource, InMemoryTransport

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
                         caplog: pytest.LogCaptureFixture) -> list[str]:
    """``worker``'s heartbeat row locked until its renewal waits on it, then ``running`` stopped within
    its bound; what was told of the database once ``run`` returned and every watch ended."""
    holder = lock_heartbeat(pg, outbox, worker)
    try:
        wait_for(lambda: waiting_on_a_lock(pg, ""), 10, "the renewal waiting")
        assert running.stop(close=False) < 5 + 1
        after_stop = len(caplog.records)
        timers_ended()  # the hanging renewal's watch: past its 5 s
        return [r.getMessage() for r in caplog.records[after_stop:] if "unreachable" in r.getMessage()]
    finally:
        holder.rollback()
        holder.close()


@pytest.mark.postgres
def test_a_relay_stopped_while_its_renewal_hangs_tells_nothing_after_its_run_returned(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Stopped 0-5 s into a renewal that hangs (a lock here, a frozen server alike): ``run`` returns
    within its bound, and the renewal's watch must not tell an outage (a WARNING, a counted outage)
    of a relay that has stopped, seconds after its last line said so."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox = Outbox(pg, shards=1)
    outbox.create_tables()
    relay = Relay(outbox, ScriptedTransport(), worker_id="stopped", lease_ttl=TTL, poll_interval=0.1,
                  metrics=relay_metrics(CollectorRegistry()))
    running = Running(relay, stop_timeout=5)
    wait_for(lambda: relay.leases.owned(), 20, "the relay's lease")
    assert stopped_while_hanging(pg, outbox, "stopped", running, caplog) == []
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


@pytest.mark.postgres
def test_an_inbox_stopped_while_its_sweep_read_hangs_tells_nothing_after_its_run_returned(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """The gap sweep's read hangs (its table locked here, a frozen server alike) and the inbox is
    stopped before the read's 10 s bound: ``run`` returns, and the read's watch must not say the
    database is unavailable after that."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    inbox = Inbox(pg, group="stopped", alert=AlertLog())
    inbox.create_tables()
    business.create_all(pg)

    @inbox.handler("orders")
    def handler(session: Session, message: Message) -> None:
        apply_effect(session, message)

    broker = InMemoryBroker(partitions=1)
    source = InMemorySource(broker, group_id="stopped", topics=["orders"])
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
