"""``Relay.run``: LISTEN wake-up, polling, stop, lease sharing, metrics."""

from __future__ import annotations

import threading
import time
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, publish, rows, wait_for
from prometheus_client import CollectorRegistry

from outbox import Outbox, Relay, create_engine, relay_metrics
from outbox.relay._leases import fair_share
from outbox.relay._sql import statements_for
from outbox.testing import free_port


def running(relay: Relay) -> threading.Thread:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    return thread


def wait_published(outbox: Outbox, count: int, timeout: float) -> float:
    started = time.monotonic()
    while len(rows(outbox, status="published")) < count:
        assert time.monotonic() - started < timeout, "not published in time"
        time.sleep(0.005)
    return time.monotonic() - started


def listening(engine: sa.Engine) -> bool:
    """A LISTEN connection of this database, as the server shows it."""
    with engine.connect() as conn:
        return bool(conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND starts_with(query, 'LISTEN ')").scalar())


@pytest.mark.postgres
def test_run_wakes_on_notify_not_on_the_poll_interval(postgres_db: str) -> None:
    """The first message goes once the relay listens, not 0.5 s after it started: a loaded host
    still connecting the listener then made the first latency its start-up. The bound is a sixth
    of the poll interval, which no message can meet but by its notification (each waited at most
    1.0 s before: far below the interval, and within a stall of a loaded host)."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    poll_interval = 60.0
    relay = Relay(outbox, ScriptedTransport(), poll_interval=poll_interval)
    thread = running(relay)
    wait_for(lambda: listening(engine) or not thread.is_alive(), 30, "the relay listening")
    assert thread.is_alive(), "the relay stopped before it listened"
    latencies = []
    for n in range(1, 6):
        publish(outbox, "orders", [f"k{n}"])
        latencies.append(wait_published(outbox, n, timeout=poll_interval / 6))
    relay.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert max(latencies) < poll_interval / 6, latencies  # each woken, none polled
    engine.dispose()


def test_a_full_batch_is_followed_by_a_fetch_at_once_not_a_poll_wait(proof_db_url: str) -> None:
    # Where nothing wakes the relay (MySQL, SQLite) a backlog must still drain at batch
    # speed: after a full batch the next fetch starts at once, whatever poll_interval says.
    outbox = Outbox(create_engine(proof_db_url))
    outbox.create_tables()
    publish(outbox, "orders", [f"k{i % 7}" for i in range(40)])
    relay = Relay(outbox, ScriptedTransport(), poll_interval=30, batch_size=10)
    thread = running(relay)
    try:
        took = wait_published(outbox, 40, timeout=10)  # four full batches; one poll wait is 30 s
    finally:
        relay.stop()
        thread.join(10)
        outbox.engine.dispose()  # type: ignore[union-attr]
    assert not thread.is_alive()
    assert took < 10


def test_run_polls_and_stop_releases_leases(outbox: Outbox) -> None:
    relay = Relay(outbox, ScriptedTransport(), poll_interval=0.05, batch_size=10)
    thread = running(relay)
    publish(outbox, "orders", [f"k{i % 3}" for i in range(55)])
    wait_published(outbox, 55, timeout=10)
    relay.stop()
    thread.join(10)
    assert not thread.is_alive()
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        owners = conn.execute(outbox.tables.leases.select()).all()
        relays = conn.execute(outbox.tables.relays.select()).all()
    assert owners and all(lease.owner is None for lease in owners) and relays == []


def test_fair_share_splits_every_shard_once() -> None:
    for live in (["a"], ["a", "b"], ["a", "b", "c"], [f"r{i}" for i in range(20)]):
        shares = [fair_share(16, live, me) for me in live]
        assert sum(shares) == 16 and max(shares) - min(shares) <= 1


def test_relays_rebalance_and_take_over_expired_leases(outbox: Outbox) -> None:
    # A TTL no step reaches, and a's leases made to lapse by hand: a TTL of 3 s and a sleep past it
    # failed at a load of 11, when the steps before the sleep took longer than the TTL.
    a = Relay(outbox, ScriptedTransport(), worker_id="a", lease_ttl=600.0)
    b = Relay(outbox, ScriptedTransport(), worker_id="b", lease_ttl=600.0)
    assert len(a.leases.maintain()) == 16
    assert b.leases.maintain() == {}  # nothing free yet
    a.leases.maintain()
    assert a.leases.surplus == 8
    a.leases.release_surplus()
    assert len(b.leases.maintain()) == 8 and len(a.leases.owned()) == 8
    epochs = b.leases.owned()
    leases, relays = outbox.tables.leases, outbox.tables.relays
    lapsed = datetime.now(UTC) - timedelta(seconds=1)
    with outbox.engine.begin() as conn:  # a's last renewal and heartbeat a TTL ago: as if killed
        conn.execute(leases.update().where(leases.c.owner == "a").values(expires_at=lapsed))
        conn.execute(relays.update().where(relays.c.worker_id == "a")
                     .values(heartbeat_at=lapsed - timedelta(seconds=600)))
    taken = b.leases.maintain()
    assert len(taken) == 16
    assert all(taken[s] == e for s, e in epochs.items())  # b's own leases keep their epoch
    assert a.leases.maintain() == {}  # a came back: all its shards are gone
    b.close()


def test_metrics_count_and_serve(outbox: Outbox) -> None:
    registry = CollectorRegistry()
    metrics = relay_metrics(registry)
    assert relay_metrics(registry) is metrics  # defined once per process and registry
    publish(outbox, "metered", ["a", "b", None])
    relay = Relay(outbox, ScriptedTransport(), metrics=metrics, worker_id="m")
    relay.run_once()
    assert registry.get_sample_value("outbox_relay_published_total", {"topic": "metered"}) == 3
    assert registry.get_sample_value("outbox_relay_shards_owned", {"worker": "m"}) == 16
    assert registry.get_sample_value("outbox_relay_batch_seconds_count") == 1
    publish(outbox, "metered", ["c"])
    relay.refresh_backlog_metrics()
    assert registry.get_sample_value("outbox_relay_pending", {"topic": "metered"}) == 1
    assert registry.get_sample_value("outbox_relay_oldest_pending_age_seconds") >= 0
    relay.run_once()
    relay.refresh_backlog_metrics()
    assert registry.get_sample_value("outbox_relay_pending", {"topic": "metered"}) == 0
    relay.close()
    port = free_port()
    metrics.serve(port, registry)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'outbox_relay_published_total{topic="metered"} 4.0' in body


@pytest.mark.slow  # 5.5 s of sleeps by design
@pytest.mark.xdist_group("timing")  # a 1 s lease TTL: one timing test at a time (docs/testing.md)
def test_a_slow_backlog_query_never_delays_lease_renewal(outbox: Outbox, monkeypatch) -> None:
    """The backlog gauges' GROUP BY runs on its own thread, not on the lease thread."""
    import outbox.relay._relay as relay_module

    real_backlog = relay_module.backlog
    calls = []

    def slow_backlog(ob: Outbox):
        calls.append(time.monotonic())
        time.sleep(5.0)  # a GROUP BY over a huge backlog, longer than the TTL
        return real_backlog(ob)

    monkeypatch.setattr(relay_module, "backlog", slow_backlog)
    # A TTL of 2 s: renewals a third of it apart. With 1 s, a lease thread starved ~0.7 s by the
    # whole suite's load let a lease lapse (seen once), though no query stood in its way.
    relay = Relay(outbox, ScriptedTransport(), lease_ttl=2.0, backlog_metrics=True, worker_id="w")
    thread = running(relay)
    leases = outbox.tables.leases
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 5.5
        while time.monotonic() < deadline:
            with outbox.engine.connect() as conn:
                held = list(conn.execute(sa.select(leases.c.owner, leases.c.expires_at)))
            now = datetime.now(UTC)
            assert all(owner == "w" and expires > now for owner, expires in held), held
            time.sleep(0.1)
    finally:
        relay.stop()
        thread.join(15)
    assert calls, "the backlog gauges were never refreshed"


@pytest.mark.mysql
def test_the_mysql_probe_reads_only_the_rows_that_may_block_a_key(mysql_db: str) -> None:
    """Without partial indexes, MySQL's ix_outbox_key_waits leads with the key and the
    generated ``may_block``: the fetch's probe uses it, and ``SELECT *`` never shows it."""
    outbox = Outbox(create_engine(mysql_db))
    outbox.create_tables()
    publish(outbox, "orders", ["a", "a"])
    publish(outbox, "orders", ["a"], delay=timedelta(hours=1))
    m = outbox.tables.messages
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        conn.execute(sa.update(m).where(m.c.seq == 1).values(status="published"))
        flags = conn.execute(sa.text(f"SELECT seq, may_block FROM {m.name} ORDER BY seq")).all()
        assert [tuple(r) for r in flags] == [(1, 0), (2, 0), (3, 1)]
        assert "may_block" not in list(conn.execute(sa.text(f"SELECT * FROM {m.name}")).keys())
        fetch = statements_for(outbox.tables, conn.dialect.name).fetch(range(16))
        sent: list[tuple[str, object]] = []
        sa.event.listen(conn, "before_cursor_execute", lambda *a: sent.append((a[2], a[3])))
        params = {"now": datetime.now(UTC), "limit": 100, "max_bytes": 2**20}
        assert len(conn.execute(fetch, params).all()) == 1  # seq 2
        statement, parameters = sent[-1]
        plan = conn.exec_driver_sql("EXPLAIN " + statement, parameters).mappings().all()
    probes = [row for row in plan if row["select_type"] == "DEPENDENT SUBQUERY"]
    assert [row["key"] for row in probes] == ["ix_outbox_key_waits"], plan
