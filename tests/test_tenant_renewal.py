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
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, owned_leases, schema_outboxes, wait_for

from outbox import Outbox
from outbox.relay import RelayStep
from outbox.tenants import TenantRelay
from outbox.tenants._renewal import LeaseRenewal
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
    return [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]


def test_a_renewal_round_costs_a_few_statements_a_tenant(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 idle tenants holding their leases: a round is the heartbeat, one read of the live relays
    with the shard count, the renewal (and now and then forgetting dead relays), no savepoints.
    Before, it was seven a tenant: savepoint, heartbeat, delete, two reads, renewal, release."""
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
    per_tenant = sum(n for _, n in steady) / (40 * len(steady))
    assert per_tenant <= 3.5, (per_tenant, steady)  # 3 a round, and forgetting the dead once per TTL
    assert not [s for s in statements if s.upper().startswith(("SAVEPOINT", "RELEASE"))]


def test_one_tenants_failing_renewal_undoes_none_of_the_others_in_its_chunk(
        pg: sa.Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``b`` (between ``a`` and ``c`` in one chunk) fails its renewal with a database error, as if its
    tables were gone: that round still renews ``a``'s and ``c``'s leases, and only ``b`` fails."""
    outboxes = schema_outboxes(pg, ["a", "b", "c"], shards=2)
    armed = threading.Event()
    seen: dict[str, list[timedelta]] = {}
    maintain, renew = RelayStep.maintain_leases, LeaseRenewal.renew

    def failing(self: RelayStep, conn: sa.Connection | None = None) -> dict[int, int]:
        if conn is not None and armed.is_set() and (
                conn.get_execution_options().get("schema_translate_map") or {}).get(None) == "b":
            conn.exec_driver_sql("SELECT * FROM no_such_table")  # aborts the transaction on PostgreSQL
        return maintain(self, conn)

    def watched(self: LeaseRenewal, db: Any, engine: sa.Engine) -> None:
        if not armed.is_set():
            renew(self, db, engine)
            return
        before = {name: expiries(outboxes[name]) for name in ("a", "c")}
        renew(self, db, engine)
        after = {name: expiries(outboxes[name]) for name in ("a", "c")}
        for name in ("a", "c"):
            seen[name] = [later - earlier for earlier, later in zip(before[name], after[name], strict=True)]
        armed.clear()

    caplog.set_level(logging.WARNING, logger="outbox.relay")
    monkeypatch.setattr(RelayStep, "maintain_leases", failing)
    monkeypatch.setattr(LeaseRenewal, "renew", watched)
    running = Running(fleet(["a", "b", "c"], pg, poll_interval=60, lease_ttl=3.0))
    try:
        wait_for(lambda: all(owned_leases(o) == 2 for o in outboxes.values()), 30, "every tenant's leases")
        armed.set()
        wait_for(lambda: not armed.is_set(), 10, "the round in which b fails")
        time.sleep(5)
    finally:
        running.stop()
    assert all("tenant b " in m for m in failures(caplog)), failures(caplog)
    assert set(seen) == {"a", "c"}
    for name, moved in seen.items():
        assert len(moved) == 2 and all(m.total_seconds() > 0 for m in moved), (name, moved)
