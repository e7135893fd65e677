"""A database that answers nothing is an outage the tenant fleet tells, not a silence.

The fleet's lease renewal of a frozen server (a hung host, a partition that drops packets, a
``SIGSTOP``) fails no call: it waits on a connection the server holds, as do its tenants' steps,
bounded so that other servers' tenants go on (``test_tenant_hung.py``), but nothing was logged or
counted, and the database's gate stayed open for the next turns to wait on it too. A renewal round
unanswered for the lease TTL (5 s at least) now closes the gate, told once; the first work begun
after it that the server answers opens it again.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _relay_helpers import Running, pending, schema_outboxes, wait_for
from prometheus_client import CollectorRegistry

from outbox import create_engine
from outbox.relay import tenant_relay_metrics
from outbox.tenants import Tenant, TenantLabels, TenantRelay
from transports.memory import InMemoryBroker, InMemoryTransport

HEADER = "x-tenant"
ROOMY = 1_000_000 + 256
"""A producer limit with room for the tenant header above the stored limit (1,000,000)."""
TOLD_WITHIN = 8.0
"""The renewal's bound (5 s) and one renewal interval, and less than the connect timeout (10 s): a
step that opened a new connection to the frozen server would tell an outage of its own at 10 s."""


def told(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if "relay frozen-fleet: database" in r.getMessage()
               and text in r.getMessage())


@pytest.mark.slow  # a server of its own, frozen
@pytest.mark.postgres
def test_a_frozen_database_is_one_outage_the_fleet_tells_and_ends_after_the_thaw(
        own_postgres: Any, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    setup = create_engine(own_postgres.url)
    outboxes = schema_outboxes(setup, ["t1", "t2"], shards=1)
    # The fleet's pool, every connection open (as a busy fleet's is): its threads wait on them.
    engine = create_engine(own_postgres.url, pool_size=4, max_overflow=0)
    for conn in [engine.connect() for _ in range(4)]:
        conn.close()
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = TenantRelay([Tenant(name, name) for name in outboxes], lambda: InMemoryTransport(broker),
                        database=engine, workers=2, tenant_header=HEADER, worker_id="frozen-fleet",
                        poll_interval=0.1, lease_ttl=2.0, refresh_every=0.5,
                        metrics=tenant_relay_metrics(TenantLabels(), CollectorRegistry()))
    running = Running(relay, stop_timeout=10)
    try:
        for outbox in outboxes.values():
            with outbox.begin() as session:
                outbox.publish(session, topic, {"n": 1}, key="k")
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 30, "the first rows published")
        own_postgres.freeze()
        try:
            wait_for(lambda: told(caplog, "unreachable") == 1, TOLD_WITHIN, "the outage told")
            assert "no answer to a lease renewal in 5s" in caplog.text
        finally:
            own_postgres.thaw()
        wait_for(lambda: told(caplog, "reachable again") == 1, 30, "the outage's end told")
        for outbox in outboxes.values():
            with outbox.begin() as session:
                outbox.publish(session, topic, {"n": 2}, key="k")
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 30, "the rows after the thaw")
    finally:
        running.stop()
        engine.dispose()
        setup.dispose()
    assert told(caplog, "unreachable") == 1
    assert told(caplog, "reachable again") == 1
    registry = relay.metrics.registry
    outages = registry.get_sample_value("outbox_relay_outages_total", {"dependency": "database"})
    assert outages == 1
    sent = [(dict(r.headers)[HEADER], r.key) for r in broker.records(topic)]
    assert sorted(set(sent)) == [(b"t1", b"k"), (b"t2", b"k")] and len(sent) == 4
