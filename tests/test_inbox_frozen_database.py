"""A database that answers nothing is an outage the inbox tells, not a silence.

A frozen server (a hung host, a partition that drops packets, a ``SIGSTOP``) fails no call: a
transaction on a pooled connection waits as long as the driver does, and the inbox logged nothing.
Its gap sweep reads every second; a read unanswered for ``UNANSWERED`` (10 s, the connect timeout)
is now told as the database's outage, once, and the next read answered after the thaw ends it. The
same for a tenant's database, told under the tenant's name.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

import pytest
import sqlalchemy as sa
from inbox_support import AlertLog, applied, apply_effect, business, record
from sqlalchemy.orm import Session
from test_inbox_holes import running, wait_for

from outbox import Inbox, Message, create_engine
from outbox.tenants import Tenant
from outbox.testing import LocalPostgres
from transports import Record
from transports.memory import InMemoryBroker, InMemorySource

TOPIC = "orders"
HEADER = "x-tenant"
TOLD_WITHIN = 14.0
"""The read's bound (10 s) and a sweep interval (1 s), with room for a loaded host."""


def told(caplog: pytest.LogCaptureFixture, what: str, text: str) -> int:
    return sum(1 for r in caplog.records if r.getMessage().startswith(what + text))


def outage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "available" in r.getMessage()]


@pytest.mark.slow  # a server of its own, frozen
@pytest.mark.postgres
@pytest.mark.parametrize("tenant", [None, "t_a"], ids=["plain", "tenant"])
def test_a_frozen_database_is_one_outage_the_inbox_tells_and_ends_after_the_thaw(
        own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture, tenant: str | None) -> None:
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    engine = create_engine(own_postgres.url)
    if tenant is None:
        inbox = Inbox(engine, group="frozen", alert=AlertLog())
        what = "the database "  # not "the database (sweep) ": the sweep's own failures
    else:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {tenant}"))
        inbox = Inbox(engine, group="frozen", tenants=[Tenant(tenant, schema=tenant)],
                      tenant_header=HEADER, alert=AlertLog())
        what = f"the database of tenant {tenant} "
    inbox.create_tables()
    if tenant is not None:
        inbox.create_tables(tenant=tenant)
    tables = engine if tenant is None else engine.execution_options(schema_translate_map={None: tenant})
    business.create_all(tables)
    applied_at = threading.Event()

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        apply_effect(session, message)
        applied_at.set()

    def message(seq: int) -> Record:
        r = record(TOPIC, "k", seq)
        if tenant is not None:
            r.headers.append((HEADER, tenant.encode()))
        return r

    broker = InMemoryBroker(partitions=1)
    source = InMemorySource(broker, group_id="frozen", topics=[TOPIC])
    try:
        with running(inbox, source) as errors:
            broker.append(message(1))
            wait_for(applied_at.is_set, "the first message applied", errors=errors)
            own_postgres.freeze()
            try:
                wait_for(lambda: told(caplog, what, "unavailable") >= 1, "the outage told",
                         timeout=TOLD_WITHIN, errors=errors)
                assert "no answer to the gap sweep's read in 10s" in caplog.text
            finally:
                own_postgres.thaw()
            wait_for(lambda: told(caplog, what, "available again") >= 1, "the outage's end told",
                     timeout=30, errors=errors)
            broker.append(message(2))
            wait_for(lambda: len(applied(tables)) == 2, "the message after the thaw applied",
                     timeout=30, errors=errors)
    finally:
        engine.dispose()
    assert applied(tables) == [("k", 1), ("k", 2)]
    assert told(caplog, what, "unavailable") == 1, outage_lines(caplog)
    assert told(caplog, what, "available again") == 1, outage_lines(caplog)


def test_a_sweep_answered_ends_no_outage_the_transactions_told(
        sqlite_db: str, caplog: pytest.LogCaptureFixture) -> None:
    """A full disk fails writes, not reads: the sweep's reads, answered every second, must not end
    the outage the transactions told (only the one a read left unanswered), or the log would say
    "unavailable" and "available again" every second until the disk has room."""
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="full", alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    full_until = time.monotonic() + 3.0  # three sweeps

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        if time.monotonic() < full_until:
            raise sa.exc.OperationalError("INSERT INTO effects", {}, sqlite3.OperationalError(
                "database or disk is full"))
        apply_effect(session, message)

    broker = InMemoryBroker(partitions=1)
    source = InMemorySource(broker, group_id="full", topics=[TOPIC])
    with running(inbox, source) as errors:
        broker.append(record(TOPIC, "k", 1))
        wait_for(lambda: applied(engine) == [("k", 1)], "the message applied once the disk has room",
                 errors=errors)
    engine.dispose()
    assert told(caplog, "the database ", "unavailable") == 1, outage_lines(caplog)
    assert told(caplog, "the database ", "available again") == 1, outage_lines(caplog)
