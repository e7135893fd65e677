"""``TenantRelay``: one relay process for many tenant schemas and databases (issue 27).

Each test runs a real relay fleet on a real PostgreSQL (several schemas of one
database, and databases of their own) into the in-memory broker, whose
records say what was sent: every tenant's rows arrive, in per-key order, with
the tenant's name in the tenant header and only there.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, owned_leases, pending, wait_for

from outbox import ConfigurationError, Outbox, create_engine
from outbox.relay._closers import Closers
from outbox.tenants import Tenant, TenantRelay
from transports import Record, SendResult
from transports.memory import InMemoryBroker, InMemoryTransport

pytestmark = pytest.mark.postgres

HEADER = "x-tenant"
SEQ = "outbox-seq"
"""The envelope's seq header (docs/guarantees.md, the wire format)."""
ROOMY = 1_000_000 + 256
"""A producer limit with room for the tenant header above the stored limit (1,000,000)."""


@pytest.fixture
def pg(postgres_db: str) -> Iterator[sa.Engine]:
    engine = create_engine(postgres_db)
    yield engine
    engine.dispose()


def make_tenants(engine: sa.Engine, names: list[str],
                 shards: dict[str, int] | None = None) -> dict[str, Outbox]:
    outboxes = {}
    with engine.begin() as conn:
        for name in names:
            conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
    for name in names:
        outbox = Outbox(engine, schema=name, shards=(shards or {}).get(name, 4))
        outbox.create_tables()
        outboxes[name] = outbox
    return outboxes


def publish(outbox: Outbox, topic: str, keys: list[str], **kwargs: Any) -> None:
    with outbox.begin() as session:
        for i, key in enumerate(keys):
            outbox.publish(session, topic, {"i": i, "key": key}, key=key, **kwargs)


def header(record: Record, name: str) -> list[bytes]:
    return [value for n, value in record.headers if n == name]



def fleet(tenants: Any, broker: InMemoryBroker, **kwargs: Any) -> TenantRelay:
    options: dict[str, Any] = dict(tenant_header=HEADER, poll_interval=0.1, lease_ttl=5.0, refresh_every=0.5)
    options.update(kwargs)
    return TenantRelay(tenants, lambda: InMemoryTransport(broker), **options)


def test_every_tenant_is_sent_in_key_order_under_its_own_name(pg: sa.Engine, topic: str) -> None:
    outboxes = make_tenants(pg, ["acme", "globex", "initech"], shards={"acme": 2, "globex": 8, "initech": 16})
    for outbox in outboxes.values():
        # The same keys in every tenant: their seqs are the tenant's own, 1, 2, 3 …
        publish(outbox, topic, ["k1", "k2", "k1", "k3", "k1"] * 20)
        # A producer that names another tenant in the header is overruled by the relay.
        publish(outbox, topic, ["k1"], headers={HEADER: "someone-else"})
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet(list(outboxes), broker, database=pg))
    try:
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 20, "every tenant drained")
    finally:
        running.stop()
    records = broker.records(topic)
    assert len(records) == 3 * 101
    seqs: dict[tuple[bytes, bytes | None], list[int]] = {}
    for record in records:
        (tenant,) = header(record, HEADER)
        seqs.setdefault((tenant, record.key), []).append(int(header(record, SEQ)[0]))
    assert {tenant for tenant, _ in seqs} == {b"acme", b"globex", b"initech"}
    for place, got in seqs.items():
        assert got == list(range(1, len(got) + 1)), place


def test_a_tenant_without_tables_is_reported_once_and_the_others_flow(
        pg: sa.Engine, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    outboxes = make_tenants(pg, ["good"])
    with pg.begin() as conn:
        conn.exec_driver_sql('CREATE SCHEMA "empty"')
    publish(outboxes["good"], topic, ["a", "b"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    running = Running(fleet(["empty", "good"], broker, database=pg))
    try:
        wait_for(lambda: pending(outboxes["good"]) == 0, 20, "the good tenant drained")
        wait_for(lambda: len(broker.records(topic)) == 2, 5, "its records")
        publish(outboxes["good"], topic, ["c"])
        wait_for(lambda: len(broker.records(topic)) == 3, 10, "a later record")
    finally:
        running.stop()
    about_empty = [r for r in caplog.records if "tenant empty" in r.getMessage()]
    assert len(about_empty) == 1, [r.getMessage() for r in about_empty]
    assert "cannot be served" in about_empty[0].getMessage()
    assert running.relay.tenants == []  # closed


def test_tenants_come_and_go_while_it_runs(pg: sa.Engine, topic: str) -> None:
    outboxes = make_tenants(pg, ["t1", "t2"])
    current = ["t1"]
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet(lambda: list(current), broker, database=pg, refresh_every=0.2))
    try:
        publish(outboxes["t1"], topic, ["a"])
        publish(outboxes["t2"], topic, ["a"])
        wait_for(lambda: pending(outboxes["t1"]) == 0, 20, "t1 served")
        assert pending(outboxes["t2"]) == 1  # not a tenant yet
        current.append("t2")
        wait_for(lambda: pending(outboxes["t2"]) == 0, 20, "t2 served once listed")
        current.remove("t1")
        wait_for(lambda: running.relay.tenants == ["t2"], 20, "t1 dropped")
        publish(outboxes["t1"], topic, ["b"])
        publish(outboxes["t2"], topic, ["b"])
        wait_for(lambda: pending(outboxes["t2"]) == 0, 20, "t2 still served")
        assert pending(outboxes["t1"]) == 1
        # t1's leases were given back when it was dropped: nobody holds them now.
        leases = outboxes["t1"].tables.leases
        with pg.connect() as conn:
            assert conn.scalar(sa.select(sa.func.count()).where(leases.c.owner.is_not(None))) == 0
    finally:
        running.stop()


def test_a_tenant_removed_mid_step_is_served_until_that_step_ends(
        pg: sa.Engine, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """``tenants`` names what may still send: a tenant removed while a worker runs its step is
    listed until that step ends and it is closed, so "no longer listed" means "sends nothing"."""
    outboxes = make_tenants(pg, ["t1", "t2"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    sending, release = threading.Event(), threading.Event()

    class Holding(InMemoryTransport):
        def publish(self, records: Sequence[Record]) -> list[SendResult]:
            if any(header(record, HEADER) == [b"t1"] for record in records):
                sending.set()
                release.wait(30)
            return super().publish(records)

    current = ["t1", "t2"]
    caplog.set_level(logging.INFO, logger="outbox.relay")
    relay = TenantRelay(lambda: list(current), lambda: Holding(broker), tenant_header=HEADER,
                        poll_interval=0.1, lease_ttl=5.0, refresh_every=0.2, database=pg)
    running = Running(relay)
    try:
        publish(outboxes["t1"], topic, ["a"])
        assert sending.wait(20), "t1's step never sent"
        current.remove("t1")
        wait_for(lambda: any("tenant t1 removed" in r.getMessage() for r in caplog.records), 20,
                 "t1's removal read")
        assert relay.tenants == ["t1", "t2"]  # its step still runs: it may still send
        release.set()
        wait_for(lambda: relay.tenants == ["t2"], 20, "t1 closed once its step ended")
        publish(outboxes["t1"], topic, ["b"])
        publish(outboxes["t2"], topic, ["b"])
        wait_for(lambda: pending(outboxes["t2"]) == 0, 20, "t2 still served")
        assert pending(outboxes["t1"]) == 1
        assert [header(r, HEADER) for r in broker.records(topic)].count([b"t1"]) == 1
    finally:
        release.set()
        running.stop()


def test_a_quiet_tenant_is_served_while_another_drains_a_backlog(pg: sa.Engine, topic: str) -> None:
    outboxes = make_tenants(pg, ["busy", "quiet"])
    publish(outboxes["busy"], topic, [f"k{i % 500}" for i in range(4_000)])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet(["busy", "quiet"], broker, database=pg, batch_size=40, workers=1))
    try:
        wait_for(lambda: len(broker.records(topic)) > 200, 20, "the backlog started draining")
        publish(outboxes["quiet"], topic, ["q"])
        wait_for(lambda: pending(outboxes["quiet"]) == 0, 20, "the quiet tenant's message")
        # Sent while the backlog was still there: it did not wait for the backlog.
        assert pending(outboxes["busy"]) > 1_500, "the quiet tenant waited for the backlog"
    finally:
        running.stop()


def test_a_worker_sends_the_next_tenants_batch_while_the_last_ones_outcomes_are_written(
        pg: sa.Engine, topic: str) -> None:
    """Pipelined as a single relay is. One worker, two tenants: the first tenant's rows are locked by
    another transaction, so marking them published waits; the worker sends the second tenant's batch
    meanwhile, instead of waiting for that write."""
    outboxes = make_tenants(pg, ["first", "second"])
    publish(outboxes["first"], topic, ["a"])
    publish(outboxes["second"], topic, ["b"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    locker = pg.connect()
    locker.begin()
    locker.exec_driver_sql('SELECT id FROM "first".outbox_messages FOR UPDATE').all()
    running = Running(fleet(["first", "second"], broker, database=pg, workers=1, refresh_every=60))
    try:
        wait_for(lambda: len(broker.records(topic)) == 2, 10,
                 "the second tenant sent while the first tenant's write waits for its rows' lock")
        assert pending(outboxes["first"]) == 1  # its write waits still
    finally:
        locker.rollback()
        locker.close()
    try:
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 20, "both written")
    finally:
        running.stop()
    assert [header(r, HEADER) for r in broker.records(topic)] == [[b"first"], [b"second"]]


def live_leases(outbox: Outbox) -> int:
    """Shard leases held now and not expired (the database's clock)."""
    t = outbox.tables.leases
    with pg_engine(outbox).connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).where(
            t.c.owner.is_not(None), t.c.expires_at > sa.func.now())) or 0


def pg_engine(outbox: Outbox) -> sa.Engine:
    assert isinstance(outbox.engine, sa.Engine)
    return outbox.engine


def test_a_worker_held_by_the_broker_lets_no_tenants_leases_lapse(pg: sa.Engine, topic: str) -> None:
    """The leases are renewed per database, not by the tenants' batches: the one worker hangs in a
    send for twice the lease TTL, and every tenant keeps every lease meanwhile."""
    outboxes = make_tenants(pg, ["hung", "idle"], shards={"hung": 2, "idle": 2})
    held, release = threading.Event(), threading.Event()

    class Hanging(InMemoryTransport):
        def publish(self, records: Sequence[Record]) -> list[SendResult]:
            held.set()
            release.wait(20)
            return super().publish(records)

    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(TenantRelay(["hung", "idle"], lambda: Hanging(broker), database=pg, workers=1,
                                  tenant_header=HEADER, poll_interval=0.1, lease_ttl=1.5,
                                  refresh_every=60))
    try:
        wait_for(lambda: all(live_leases(o) == 2 for o in outboxes.values()), 10, "the first leases")
        publish(outboxes["hung"], topic, ["a"])
        wait_for(held.is_set, 10, "the worker in a send that hangs")
        deadline = time.monotonic() + 3.0  # twice the TTL
        while time.monotonic() < deadline:
            assert {name: live_leases(o) for name, o in outboxes.items()} == {"hung": 2, "idle": 2}
            time.sleep(0.1)
    finally:
        release.set()
        running.stop()


def test_the_leases_of_a_databases_tenants_are_renewed_in_a_few_transactions(pg: sa.Engine) -> None:
    """40 idle tenants of one database, renewed every 0.5 s: two commits a round (32 tenants a
    transaction), not one per tenant. Polls are rare here, and a poll's fetch commits nothing."""
    names = [f"r{i:02d}" for i in range(40)]
    make_tenants(pg, names, shards={name: 1 for name in names})
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    committed: list[float] = []

    def count(_conn: sa.Connection) -> None:
        committed.append(time.monotonic())
    sa.event.listen(pg, "commit", count)
    running = Running(fleet(names, broker, database=pg, poll_interval=60, lease_ttl=1.5, refresh_every=60))
    try:
        wait_for(lambda: running.relay.tenants == names, 20, "every tenant served")
        time.sleep(2.0)  # their first leases taken, their first batches over
        started = time.monotonic()
        time.sleep(5.0)
        ended = time.monotonic()
    finally:
        running.stop()
        sa.event.remove(pg, "commit", count)
    per_round = len([t for t in committed if started <= t < ended]) / ((ended - started) / 0.5)
    assert per_round <= 4, per_round  # 2 a round; one per tenant would be 40


def test_database_per_tenant_and_one_database_down(
        pg: sa.Engine, own_postgres: Any, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    shared = make_tenants(pg, ["a1", "a2"])
    own_url = own_postgres.url
    own = create_engine(own_url)
    alone = Outbox(own, shards=4)
    alone.create_tables()
    tenants = [Tenant("a1", "a1"), Tenant("a2", "a2"), Tenant("solo", database=own_url)]
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    running = Running(fleet(tenants, broker, database=pg))
    try:
        publish(alone, topic, ["s"])
        wait_for(lambda: pending(alone) == 0, 20, "the tenant with its own database served")
        own.dispose()
        own_postgres.stop()
        for round_ in range(5):  # the others keep flowing while it is down
            publish(shared["a1"], topic, [f"r{round_}"])
            publish(shared["a2"], topic, [f"r{round_}"])
            wait_for(lambda: pending(shared["a1"]) == pending(shared["a2"]) == 0, 10, "the others")
        wait_for(lambda: any(db.down for db in running.relay._databases.values()), 10, "solo's database down")
        assert running.relay.problem() is None  # ready: the other database serves its tenants
        own_postgres.start()
        publish(alone, topic, ["s2"])
        wait_for(lambda: pending(alone) == 0, 30, "served again once its database is back")
    finally:
        running.stop()
        own.dispose()
    down = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 1, down
    assert "***" not in down[0] or own_postgres.url not in down[0]


def test_bad_settings_are_refused_by_name(pg: sa.Engine) -> None:
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    with pytest.raises(ConfigurationError, match="callable that makes a transport"):
        TenantRelay(["a"], InMemoryTransport(broker), database=pg)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="tenant header"):
        fleet(["a"], broker, database=pg, tenant_header="outbox-seq")
    with pytest.raises(ConfigurationError, match="workers"):
        fleet(["a"], broker, database=pg, workers=0)
    for producers in (0, 65, True, 2.0):
        with pytest.raises(ConfigurationError, match="producers must be an int"):
            fleet(["a"], broker, database=pg, producers=producers)
    with pytest.raises(ConfigurationError, match="listed twice"):
        fleet(["a", "a"], broker, database=pg)


def test_alerts_and_metrics_say_which_tenant(pg: sa.Engine, topic: str) -> None:
    from prometheus_client import CollectorRegistry

    from outbox import Alert
    from outbox.relay import tenant_relay_metrics
    from outbox.tenants import TenantLabels
    from transports import Outcome

    outboxes = make_tenants(pg, ["acme", "globex", "initech"])
    for outbox in outboxes.values():
        publish(outbox, topic, ["k"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    alerts: list[Alert] = []
    registry = CollectorRegistry()
    relay = TenantRelay(list(outboxes), lambda: InMemoryTransport(broker), database=pg, alert=alerts.append,
                        tenant_header=HEADER, metrics=tenant_relay_metrics(TenantLabels(2), registry))
    try:
        relay.refresh()
        first = relay._workers.transports[0]
        first.fail(topic=topic, outcome=Outcome.FAILED, error="refused")  # the first sent
        relay.run_once()
        relay.run_once()
    finally:
        relay.close()
    assert [(a.kind, a.tenant) for a in alerts] == [("message_failed", "acme")]
    published = {(s.labels["tenant"]): s.value for metric in registry.collect() for s in metric.samples
                 if s.name == "outbox_tenant_relay_published_total"}
    # Two tenants by name (the bound), the third under the shared label.
    assert published == {"globex": 1.0, "_other": 1.0}


def test_a_notification_wakes_its_tenant_alone(pg: sa.Engine, topic: str) -> None:
    """Only NOTIFY can serve a row within seconds here: polls come every 3600 s and lease renewals
    every 200 s (``lease_ttl`` / 3), so each wait below is for a notification, and for its schema's
    tenant alone. A row written without one waits; a notification from elsewhere on the channel, or
    naming no tenant's schema, wakes nobody; one naming its schema wakes it.
    """
    outboxes = make_tenants(pg, ["n1", "n2"])
    quiet_n1 = Outbox(pg, schema="n1", notify_channel=None)  # writes without a notification
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet(["n1", "n2"], broker, database=pg, poll_interval=3600.0, lease_ttl=600.0))

    def notified_n2(round_: str) -> None:
        publish(outboxes["n2"], topic, [round_])
        wait_for(lambda: pending(outboxes["n2"]) == 0, 10, f"n2 woken by its notification ({round_})")

    def listening() -> bool:  # the fleet's LISTEN connection, as the server shows it
        with pg.connect() as conn:
            return bool(conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND starts_with(query, 'LISTEN ')").scalar())

    try:
        wait_for(lambda: running.relay.tenants == ["n1", "n2"], 20, "both served")
        wait_for(listening, 20, "the fleet listening")
        notified_n2("listening")  # after the wake-up of every tenant that follows a LISTEN
        publish(quiet_n1, topic, ["unannounced"])
        for round_ in ("r1", "r2"):  # the second round: n1, had it been woken, would be served by then
            notified_n2(round_)
        assert pending(outboxes["n1"]) == 1, "n2's notification woke n1 too"
        with pg.begin() as conn:  # another process's, and one naming no tenant's schema
            conn.exec_driver_sql("SELECT pg_notify('outbox', 'not ours'), pg_notify('outbox', '3:nobody'), "
                                 "pg_notify('outbox', '3'), pg_notify('outbox', '3:')")
        for round_ in ("r3", "r4"):
            notified_n2(round_)
        assert pending(outboxes["n1"]) == 1, "a notification naming no tenant of n1 woke it"
        with pg.begin() as conn:
            conn.exec_driver_sql("SELECT pg_notify('outbox', '0:n1')")
        wait_for(lambda: pending(outboxes["n1"]) == 0, 10, "n1 woken by a notification naming its schema")
    finally:
        running.stop()
    assert sorted(header(r, HEADER)[0] for r in broker.records(topic)).count(b"n1") == 1


def test_a_frozen_heap_is_frozen_again_once_the_new_tenants_have_run(pg: sa.Engine) -> None:
    """``outbox relay`` freezes its heap before ``run``; the tenants ``run`` builds are frozen too.

    Left in the collector's sight, 500 tenants' relays and statements made every
    full collection a 1.5 s pause of all the workers (docs/benchmarks.md).
    """
    outboxes = make_tenants(pg, ["acme", "globex"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        running = Running(fleet(list(outboxes), broker, database=pg))
        try:
            # Tenants first: the freeze count is the process's, and rises only after they ran.
            wait_for(lambda: running.relay.tenants == ["acme", "globex"], 10, "the tenants served")
            wait_for(lambda: gc.get_freeze_count() > before, 10, "the new tenants' objects frozen")
        finally:
            running.stop()
    finally:
        gc.unfreeze()


def test_the_first_run_once_steps_a_tenant_whose_server_is_slow_to_answer(pg: sa.Engine, topic: str) -> None:
    """``run_once`` waits for every tenant's step, not only ``run``'s few seconds (BUILD_STALLED, 3 s).

    The clean-clone CI of 5bfaad9, on a loaded host: the first ``run_once`` of a
    fleet returned no tenant at all, its steps still being built, and nothing in
    ``run_once`` built them later.
    """
    outboxes = make_tenants(pg, ["acme"])
    publish(outboxes["acme"], topic, ["k1"])
    slowed: list[str] = []

    def slow_builder(conn: sa.Connection) -> None:
        if threading.current_thread().name == "outbox-relay-build" and not slowed:
            slowed.append("acme")
            time.sleep(4.0)  # longer than the refresh of ``run`` waits for a build that gets nowhere

    sa.event.listen(pg, "engine_connect", slow_builder)
    relay = fleet(list(outboxes), InMemoryBroker(max_record_bytes=ROOMY), database=pg)
    try:
        results = relay.run_once()
    finally:
        relay.close()
        sa.event.remove(pg, "engine_connect", slow_builder)
    assert slowed == ["acme"]
    assert list(results) == ["acme"]
    assert results["acme"].published == 1


def test_run_once_leaves_the_callers_thread_no_worker(pg: sa.Engine, topic: str) -> None:
    """The caller's thread is worker 0 during ``run_once`` only: after it, a publish from that thread
    (a tenant's step called by hand) is refused as any thread's outside the workers is."""
    outboxes = make_tenants(pg, ["acme"])
    publish(outboxes["acme"], topic, ["k1"])
    relay = fleet(list(outboxes), InMemoryBroker(max_record_bytes=ROOMY), database=pg)
    try:
        assert relay.run_once()["acme"].published == 1
        with pytest.raises(ConfigurationError, match="worker threads"), relay._workers.producer():
            pass
    finally:
        relay.close()


def refuse_release(pg: sa.Engine, schema: str) -> None:
    """``schema``'s lease table refuses to let a lease go (an UPDATE that clears its owner)."""
    with pg.begin() as conn:
        conn.execute(sa.text(
            f"CREATE FUNCTION {schema}.refuse_release() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.owner IS NULL THEN RAISE EXCEPTION 'release refused'; END IF; RETURN NEW; END $$"))
        conn.execute(sa.text(f"CREATE TRIGGER refuse_release BEFORE UPDATE ON {schema}.outbox_leases "
                             f"FOR EACH ROW EXECUTE FUNCTION {schema}.refuse_release()"))


def test_a_stop_whose_release_failed_does_not_say_the_leases_were_released(
        pg: sa.Engine, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """The stop's last line names the tenants whose leases were left to their TTL: it said
    "leases released" whatever happened, right under the line logging a tenant's failed release."""
    outboxes = make_tenants(pg, ["kept", "given"])
    for outbox in outboxes.values():
        publish(outbox, topic, ["k"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet(["kept", "given"], broker, database=pg))
    wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 20, "both tenants sent")
    refuse_release(pg, "kept")
    caplog.set_level(logging.INFO, logger="outbox.relay")
    running.stop()
    said = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert len(said) == 1 and "leases released" not in said[0], said
    assert "1 tenants did not give their leases back (kept)" in said[0], said
    assert owned_leases(outboxes["kept"]) > 0 and owned_leases(outboxes["given"]) == 0


def held_in_step_until_the_stop(relay: TenantRelay, outbox: Outbox, name: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet's (one) worker taken into tenant ``name``'s step, where it stays until the stop is
    asked for; returns once it is there."""
    step = relay.relay_of(name)
    assert step is not None
    real, inside = step.run, threading.Event()

    def until_the_stop(**kwargs: Any) -> Any:
        inside.set()
        relay._stopping.wait(30)
        return real(**kwargs)

    monkeypatch.setattr(step, "run", until_the_stop)
    publish(outbox, "orders", ["k"])  # its notification gives the tenant a turn
    assert inside.wait(20), f"{name}'s step"


def lease_tables_locked(holder: sa.Connection, names: list[str]) -> None:
    """``names``' lease tables locked ``IN SHARE MODE`` in ``holder``'s transaction: the fleet reads
    them still, but no release (an UPDATE) gets through until it ends."""
    holder.exec_driver_sql("LOCK TABLE " + ", ".join(f'"{n}".outbox_leases' for n in names)
                           + " IN SHARE MODE")


def test_a_stop_whose_database_holds_the_release_names_ten_tenants_not_all(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve tenants whose lease tables another transaction holds locked when the fleet stops, its
    worker inside a step of one of them: every line of the stop counts them and names ten; a fleet
    of 500 named all 500 in one line. The worker gives that tenant's leases back itself once its
    step is done, and its release waited on the lock for as long as it was held: the stop's bound
    ran out and its last line never came (clean CI, a loaded host whose worker was in a step when
    the stop came). Now the worker's release at the stop is bounded as the others' are
    (``RELEASE_WITHIN``): it goes on on a closer of its own, the leases left to their TTL."""
    names = [f"t{i:02d}" for i in range(12)]
    outboxes = make_tenants(pg, names, shards={name: 1 for name in names})
    relay = fleet(names, InMemoryBroker(max_record_bytes=ROOMY), database=pg, workers=1)
    running = Running(relay, stop_timeout=30)
    wait_for(lambda: all(owned_leases(o) == 1 for o in outboxes.values()), 20, "every tenant's lease")
    held_in_step_until_the_stop(relay, outboxes["t02"], "t02", monkeypatch)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    with pg.connect() as holder:
        lease_tables_locked(holder, names)
        running.stop()
        # Read while the lock is held: a closer that gives leases back once it is gone says so.
        said = [r.getMessage() for r in caplog.records if "their leases back" in r.getMessage()]
        holder.rollback()
    # The release's line (once for the 11 tenants no worker held; once after the worker, for those
    # the closer of the 11 still releases), then the stop's.
    assert said and "11 tenants had not given their leases back after 3s (t00, t01, t03" in said[0], said
    assert "their release goes on" in said[0], said
    ten = ", ".join([name for name in names if name != "t02"][:10])  # the worker's tenant last
    assert f"stopped; 12 tenants did not give their leases back ({ten}, …)" in said[-1], said
    for line in said:
        # Ten names, then an ellipsis; all of them when ten or fewer (the worker's own release
        # waited for names one).
        counted = int(line.split(" tenants ", 1)[0].rsplit(" ", 1)[1])
        listed = line.split("(", 1)[1].split(")", 1)[0].split(";")[0].split(", ")
        assert len(listed) == min(counted, 11) and (listed[-1] == "…") == (counted > 10), line


def test_a_stop_of_a_fleet_of_the_default_lease_ttl_whose_lease_tables_are_locked_keeps_its_bound(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, with the fleet's default lease TTL (30 s) and the default stop bound (10 s): the
    worker inside a tenant's step gives that tenant's leases back once the step is done. A bound on
    the lease statements' lock waits of a TTL (tried, and reverted) left it 30 s on the lock,
    three times the stop's bound: the stop said "did not finish within 10s" and never which
    tenants' leases were left to their TTL. A release at the stop gets nothing by waiting longer
    than the stop allows: the leases expire within the TTL either way."""
    names = ["a", "b", "c"]
    outboxes = make_tenants(pg, names, shards={name: 1 for name in names})
    relay = fleet(names, InMemoryBroker(max_record_bytes=ROOMY), database=pg, workers=1, lease_ttl=30.0)
    running = Running(relay, stop_timeout=10.0)  # ``run``'s default
    wait_for(lambda: all(owned_leases(o) == 1 for o in outboxes.values()), 20, "every tenant's lease")
    held_in_step_until_the_stop(relay, outboxes["b"], "b", monkeypatch)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    with pg.connect() as holder:
        lease_tables_locked(holder, names)
        took = running.stop()
        said = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()
                or "did not finish" in r.getMessage()]
        holder.rollback()
    assert took < 10.0, (took, said)
    assert said and "stopped; 3 tenants did not give their leases back (a, c, b)" in said[-1], said


def slow_release(pg: sa.Engine, schema: str, seconds: float) -> None:
    """``schema``'s lease table takes ``seconds`` to let a lease go (an UPDATE that clears its owner)."""
    with pg.begin() as conn:
        conn.execute(sa.text(
            f"CREATE FUNCTION {schema}.slow_release() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.owner IS NULL AND OLD.owner IS NOT NULL THEN PERFORM pg_sleep({seconds}); END IF; "
            "RETURN NEW; END $$"))
        conn.execute(sa.text(f"CREATE TRIGGER slow_release BEFORE UPDATE ON {schema}.outbox_leases "
                             f"FOR EACH ROW EXECUTE FUNCTION {schema}.slow_release()"))


def test_a_stop_whose_release_outlasts_its_bound_says_what_was_given_back_in_the_end(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve tenants of one database whose release takes 0.3 s each (3.6 s, past the 3-s bound):
    the stop's first wait ends with some not given back yet; its second waits for the first's
    closer, and its last line says what is true at its end. It named all twelve as left to their
    TTL while the closer gave every lease back, and its second wait started a second closer beside
    the first, on the same tenants."""
    # The closer threads each tenant was closed on. Counting the closers alive at once counted a
    # worker's own closer for the tenant it was stepping when the stop came (docs/tenants.md), on
    # the same database but not on the same tenants (CI: "2 closers at once for one database").
    closes: list[tuple[str, threading.Thread]] = []
    names = [f"s{i:02d}" for i in range(12)]
    outboxes = make_tenants(pg, names, shards={name: 1 for name in names})
    relay = fleet(names, InMemoryBroker(max_record_bytes=ROOMY), database=pg)
    closers = relay._tenants._closers  # the closers' own close, called only on a closer thread
    real = closers._close

    def recorded(unit: Any) -> bool:
        closes.append((unit.tenant.name, threading.current_thread()))
        return real(unit)

    monkeypatch.setattr(closers, "_close", recorded)
    running = Running(relay)
    wait_for(lambda: all(owned_leases(o) == 1 for o in outboxes.values()), 20, "every tenant's lease")
    for name in names:
        slow_release(pg, name, 0.3)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    took = running.stop()
    closed_on: dict[str, set[threading.Thread]] = {}
    for name, thread in closes:
        closed_on.setdefault(name, set()).add(thread)
    assert sorted(closed_on) == names  # every tenant held a lease: each was closed on a closer
    assert {name: len(on) for name, on in closed_on.items() if len(on) > 1} == {}, "closed on two closers"
    said = [r.getMessage() for r in caplog.records if "their leases back" in r.getMessage()]
    assert [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()][-1].endswith(
        "stopped; leases released"), said
    assert all(owned_leases(o) == 0 for o in outboxes.values())
    assert "had not given their leases back after 3s" in said[0] and "their release goes on" in said[0], said
    assert any("gave their leases back" in line for line in said), said
    assert took < 8, took  # 3.6 s of releases; the second wait ends with the closer
    assert not any("did not give their leases back" in line for line in said), said


def test_a_tenant_mid_step_at_the_stop_whose_release_failed_is_named_too(
        pg: sa.Engine, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant in a step when the stop comes is closed by its worker once the step ends, not by
    ``run``: its failed release was dropped, and the stop said "leases released" (CI of b1a6040)."""
    outboxes = make_tenants(pg, ["kept", "given"])
    hang, held, release = threading.Event(), threading.Event(), threading.Event()

    class Hanging(InMemoryTransport):
        def publish(self, records: Sequence[Record]) -> list[SendResult]:
            if hang.is_set():
                held.set()
                release.wait(20)
            return super().publish(records)

    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = TenantRelay(["kept", "given"], lambda: Hanging(broker), database=pg, workers=2,
                        tenant_header=HEADER, poll_interval=0.1, lease_ttl=5.0, refresh_every=60)
    running = Running(relay)
    wait_for(lambda: all(owned_leases(o) == 4 for o in outboxes.values()), 20, "both tenants' leases")
    refuse_release(pg, "kept")
    hang.set()
    publish(outboxes["kept"], topic, ["k"])
    wait_for(held.is_set, 10, "the kept tenant's step in a send")
    caplog.set_level(logging.INFO, logger="outbox.relay")
    stopping = threading.Thread(target=running.stop)
    stopping.start()
    try:
        wait_for(relay._stopping.is_set, 10, "the stop begun while the step still sends")
    finally:
        release.set()
    stopping.join(60)
    assert not stopping.is_alive()
    said = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert len(said) == 1 and "1 tenants did not give their leases back (kept)" in said[0], said
    assert pending(outboxes["kept"]) == 0  # the step in hand was finished
    assert owned_leases(outboxes["kept"]) > 0 and owned_leases(outboxes["given"]) == 0


def test_tenants_removed_just_before_the_stop_whose_release_goes_on_are_named_at_its_end(
        pg: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Twelve tenants removed from the source (each release takes 0.4 s, 4.8 s in all) and the fleet
    stopped right after: the refresh's closer still gives them back, and the stop's last line named
    none of them ("leases released") while some were still held."""
    names = [f"r{i:02d}" for i in range(12)]
    outboxes = make_tenants(pg, [*names, "stay"], shards={n: 1 for n in [*names, "stay"]})
    current = [[*names, "stay"]]
    running = Running(fleet(lambda: current[0], InMemoryBroker(max_record_bytes=ROOMY), database=pg))
    wait_for(lambda: all(owned_leases(o) == 1 for o in outboxes.values()), 20, "every tenant's lease")
    for name in names:
        slow_release(pg, name, 0.4)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    current[0] = ["stay"]
    wait_for(lambda: any(t.name == "outbox-relay-release" for t in threading.enumerate()), 10, "a closer")
    running.stop()
    still = [name for name in names if owned_leases(outboxes[name]) > 0]
    last = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()][-1]
    if still:
        assert "did not give their leases back" in last and all(name in last for name in still), (still, last)
    else:
        assert last.endswith("stopped; leases released"), last


def test_a_close_all_beside_another_joins_only_closers_that_started() -> None:
    """A refresh removing tenants while the stop closes them: the second call waits for the first
    call's closer. The first started its closers only after closing its units that had nothing to
    release, so the second joined a thread not started yet (RuntimeError) and the stop ended there.
    (``relay._closers``, which a fleet's ``close_all`` and a single relay's stop share.)"""
    released, second_returned = threading.Event(), threading.Event()

    def give_back(_item: str) -> bool:  # "held", on its closer
        return released.wait(5)

    def close_here(_item: str) -> None:  # "idle", nothing to release: the first call closes it itself
        second_returned.wait(5)

    closers: Closers[str] = Closers(give_back)
    first = threading.Thread(target=lambda: closers.close_within(
        ["held", "idle"], group=lambda item: "db" if item == "held" else None, at_once=close_here),
        daemon=True)
    first.start()
    # The first call has handed "held" to a closer and closes "idle" itself meanwhile.
    wait_for(lambda: "held" in closers.going(), 5, "held handed to a closer")
    second: list[set[str]] = []

    def beside_it() -> None:
        try:
            second.append(closers.close_within(["held"], group=lambda _: "db", at_once=close_here))
        finally:
            second_returned.set()

    beside = threading.Thread(target=beside_it, daemon=True)
    beside.start()
    released.set()
    beside.join(5)
    first.join(5)
    assert second == [set()]
