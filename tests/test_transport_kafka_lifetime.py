"""A Kafka transport or source dropped without ``close()`` is destroyed at once, never by the cycle
collector; so is one a relay or a tenant fleet made or was given, once that is dropped.

confluent-kafka's clients are unsafe to collect in a cycle: the collector clears a client (its
callbacks, the thread-local key its calls use) before it destroys it, in a collection that runs on
whichever thread allocates, librdkafka's own included; a collected client then destroys its
librdkafka handle there (confluent-kafka-python issue 1761, "Segmentation fault on GC runs in
multithreaded context", open; a destroy from a thread of the handle's own aborts). Our transport and
source gave their clients bound methods of themselves as callbacks, a cycle, so every one dropped
unclosed (a test's, an application's that forgot) went that way. The callbacks now hold their owner
weakly (``transports._weak``): dropping the owner drops its clients, in the dropping thread.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _relay_helpers import owned_leases, wait_for
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from outbox import ConfigurationError, Outbox, RetriableTransportError, create_engine
from outbox.relay import Relay
from outbox.tenants import Tenant, TenantRelay
from transports import Record
from transports.kafka import KafkaSource, KafkaTransport, embedded_kafka

CLIENTS = (Producer, Consumer, AdminClient)


@pytest.fixture(scope="module")
def mock() -> Iterator[str]:
    with embedded_kafka(brokers=1) as bootstrap:
        yield bootstrap


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cycle collector off: what the test drops is freed at once or stays, visibly."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def clients() -> set[int]:
    return {id(o) for o in gc.get_objects() if isinstance(o, CLIENTS)}


def test_a_transport_dropped_unclosed_frees_its_producers_at_once(mock: str, no_collector: None) -> None:
    before = clients()
    transport = KafkaTransport(bootstrap_servers=mock, delivery_timeout=10)
    [result] = transport.publish([Record(topic="lifetime", value=b"v", key=b"k")])
    assert result.error is None, result
    transactional = transport.transactional("lifetime-tx", timeout=10)
    assert clients() - before, "the transport made no client the test can see"
    del transport, transactional, result
    left = clients() - before
    assert not left, f"{len(left)} client(s) of a dropped transport wait for the cycle collector"


def test_a_source_dropped_unclosed_frees_its_consumer_at_once(mock: str, no_collector: None) -> None:
    before = clients()
    source = KafkaSource(topics=["lifetime"], bootstrap_servers=mock, group_id="lifetime")
    source.poll(10, 0.5)
    assert clients() - before, "the source made no client the test can see"
    del source
    left = clients() - before
    assert not left, f"{len(left)} client(s) of a dropped source wait for the cycle collector"


EXACTLY_ONCE = [False, pytest.param(True, marks=pytest.mark.kafka)]
"""Exactly once runs on Apache Kafka: the mock cluster is refused at the relay's start."""


def take_overs_ended(before: set[int], exactly_once: bool) -> None:
    """Exactly once, take-overs the stop found under way go on on the pool's daemon threads, up to the
    transaction timeout, and close the producer each made once made (``ExactlyOnce._drop``): the
    clients they hold are freed when they end, the collector still off (the mock cluster, refused now,
    never let a take-over begin)."""
    if exactly_once:
        wait_for(lambda: not clients() - before, 30, "the clients of take-overs under way at the stop "
                 "to be freed (the collector is off: a cycle would keep them)")


def broker_for(request: pytest.FixtureRequest, exactly_once: bool) -> str:
    return str(request.getfixturevalue("kafka" if exactly_once else "mock"))


@pytest.mark.parametrize("exactly_once", EXACTLY_ONCE, ids=["plain", "exactly-once"])
def test_a_relay_run_stopped_and_dropped_frees_its_transport_at_once(
        request: pytest.FixtureRequest, no_collector: None, sqlite_db: str, exactly_once: bool) -> None:
    """The relay's own objects hold the transport too: its batch runner and its exactly-once
    publisher (with the shard producers' maker) held each other, so a stopped relay's transport,
    producer and all, waited for the collector."""
    bootstrap = broker_for(request, exactly_once)
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    before = clients()
    transport = KafkaTransport(bootstrap_servers=bootstrap, delivery_timeout=10)
    relay = Relay(outbox, transport, worker_id="lifetime", exactly_once=exactly_once)
    runner = threading.Thread(target=relay.run)
    runner.start()
    wait_for(lambda: owned_leases(outbox) > 0, 30, "the relay to take its shards")  # its loop running
    relay.stop()
    runner.join(30)
    assert not runner.is_alive()
    transport.close()
    del relay, transport, runner
    take_overs_ended(before, exactly_once)
    left = clients() - before
    assert not left, f"{len(left)} client(s) of a dropped relay's transport wait for the cycle collector"


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "unclosed"])
@pytest.mark.parametrize("exactly_once", EXACTLY_ONCE, ids=["plain", "exactly-once"])
def test_a_fleet_run_stopped_and_dropped_frees_its_producers_at_once(
        request: pytest.FixtureRequest, no_collector: None, tmp_path: Path, exactly_once: bool,
        closed: bool) -> None:
    """The fleet's registry of tenants held the fleet (through the method that builds a tenant's
    step) and the fleet holds its transports: the producers its factory made, and exactly once its
    tenants' shard producers, waited for the collector after the fleet was closed and dropped."""
    bootstrap = broker_for(request, exactly_once)
    engines = {name: create_engine(f"sqlite:///{tmp_path / name}.db") for name in ("a", "b")}
    outboxes = [Outbox(engine, shards=2) for engine in engines.values()]
    for ob in outboxes:
        ob.create_tables()
    before = clients()
    fleet = TenantRelay([Tenant(name, database=str(engine.url)) for name, engine in engines.items()],
                        lambda: KafkaTransport({"message.max.bytes": "1001000"}, bootstrap_servers=bootstrap,
                                                       delivery_timeout=10),
                        tenant_header="tenant", lease_ttl=2.0, poll_interval=0.1, workers=2,
                        exactly_once=exactly_once, progress_topic="lifetime-progress")
    runner = threading.Thread(target=fleet.run)
    runner.start()
    wait_for(lambda: all(owned_leases(ob) > 0 for ob in outboxes), 30, "the fleet to take its tenants")
    assert clients() - before, "the fleet made no client the test can see"
    fleet.stop()
    runner.join(30)
    assert not runner.is_alive()
    if closed:
        fleet.close()
    del fleet, runner
    take_overs_ended(before, exactly_once)
    left = clients() - before
    for engine in engines.values():
        engine.dispose()
    assert not left, f"{len(left)} client(s) of a closed and dropped fleet wait for the cycle collector"


def test_a_progress_topic_lookup_failed_on_its_own_thread_frees_its_admin_client_at_once(
        no_collector: None) -> None:
    """The stoppable lookup (``listed``, given the run's stop event) has its metadata request answered
    on a thread of its own, through a future: a lookup that failed (the broker unreachable: every
    take-over of an outage asks again) left the future holding the ``KafkaException`` raised from it,
    whose traceback holds the frames holding the future, and the admin client: a cycle."""
    left = left_by_a_failed_check("127.0.0.1:9", "lookup-failed", 1, 1.0, "cannot look up topic")
    assert not left, f"{len(left)} admin client(s) of a failed lookup wait for the cycle collector"


def left_by_a_failed_check(bootstrap: str, topic: str, partitions: int, timeout: float,
                           match: str) -> set[int]:
    """The clients left once a stoppable progress-topic check failed (``match``) and its metadata
    thread ended."""
    transport = KafkaTransport(bootstrap_servers=bootstrap, delivery_timeout=10)
    before = clients()
    with pytest.raises(RetriableTransportError, match=match):
        transport.ensure_compacted_topic(topic, partitions, timeout, threading.Event())
    wait_for(lambda: not any(t.name == "outbox-metadata" for t in threading.enumerate()), 10,
             "the metadata thread to end")
    left = clients() - before
    transport.close(0)
    return left


class RefusedInATakeOver(KafkaTransport):
    """The progress topic's first check (the relay's start) finds the broker down: the check is left
    to the first take-over's, which refuses the mock there, in the relay's loop (its fatal error)."""

    checks = 0

    def ensure_compacted_topic(self, *args: Any, **kwargs: Any) -> None:
        self.checks += 1
        if self.checks == 1:
            raise RetriableTransportError("the broker is down, for the start's check")
        super().ensure_compacted_topic(*args, **kwargs)


@pytest.mark.parametrize("where", ["start", "take-over"])
def test_a_relay_refused_and_dropped_frees_its_transport_at_once(
        mock: str, no_collector: None, sqlite_db: str, where: str) -> None:
    """Exactly once on the mock cluster is refused by the progress-topic check, the lease thread
    already running: its leases are given back, its threads end, and the relay's transport is freed
    once dropped. The run's error, kept for the caller's thread on a list its frame held (and the
    relay's fatal error of its loop, kept on the relay), held the relay in a cycle through its
    traceback."""
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    before, running = clients(), set(threading.enumerate())
    kind = KafkaTransport if where == "start" else RefusedInATakeOver
    transport = kind(bootstrap_servers=mock, delivery_timeout=10)
    relay = Relay(outbox, transport, worker_id="refused", exactly_once=True)
    with pytest.raises(ConfigurationError, match="mock cluster"):
        relay.run()
    assert owned_leases(outbox) == 0, "the refused relay kept its leases"
    left_running = [t.name for t in set(threading.enumerate()) - running if t.name.startswith("outbox-relay")]
    assert not left_running, f"the refused relay left {left_running} running"
    transport.close()
    del relay, transport
    left = clients() - before
    assert not left, f"{len(left)} client(s) of a refused relay's transport wait for the cycle collector"


@pytest.mark.kafka
def test_a_progress_topic_creation_refused_by_the_broker_frees_its_admin_client_at_once(
        kafka: str, no_collector: None) -> None:
    """The stoppable wait for an admin request (``answer``) holds its future, and a future that failed
    raises the ``KafkaException`` it keeps: its traceback holds that wait's frame, a cycle with the
    admin client (the creation's caller), as for every creation refused (two relays making the
    topic at once: TOPIC_ALREADY_EXISTS) or look at its configuration that failed."""
    left = left_by_a_failed_check(kafka, "lifetime-no-partitions", 0, 10, "cannot create topic")
    assert not left, f"{len(left)} admin client(s) of a refused creation wait for the cycle collector"
