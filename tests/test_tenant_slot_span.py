"""The fleet's slots follow the servers its tenants are on, as tenants come and go (``tenants._slots``).

Two PostgreSQL servers: the shared one and one of the test's own. The limit a server's
steps may hold is all the workers with one server, half with two; it must say so after
every change of the tenants, not only when a server is first met.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, pending, schema_outboxes, wait_for

from outbox import create_engine
from outbox.tenants import Tenant, TenantRelay
from transports.memory import InMemoryBroker, InMemoryTransport

pytestmark = pytest.mark.postgres


def limit(relay: TenantRelay) -> int:
    """How many workers one server's steps may hold now."""
    return relay._slots.steps.limit


def test_a_server_whose_tenants_come_back_is_counted_again(pg: sa.Engine, own_postgres: Any) -> None:
    """Its tenants removed, the other server may take every worker; back, half again: a hung
    server re-added must not take every worker."""
    schema_outboxes(pg, ["h1"])
    other = create_engine(own_postgres.url)
    schema_outboxes(other, ["f1"])
    both = [Tenant("h1", "h1"), Tenant("f1", "f1", database=own_postgres.url)]
    listed = list(both)
    relay = TenantRelay(lambda: listed, lambda: InMemoryTransport(InMemoryBroker()), database=pg,
                        workers=4)
    try:
        relay.refresh()
        assert relay.tenants == ["f1", "h1"]
        assert limit(relay) == 2
        listed[:] = both[:1]
        relay.refresh()
        assert limit(relay) == 4  # one server: nothing to keep free from it
        listed[:] = both
        relay.refresh()
        assert relay.tenants == ["f1", "h1"]
        assert limit(relay) == 2
    finally:
        relay.close()
        other.dispose()


@pytest.mark.slow
def test_a_server_whose_last_tenant_is_removed_mid_step_is_no_longer_counted(
        pg: sa.Engine, own_postgres: Any, topic: str) -> None:
    """Removed while its step hangs on its frozen server, the tenant closes when the step ends
    (thawed): from then on the one server left may take every worker again."""
    healthy = schema_outboxes(pg, ["h1"])
    other = create_engine(own_postgres.url)
    frozen = schema_outboxes(other, ["f1"])
    both = [Tenant("h1", "h1"), Tenant("f1", "f1", database=own_postgres.url)]
    listed = list(both)
    broker = InMemoryBroker()
    relay = TenantRelay(lambda: listed, lambda: InMemoryTransport(broker), database=pg, workers=4,
                        poll_interval=0.1, refresh_every=0.2, lease_ttl=10.0)
    running = Running(relay)
    thawed = True
    try:
        wait_for(lambda: relay.tenants == ["f1", "h1"] and limit(relay) == 2, 30, "both tenants served")
        with frozen["f1"].begin() as session:
            frozen["f1"].publish(session, topic, {"i": 0}, key="k")
        wait_for(lambda: pending(frozen["f1"]) == 0, 30, "f1's first row")
        own_postgres.freeze()
        thawed = False
        time.sleep(1.0)  # f1's next poll reaches the frozen server and waits there
        listed[:] = both[:1]
        time.sleep(1.0)  # the refresh removes it; its step still hangs
        own_postgres.thaw()
        thawed = True
        wait_for(lambda: relay.tenants == ["h1"], 30, "f1 closed once its step ended")
        wait_for(lambda: limit(relay) == 4, 5, "the one server left taking every worker")
        with healthy["h1"].begin() as session:
            healthy["h1"].publish(session, topic, {"i": 1}, key="k")
        wait_for(lambda: pending(healthy["h1"]) == 0, 30, "h1 still published")
    finally:
        if not thawed:
            own_postgres.thaw()
        running.stop()
        other.dispose()
