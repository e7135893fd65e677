"""Attacks on "a stop ends the exactly-once progress-topic wait" (9d51fb8).

A relay (one, or a tenant fleet) stopped while the broker is frozen returns
at once with its loop ended, and a later ``run`` sends every row once; and the stoppable waits must
not turn a broker that answers, slowly, into an outage.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, owned_leases, publish, rows, wait_for

from outbox import ConfigurationError, Outbox, Relay, create_engine
from outbox.tenants import Tenant, TenantRelay
from outbox.testing import LocalKafka
from transports.kafka import KafkaTransport, embedded_kafka
from transports.testing import BrokerProcess, read_topic

pytestmark = pytest.mark.xdist_group("timing")  # wall-clock bounds: one at a time (docs/testing.md)

MARGIN = 1.5
"""Seconds on top of a bound for the thread switch and a slow, shared machine."""


def test_a_stop_event_not_set_leaves_the_progress_topic_check_as_it_was_on_a_slow_broker() -> None:
    """The stoppable lookup of the progress topic (``listed``) asked in requests of at most 0.5 s each,
    given up and sent again (9d51fb8): a broker that answers every request, in 1 s, was never heard,
    where the plain lookup (``list_topics`` with the whole timeout) hears it. An exactly-once relay
    there never got its progress topic: every batch an outage ("cannot look up topic"). The lookup
    heard, the mock is refused by its cluster id: both ways must get that far."""
    with BrokerProcess(brokers=1, rtt_ms=1000) as broker:
        transport = KafkaTransport(bootstrap_servers=broker.bootstrap)
        with pytest.raises(ConfigurationError, match="mock cluster"):
            transport.ensure_compacted_topic("slow-lookup", 1, 10)
        with pytest.raises(ConfigurationError, match="mock cluster"):
            transport.ensure_compacted_topic("slow-lookup", 1, 10, threading.Event())
        transport.close(0)


def test_a_fleet_stopped_while_its_tenants_progress_topics_wait_for_the_broker_returns_at_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tenant fleet's tenants each look their progress topic up on the fleet's worker threads: a stop
    there ends each wait, and ``run`` returns at once, nothing left behind."""
    engines = {name: create_engine(f"sqlite:///{tmp_path / name}.db") for name in ("a", "b", "c")}
    outboxes = [Outbox(engine, shards=2) for engine in engines.values()]
    for ob in outboxes:
        ob.create_tables()
        publish(ob, "fleet-stopped", ["k1", "k2"])
    checking = threading.Event()

    class Checking(KafkaTransport):
        def ensure_compacted_topic(self, *args: Any, **kwargs: Any) -> None:
            checking.set()
            super().ensure_compacted_topic(*args, **kwargs)

    with BrokerProcess(brokers=1) as broker:
        broker.freeze()
        bootstrap = broker.bootstrap
        fleet = TenantRelay([Tenant(name, database=str(engine.url)) for name, engine in engines.items()],
                            lambda: Checking({"message.max.bytes": "1001000"}, bootstrap_servers=bootstrap),
                            tenant_header="tenant", lease_ttl=2.0, poll_interval=0.1, workers=2,
                            exactly_once=True, progress_topic="fleet-stopped-progress")
        runner = threading.Thread(target=lambda: fleet.run(stop_timeout=10))
        runner.start()
        wait_for(lambda: checking.is_set() and all(owned_leases(ob) > 0 for ob in outboxes), 30,
                 "the fleet's tenants to look their progress topics up")
        asked = time.monotonic()
        fleet.stop()
        runner.join(20)
        took = time.monotonic() - asked
        fleet.close()
    for engine in engines.values():
        engine.dispose()
    assert not runner.is_alive()
    assert took < 1 + MARGIN, f"run returned {took:.1f}s after the stop"
    assert "did not finish" not in caplog.text
    assert "broker unreachable" not in caplog.text, "the stop was told as a broker outage"
    assert "stopped before the broker answered" not in caplog.text


@pytest.mark.kafka
def test_a_relay_stopped_while_its_take_overs_wait_for_a_frozen_broker_runs_again_exactly_once(
        own_kafka: LocalKafka, sqlite_db: str, caplog: pytest.LogCaptureFixture) -> None:
    """Past the progress topic, the take-overs (each shard's producer fencing, its progress read) wait on
    the relay's pool threads: a stop returns at once though they still wait for the frozen broker, and
    the next ``run`` (the broker back) sends every row once. The stopped run's take-overs live on
    until the broker answers their ``init_transactions``, which then may fence the new run's producers
    of the same ids (a "was fenced" warning, librdkafka's fatal error): their batch is sent again on
    a new producer, nothing lost, nothing twice (as for any lease lost during a take-over's fence: the
    InitProducerId request was sent before the stop, and the broker answers it when it can)."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=2)
    outbox.create_tables()
    topic = "stopped-take-over"
    publish(outbox, topic, [f"k{i}" for i in range(20)])
    frozen = threading.Event()

    class FreezesAfterTheCheck(KafkaTransport):
        def ensure_compacted_topic(self, *args: Any, **kwargs: Any) -> None:
            super().ensure_compacted_topic(*args, **kwargs)
            if not frozen.is_set():
                own_kafka.freeze()
                frozen.set()

    transport = FreezesAfterTheCheck(bootstrap_servers=own_kafka.bootstrap, delivery_timeout=10)
    relay = Relay(outbox, transport, worker_id="stopped-take-over", exactly_once=True,
                  progress_topic="stopped-take-over-progress")
    runner = threading.Thread(target=lambda: relay.run(stop_timeout=5))
    runner.start()
    wait_for(lambda: frozen.is_set() and any(
        t.name.startswith("outbox-relay-txn") for t in threading.enumerate()), 60, "a take-over")
    asked = time.monotonic()
    relay.stop()
    runner.join(10)
    took = time.monotonic() - asked
    own_kafka.thaw()
    assert not runner.is_alive()
    assert took < 1 + MARGIN, f"run returned {took:.1f}s after the stop"
    runner = threading.Thread(target=lambda: relay.run(stop_timeout=5))
    runner.start()
    wait_for(lambda: len(rows(outbox, status="published")) == 20, 60, "the rows published")
    relay.stop()
    runner.join(10)
    on_wire = read_topic(own_kafka.bootstrap, topic, expected=20, settle=1.5, isolation="read_committed")
    transport.close(0)
    engine.dispose()
    assert sorted(r.key for r in on_wire) == sorted(f"k{i}".encode() for i in range(20))
    assert "did not finish" not in caplog.text


def test_a_relay_stopped_in_its_progress_topic_check_checks_it_again_in_its_next_run(
        sqlite_db: str, caplog: pytest.LogCaptureFixture) -> None:
    """The check a stop ended is not taken for done: the next ``run`` of the same relay looks the
    topic up again (the broker frozen: each check waits there). A run stopped in its check never
    started: it says so, not "started with shards"."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    checks: list[threading.Event] = []

    class Counting(KafkaTransport):
        def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float,
                                   stopping: threading.Event | None = None) -> None:
            checks.append(threading.Event())
            try:
                super().ensure_compacted_topic(topic, partitions, timeout, stopping)
            finally:
                checks[-1].set()

    with BrokerProcess(brokers=1) as broker:
        broker.freeze()
        # A check of up to 20 s and a stop bound of 5: a stop that did not end the check would
        # leave the run behind (a "did not finish" warning), not return before the check's own end.
        transport = Counting(bootstrap_servers=broker.bootstrap, delivery_timeout=20)
        relay = Relay(outbox, transport, worker_id="checked-again", exactly_once=True)
        for run in (1, 2):
            runner = threading.Thread(target=lambda: relay.run(stop_timeout=5))
            runner.start()
            wait_for(lambda run=run: len(checks) == run, 30, f"run {run}'s check")
            relay.stop()
            runner.join(5 + MARGIN)
            assert not runner.is_alive()
            assert checks[-1].wait(MARGIN), "the stop ended the check"
        transport.close(0)
    engine.dispose()
    assert len(checks) == 2
    assert "started with shards" not in caplog.text, "a run stopped before it began said it started"
    assert "did not finish" not in caplog.text



def test_a_relay_whose_progress_topic_check_waits_for_the_broker_renews_its_leases_meanwhile(
        sqlite_db: str) -> None:
    """The check waits up to the transaction timeout (30 s by default) for a broker that does not
    answer, three lease TTLs (10 s): it ran before the lease thread started, so the leases the relay
    had just taken lapsed under it, for another relay to take. Here a TTL of 2 s and a check of 8 s:
    the leases are renewed while it waits."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    leases = outbox.tables.leases

    def expiries() -> list[Any]:
        with engine.connect() as conn:
            return list(conn.scalars(sa.select(leases.c.expires_at).where(leases.c.owner.is_not(None))))

    with BrokerProcess(brokers=1) as broker:
        broker.freeze()
        transport = KafkaTransport(bootstrap_servers=broker.bootstrap, delivery_timeout=8)
        relay = Relay(outbox, transport, worker_id="renewing", exactly_once=True, lease_ttl=2.0)
        runner = threading.Thread(target=lambda: relay.run(stop_timeout=5))
        runner.start()
        try:
            # Its leases taken too: an "outbox-metadata" thread may be an earlier test's, still waiting
            # for its own frozen broker (a stop leaves it to its timeout), before this relay took any.
            wait_for(lambda: expiries() and any(t.name == "outbox-metadata" for t in threading.enumerate()),
                     30, "the relay to ask the frozen broker for its progress topic")
            taken = max(expiries())
            wait_for(lambda: (now := expiries()) and min(now) > taken, 6,
                     "the leases renewed while the check waits")
        finally:
            relay.stop()
            runner.join(5 + MARGIN)
            transport.close(0)
    engine.dispose()
    assert not runner.is_alive()


def test_a_relay_whose_lease_thread_fails_during_its_progress_topic_check_raises_that_failure(
        sqlite_db: str) -> None:
    """The lease thread runs during the check now (2f8f898): a renewal's fatal error there (the
    database resharded behind the relay's back, ``SchemaError``) stops the relay, which ends the
    check's wait, and the run returned as "stopped in that check", its fatal error dropped: ``run``
    returned normally, the CLI exited 0, and nothing said why the relay stopped."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=4)
    outbox.create_tables()
    with BrokerProcess(brokers=1) as broker:
        broker.freeze()
        transport = KafkaTransport(bootstrap_servers=broker.bootstrap, delivery_timeout=8)
        running = Running(Relay(outbox, transport, worker_id="resharded", exactly_once=True,
                                lease_ttl=1.0), stop_timeout=5)
        try:
            wait_for(lambda: owned_leases(outbox) > 0 and any(
                t.name == "outbox-metadata" for t in threading.enumerate()), 30,
                "the relay to ask the frozen broker for its progress topic")
            meta = outbox.tables.meta
            with engine.begin() as conn:  # behind the running relay's back (never do this)
                conn.execute(sa.update(meta).where(meta.c.name == "shard_count").values(value="2"))
            running.thread.join(5 + MARGIN)
        finally:
            running.stop(close=False, clean=False)
            transport.close(0)
    engine.dispose()
    assert [type(e).__name__ for e in running.error] == ["SchemaError"], running.error
    assert "shard count changed" in str(running.error[0])


def test_a_tenant_fleet_exactly_once_on_the_mock_cluster_is_refused_not_retried_for_good(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A single relay refuses exactly once on librdkafka's mock cluster at its start
    (``ConfigurationError``, the CLI's one line, exit 2). A fleet logged it once per tenant ("tried
    again with backoff") and went on for good: every tenant took its leases, was refused, gave them
    back, again and again; ``outbox relay --tenants --exactly-once`` on ``outbox dev-broker`` never
    exited. The mock is the fleet's broker, not a tenant's: nothing a retry can change, so the fleet
    stops and ``run`` raises it (``UnsupportedBrokerError``)."""
    engines = {name: create_engine(f"sqlite:///{tmp_path / name}.db") for name in ("a", "b")}
    for engine in engines.values():
        Outbox(engine, shards=2).create_tables()
    with embedded_kafka(brokers=1) as bootstrap:
        fleet = TenantRelay([Tenant(name, database=str(engine.url)) for name, engine in engines.items()],
                            lambda: KafkaTransport({"message.max.bytes": "1001000"},
                                                   bootstrap_servers=bootstrap),
                            tenant_header="tenant", lease_ttl=2.0, poll_interval=0.1, workers=2,
                            exactly_once=True, progress_topic="fleet-on-the-mock")
        running = Running(fleet, stop_timeout=5)
        try:
            running.thread.join(10)
            ended = not running.thread.is_alive()
        finally:
            running.stop(clean=False)
    for engine in engines.values():
        engine.dispose()
    assert ended, "the fleet went on serving tenants it can never serve"
    assert [type(e).__name__ for e in running.error] == ["UnsupportedBrokerError"], running.error
    assert isinstance(running.error[0], ConfigurationError) and "mock cluster" in str(running.error[0])
    assert "tried again with backoff" not in caplog.text


def test_a_transport_whose_progress_topic_check_takes_no_stop_event_is_refused_in_one_line(
        sqlite_db: str) -> None:
    """``Transactions.ensure_compacted_topic`` grew a ``stopping`` argument (9d51fb8), passed by
    position: a third-party transport written against the protocol before it (every member there)
    passed the construction's check and failed the run with a ``TypeError`` (too many arguments) at
    its progress-topic check. Refused when the relay is made, naming what it lacks, as a member
    added since is (``test_relay_exactly_once.py``)."""
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    inner = KafkaTransport(bootstrap_servers="127.0.0.1:9")

    class Older:
        features = KafkaTransport.features
        publish, close = inner.publish, inner.close
        transactional, read_back, transaction_timeout = (
            inner.transactional, inner.read_back, inner.transaction_timeout)

        def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float) -> None:
            inner.ensure_compacted_topic(topic, partitions, timeout)

    try:
        with pytest.raises(ConfigurationError, match=r"Older claims transactions but lacks what "
                                                     r"transports\.Transactions asks: .*stopping"):
            Relay(outbox, Older(), exactly_once=True)
    finally:
        inner.close(0)
