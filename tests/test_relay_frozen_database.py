"""A database that answers nothing is an outage the relay tells, not a silence.

A frozen server (a hung host, a partition that drops packets, a ``SIGSTOP``) fails no call: no
driver bounds a read on PostgreSQL and the host's kernel answers TCP keepalives, so the relay's
lease renewal and its fetch just waited, its leases lapsed, and no outage was ever logged or
counted; it went on after the thaw as if nothing had happened.
"""

from __future__ import annotations

import logging

import pytest
from _relay_helpers import Running, ScriptedTransport, publish, rows, wait_for
from prometheus_client import CollectorRegistry

from outbox import Outbox, Relay, create_engine, relay_metrics
from outbox.testing import LocalPostgres

TTL = 2.0


def told(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if "relay frozen-db" in r.getMessage() and text in r.getMessage())


@pytest.mark.slow  # a server of its own, frozen
def test_a_frozen_database_is_one_outage_told_within_the_lease_ttl_and_ended_by_the_thaw(
        own_postgres: LocalPostgres, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    transport = ScriptedTransport()
    relay = Relay(outbox, transport, worker_id="frozen-db", lease_ttl=TTL, poll_interval=0.1,
                  metrics=relay_metrics(CollectorRegistry()))
    running = Running(relay, stop_timeout=5)
    try:
        publish(outbox, "orders", ["k1"])
        wait_for(lambda: not rows(outbox, status="pending"), 20, "the first row published")
        own_postgres.freeze()
        try:
            # Told once a renewal has gone unanswered for the lease TTL, 5 s at least.
            wait_for(lambda: told(caplog, "database unreachable") == 1, 10, "the outage told")
            assert "no answer to a lease renewal in 5s" in caplog.text
        finally:
            own_postgres.thaw()
        wait_for(lambda: told(caplog, "reachable again") == 1, 30, "the outage's end told")
        publish(outbox, "orders", ["k2"])
        wait_for(lambda: not rows(outbox, status="pending"), 30, "the row after the thaw published")
    finally:
        running.stop()
    engine.dispose()
    assert [r.key for r in transport.sent] == [b"k1", b"k2"]
    assert told(caplog, "database unreachable") == 1
    assert told(caplog, "reachable again") == 1
    assert relay.metrics.outages.labels("database")._value.get() == 1
