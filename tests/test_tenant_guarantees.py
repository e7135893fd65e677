"""The relay's guarantees, again through a ``TenantRelay`` serving several tenants (issue 27).

Every test runs in two layouts (the ``layout`` fixture):

- ``schemas``: three tenants, three schemas of one PostgreSQL database, the
  fleet's default database;
- ``databases``: three tenants, each a database of its own: PostgreSQL's
  default schema, a schema of a second PostgreSQL database, and a MariaDB
  database, all in one fleet.

Each tenant publishes to a topic of its own (``<topic>-<tenant>``), so a fault
can be aimed at one tenant's key through the workers' in-memory transports;
every record must carry its tenant's name in the tenant header, and per
tenant per key the first occurrences of the seqs are 1, 2, 3 ... .
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
import tenacity
from _relay_helpers import publish, rows, seqs_by_key, wait_for

from outbox import Alert, Outbox, create_engine
from outbox.tenants import Tenant, TenantRelay
from outbox.testing import fresh_database
from transports import Outcome, Record, SendResult
from transports.memory import InMemoryBroker, InMemoryTransport

MESSAGE_ID = "outbox-message-id"  # the envelope header (docs/guarantees.md)
HEADER = "x-tenant"
ROOMY = 1_000_000 + 256
"""A producer limit with room for the tenant header above the stored limit (1,000,000)."""
FAST = tenacity.wait_fixed(0.05)
NAMES = ["acme", "globex", "initech"]


@dataclass
class Layout:
    """The tenants of one layout, the fleet's default database and the test's own outboxes."""

    kind: str
    tenants: list[Tenant]
    outboxes: dict[str, Outbox]
    database: sa.Engine | None


@pytest.fixture(params=[pytest.param("schemas", marks=pytest.mark.postgres),
                        pytest.param("databases", marks=[pytest.mark.postgres, pytest.mark.mysql])])
def layout(request: pytest.FixtureRequest, postgres_db: str) -> Iterator[Layout]:
    engines: list[sa.Engine] = []

    def outbox_on(url: str | sa.Engine, schema: str | None = None) -> Outbox:
        engine = url if isinstance(url, sa.Engine) else create_engine(url)
        if engine not in engines:
            engines.append(engine)
        if schema is not None:
            with engine.begin() as conn:
                conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        outbox = Outbox(engine, schema=schema, shards=4)
        outbox.create_tables()
        return outbox

    try:
        if request.param == "schemas":
            pg = create_engine(postgres_db)
            outboxes = {name: outbox_on(pg, name) for name in NAMES}
            yield Layout("schemas", [Tenant(name, schema=name) for name in NAMES], outboxes, pg)
        else:
            mariadb = request.getfixturevalue("mysql_db")
            server = request.getfixturevalue("postgres_server")
            with fresh_database(server) as second:
                places = {"acme": (postgres_db, None), "globex": (second, "globex"),
                          "initech": (mariadb, None)}
                tenants = [Tenant(name, schema=schema, database=url)
                           for name, (url, schema) in places.items()]
                outboxes = {name: outbox_on(url, schema) for name, (url, schema) in places.items()}
                yield Layout("databases", tenants, outboxes, None)
                for engine in engines:  # before the database is dropped
                    engine.dispose()
    finally:
        for engine in engines:
            engine.dispose()


def tenant_topic(topic: str, name: str) -> str:
    return f"{topic}-{name}"


class Fleet:
    """A ``TenantRelay`` over a layout, with its workers' transports at hand for faults."""

    def __init__(self, layout: Layout, broker: InMemoryBroker, *,
                 make: type[InMemoryTransport] = InMemoryTransport, **kwargs: Any) -> None:
        self.transports: list[InMemoryTransport] = []

        def transport() -> InMemoryTransport:
            made = make(broker)
            self.transports.append(made)
            return made
        options: dict[str, Any] = dict(tenant_header=HEADER, poll_interval=0.1, lease_ttl=3.0,
                                       refresh_every=0.5, backoff=FAST, database=layout.database)
        options.update(kwargs)
        self.relay = TenantRelay(layout.tenants, transport, **options)
        self.error: list[BaseException] = []
        self.thread: threading.Thread | None = None

    def start(self) -> Fleet:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.relay.run(stop_timeout=20)
        except BaseException as exc:
            self.error.append(exc)

    def stop(self) -> None:
        self.relay.stop()
        if self.thread is not None:
            self.thread.join(30)
            assert not self.thread.is_alive()
        self.relay.close()
        assert self.error == []


def pending(outbox: Outbox) -> int:
    return len(rows(outbox, status="pending"))


def all_sent(layout: Layout) -> bool:
    return all(pending(outbox) == 0 for outbox in layout.outboxes.values())


def publish_everywhere(layout: Layout, topic: str, keys: Sequence[str]) -> None:
    for name, outbox in layout.outboxes.items():
        publish(outbox, tenant_topic(topic, name), keys)


def check_tenants_and_order(layout: Layout, broker: InMemoryBroker, topic: str) -> None:
    """Every tenant's every row published and on its topic under its name, per key in seq order."""
    for name, outbox in layout.outboxes.items():
        stored = rows(outbox)
        assert {r.status for r in stored} == {"published"}, name
        records = broker.records(tenant_topic(topic, name))
        assert {dict(r.headers)[MESSAGE_ID].decode() for r in records} == {str(r.message_id) for r in stored}
        for record in records:
            assert [v for n, v in record.headers if n == HEADER] == [name.encode()]
        expected: dict[bytes, list[int]] = {}
        for row in stored:
            expected.setdefault(row.key.encode(), []).append(row.seq)
        assert seqs_by_key(records) == {k: sorted(v) for k, v in expected.items()}, name
        assert all(v == list(range(1, len(v) + 1)) for v in expected.values())


def drain(fleet: TenantRelay, layout: Layout, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all_sent(layout):
        assert time.monotonic() < deadline, "still pending"
        fleet.run_once()
        time.sleep(0.02)


def test_per_key_order_holds_across_retries_and_injected_failures(layout: Layout, topic: str) -> None:
    keys = [f"k{i % 5}" for i in range(100)]
    publish_everywhere(layout, topic, keys)
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    fleet = Fleet(layout, broker, workers=2, batch_size=17)
    for transport in fleet.transports:  # retries of every tenant, on whichever worker serves it
        for name in layout.outboxes:
            for key in ("k0", "k3"):
                transport.fail(topic=tenant_topic(topic, name), key=key, times=3)
            transport.fail(topic=tenant_topic(topic, name), times=2)
    fleet.start()
    try:
        wait_for(lambda: all_sent(layout), 30, "every tenant drained")
    finally:
        fleet.stop()
    assert sum(t.injected for t in fleet.transports) >= 3 * 8  # the faults struck
    check_tenants_and_order(layout, broker, topic)


def test_a_failed_row_blocks_only_its_key_in_its_tenant(layout: Layout, topic: str) -> None:
    publish_everywhere(layout, topic, ["a", "a", "b"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    alerts: list[Alert] = []
    fleet = Fleet(layout, broker, workers=1, alert=alerts.append)
    victim = "globex"
    fleet.transports[0].fail(topic=tenant_topic(topic, victim), key="a", outcome=Outcome.FAILED,
                             error="poison")
    try:
        for _ in range(5):
            fleet.relay.run_once()
    finally:
        fleet.relay.close()
    for name, outbox in layout.outboxes.items():
        statuses = [(r.key, r.status) for r in rows(outbox)]
        if name == victim:
            assert statuses == [("a", "failed"), ("a", "pending"), ("b", "published")]
        else:
            assert statuses == [("a", "published"), ("a", "published"), ("b", "published")], name
    assert [(a.kind, a.key, a.tenant) for a in alerts] == [("message_failed", "a", victim)]


def test_a_broker_outage_costs_no_attempt_in_any_tenant(layout: Layout, topic: str) -> None:
    publish_everywhere(layout, topic, ["a", "b", "a"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    fleet = Fleet(layout, broker, workers=1)
    fleet.transports[0].down = True
    try:
        results = fleet.relay.run_once()
        assert sorted(results) == NAMES
        assert all(r.broker_unreachable for r in results.values()), results
        for _ in range(3):  # and again, as the keys' waits allow
            time.sleep(0.1)
            fleet.relay.run_once()
        for outbox in layout.outboxes.values():
            assert {(r.status, r.attempts) for r in rows(outbox)} == {("pending", 0)}
        assert fleet.relay.broker_outage.down
        fleet.transports[0].down = False
        drain(fleet.relay, layout)
    finally:
        fleet.relay.close()
    for outbox in layout.outboxes.values():
        assert {r.attempts for r in rows(outbox)} == {1}
    check_tenants_and_order(layout, broker, topic)


def owners(outbox: Outbox) -> dict[int, str | None]:
    t = outbox.tables.leases
    engine = outbox.engine
    assert isinstance(engine, sa.Engine)
    with engine.connect() as conn:
        return {row.shard: row.owner for row in conn.execute(
            sa.select(t.c.shard, t.c.owner).where(t.c.expires_at > datetime.now(UTC)))}


def test_two_fleets_split_every_tenants_leases_and_hand_them_over_on_stop(layout: Layout, topic: str) -> None:
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    first = Fleet(layout, broker, worker_id="fleet-a", lease_ttl=1.5).start()
    second = Fleet(layout, broker, worker_id="fleet-b", lease_ttl=1.5).start()
    stopped = False
    try:
        split = {"fleet-a": 2, "fleet-b": 2}
        for name, outbox in layout.outboxes.items():
            wait_for(lambda o=outbox: sorted(
                list(owners(o).values()).count(w) for w in split) == [2, 2], 20, f"{name}'s shards split")
        publish_everywhere(layout, topic, [f"k{i % 7}" for i in range(70)])
        wait_for(lambda: all_sent(layout), 20, "both fleets publish")
        first.stop()
        stopped = True
        for name, outbox in layout.outboxes.items():
            wait_for(lambda o=outbox: list(owners(o).values()) == ["fleet-b"] * 4,
                     20, f"{name}'s shards handed over")
        publish_everywhere(layout, topic, [f"k{i % 7}" for i in range(70)])
        wait_for(lambda: all_sent(layout), 20, "the remaining fleet publishes every tenant")
    finally:
        if not stopped:
            first.stop()
        second.stop()
    check_tenants_and_order(layout, broker, topic)


class CrashAfterSend(InMemoryTransport):
    """Delivers, then dies before the relay can mark: a fleet process killed between the two."""

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        super().publish(records)
        raise KeyboardInterrupt  # not an Exception: nothing of the fleet handles it, as with SIGKILL


def test_a_fleet_killed_between_send_and_mark_loses_and_reorders_nothing(layout: Layout, topic: str) -> None:
    keys = [f"k{i % 4}" for i in range(40)]
    publish_everywhere(layout, topic, keys)
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    dead = Fleet(layout, broker, make=CrashAfterSend, worker_id="dead", lease_ttl=1.0, batch_size=15)
    dead.relay.refresh()
    dead.relay._workers.bind(0)  # this thread is the dead fleet's worker
    for name in layout.outboxes:  # each tenant's first batch is sent, never marked, its leases kept
        relay = dead.relay.relay_of(name)
        assert relay is not None
        with pytest.raises(KeyboardInterrupt):
            relay.run_once()
    assert all(pending(o) == len(keys) for o in layout.outboxes.values())
    assert all(len(broker.records(tenant_topic(topic, n))) == 15 for n in layout.outboxes)
    heir = Fleet(layout, broker, worker_id="heir", lease_ttl=1.0).start()
    try:
        wait_for(lambda: all_sent(layout), 20, "the heir publishes once the dead fleet's leases expire")
    finally:
        heir.stop()
    check_tenants_and_order(layout, broker, topic)
    for name in layout.outboxes:  # the first batch twice: redeliveries of the same messages
        assert len(broker.records(tenant_topic(topic, name))) == len(keys) + 15


def test_a_fleet_that_lost_its_lease_marks_nothing(layout: Layout, topic: str) -> None:
    publish_everywhere(layout, topic, ["a", "b", "c"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    other = Fleet(layout, broker, worker_id="other", lease_ttl=0.5)
    other.relay.refresh()

    class Paused(InMemoryTransport):
        def publish(self, records: Sequence[Record]) -> list[SendResult]:
            results = super().publish(records)  # the broker acks, then this fleet stalls past its TTL
            time.sleep(0.7)
            (name,) = {dict(r.headers)[HEADER].decode() for r in records}
            relay = other.relay.relay_of(name)
            assert relay is not None
            relay.leases.maintain()  # the other fleet takes that tenant's expired shards over
            return results

    paused = Fleet(layout, broker, make=Paused, worker_id="paused", lease_ttl=0.5)
    try:
        results = paused.relay.run_once()
        assert {name: (r.sent, r.published, r.fenced) for name, r in results.items()} == {
            name: (3, 0, 3) for name in NAMES}
        assert all({r.status for r in rows(o)} == {"pending"} for o in layout.outboxes.values())
        drain(other.relay, layout)
    finally:
        paused.relay.close()
        other.relay.close()
    check_tenants_and_order(layout, broker, topic)
