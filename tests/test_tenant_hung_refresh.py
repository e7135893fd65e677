"""A hung server holds none of the fleet's reading of its tenants: a tenant added on it, or one of it
removed, while it hangs, leaves the tenants of the other servers added and served.

The fleet reads its tenants, builds a new tenant's step (reading its stored settings) and gives a
removed one's leases back on its refresher thread. On a hung server each of those waits as long as
the driver does: the refresher waited there, and a tenant added on a healthy server was not served
until the hung one answered (docs/tenants.md, "Hung").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, pending, schema_outboxes, wait_for

from outbox import create_engine
from outbox.tenants import Tenant, TenantRelay
from transports.memory import InMemoryBroker, InMemoryTransport

pytestmark = pytest.mark.postgres


@pytest.fixture
def hung(own_postgres: Any) -> Iterator[sa.Engine]:
    """The fleet's engine on the server the test freezes, every connection of its pool open (as a busy
    fleet's is): a statement waits on one for good, instead of failing at the connect timeout."""
    engine = create_engine(own_postgres.url, pool_size=10, max_overflow=0)
    opened = [engine.connect() for _ in range(10)]
    for conn in opened:
        conn.close()
    yield engine
    engine.dispose()


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_tenant_of_a_hung_server_added_or_removed_holds_up_no_tenant_of_another(
        pg: sa.Engine, hung: sa.Engine, own_postgres: Any, topic: str, change: str) -> None:
    healthy = schema_outboxes(pg, ["h1", "h2"])
    maker = create_engine(own_postgres.url)
    schema_outboxes(maker, ["f1", "f2"])
    maker.dispose()
    listed = [Tenant("h1", "h1"), Tenant("f1", "f1", database=hung)]
    relay = TenantRelay(lambda: list(listed), lambda: InMemoryTransport(InMemoryBroker()), database=pg,
                        workers=4, poll_interval=0.1, refresh_every=0.3, lease_ttl=10.0)
    running = Running(relay)
    frozen = False
    try:
        wait_for(lambda: relay.tenants == ["f1", "h1"], 30, "both tenants served")
        time.sleep(0.5)  # f1's first leases taken: removed, it gives them back
        own_postgres.freeze()
        frozen = True
        if change == "added":
            listed.append(Tenant("f2", "f2", database=hung))  # its stored settings are on the hung server
        else:
            listed.remove(listed[1])  # idle: its leases are given back on the hung server
        time.sleep(1.0)  # the fleet's refresh meets it
        listed.append(Tenant("h2", "h2"))
        with healthy["h2"].begin() as session:
            healthy["h2"].publish(session, topic, {"i": 0}, key="k")
        started = time.monotonic()
        wait_for(lambda: "h2" in relay.tenants and pending(healthy["h2"]) == 0, 15,
                 "a tenant added on the healthy server served while the other hangs")
        print(f"\nh2 served {time.monotonic() - started:.2f} s after it was added")
    finally:
        if frozen:
            own_postgres.thaw()
        running.stop()
