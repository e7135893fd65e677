"""Attacks on an exactly-once relay's start with the database going away (docs/relay.md).

An exactly-once relay checks (and makes) its progress topic before its first send, waiting up to the
transaction timeout for a broker that does not answer; its lease thread runs meanwhile. The database
stopped or frozen during that wait, or during a take-over's settle, is an outage like any other: told
once each way, no attempt counted, a stop honoured within its bound, and once both are back every row
on the topic once, in key order, for a read_committed reader. Real servers: Apache Kafka frozen with
SIGSTOP, a PostgreSQL of the test's own stopped (``pg_ctl stop``) or frozen (SIGSTOP).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import (
    Running,
    killed_after_its_commit,
    owned_leases,
    publish,
    rows,
    schema_outboxes,
    seqs_by_key,
    start_cli_relay,
    wait_for,
)
from confluent_kafka.admin import AdminClient, ConfigResource

from outbox import Outbox, Relay, create_engine
from outbox.tenants import Tenant, TenantRelay
from outbox.testing import LocalKafka, LocalPostgres, delete_topic
from tests.conftest import thawed_and_running
from transports.kafka import KafkaTransport
from transports.testing import read_topic

# Slow: servers stopped, frozen and started (docs/testing.md); one worker runs them, with the module's broker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("exactly-once-start-db-attacks")]

MARGIN = 1.5
"""Seconds on top of a bound for the thread switch and a slow, shared machine."""

KEYS = [f"k{i % 4}" for i in range(24)]
"""Four keys, six rows each: the order of each on the wire is checked."""


@pytest.fixture
def own_kafka(module_kafka: LocalKafka) -> LocalKafka:
    return thawed_and_running(module_kafka)


def told(caplog: pytest.LogCaptureFixture, worker: str, text: str) -> int:
    """Lines of relay ``worker`` saying ``text`` ("database unreachable"; a fleet's database lines name
    the database between: "relay W: database URL unreachable")."""
    dependency, said = text.split(" ", 1)
    line = re.compile(rf"relay {re.escape(worker)}: {dependency}( \S+)? {re.escape(said)}")
    return sum(1 for r in caplog.records if line.match(r.getMessage()))


def checking(own_kafka: LocalKafka) -> Checking:
    """A Kafka transport of ``own_kafka`` whose progress-topic checks are counted in a list of its own
    (``checks``: an event each, set once the check returned or raised)."""
    made = Checking(bootstrap_servers=own_kafka.bootstrap, delivery_timeout=10)
    made.checks = []
    return made


def reachable_rows_of(read: Any, outbox: Outbox) -> list[Any] | None:
    """``read(outbox)``, or None when the database did not answer (a pooled connection a restart killed)."""
    try:
        return read(outbox)
    except sa.exc.OperationalError:
        return None


def reachable_rows(outbox: Outbox, **where: Any) -> list[Any] | None:
    """``rows``, or None when the database did not answer (a pooled connection a restart killed)."""
    try:
        return rows(outbox, **where)
    except sa.exc.OperationalError:
        return None


def on_the_wire_once_in_order(bootstrap: str, topic: str, outbox: Outbox) -> None:
    stored = rows(outbox)
    records = read_topic(bootstrap, topic, expected=len(stored), settle=1.5, isolation="read_committed")
    copies = Counter(dict(r.headers)["outbox-message-id"].decode() for r in records)
    assert copies == Counter({str(r.message_id): 1 for r in stored}), copies
    expected: dict[bytes, list[int]] = {}
    for row in stored:
        expected.setdefault(row.key.encode(), []).append(row.seq)
    assert seqs_by_key(records) == expected
    assert {r.attempts for r in stored} == {1}, Counter(r.attempts for r in stored)


def in_its_check(own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
                 worker: str) -> tuple[sa.Engine, Outbox, Checking, Relay]:
    """An outbox of ``KEYS`` on ``own_postgres`` and an exactly-once relay of it, not yet run; the
    broker frozen, so the relay's start waits in its progress-topic check (its transport's ``checks``)."""
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=2)
    outbox.create_tables()
    publish(outbox, topic, KEYS)
    transport = checking(own_kafka)
    relay = Relay(outbox, transport, worker_id=worker, exactly_once=True, lease_ttl=1.5,
                  poll_interval=0.1, progress_topic=progress_topic)
    own_kafka.freeze()
    return engine, outbox, transport, relay


def server_outage(own_postgres: LocalPostgres, outage: str) -> tuple[Any, Any]:
    """How the database goes away and comes back: ``stopped`` or ``frozen``."""
    if outage == "stopped":
        return own_postgres.stop, own_postgres.start
    return own_postgres.freeze, own_postgres.thaw


@pytest.mark.parametrize("outage", ["stopped", "frozen"])
@pytest.mark.parametrize("first_back", ["database", "broker"])
def test_a_database_outage_during_the_progress_topic_check_is_waited_out_and_the_relay_resumes(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture, outage: str, first_back: str) -> None:
    """The broker frozen, so the relay's start waits in its progress-topic check; the database goes away
    meanwhile (stopped, or frozen), so the lease thread's renewals fail. Told once each way; both back
    (in either order), the relay resumes: every row once on the topic, in key order, no attempt more
    than the one that sent it, and ``run`` raises nothing."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine, outbox, transport, relay = in_its_check(own_postgres, own_kafka, topic, progress_topic,
                                                    "check-db")
    down, up = server_outage(own_postgres, outage)
    running = Running(relay, stop_timeout=5)
    try:
        wait_for(lambda: transport.checks, 20, "the progress-topic check")
        down()
        went = time.monotonic()
        # A stopped server is told (the lease thread's renewal refused); a frozen one holds the renewal
        # (nothing bounds a read on PostgreSQL) past a lease TTL: its leases lapse meanwhile (told only
        # once the renewal is 5 s old, ``UNANSWERED_AT_LEAST``: a database back first may be in time).
        wait_for(lambda: told(caplog, "check-db", "database unreachable") if outage == "stopped"
                 else time.monotonic() > went + 2 * relay.leases.ttl, 10, "the outage")
        assert not transport.checks[0].is_set(), "the check ended before the database went away"
        if first_back == "database":
            up()
            wait_for(lambda: told(caplog, "check-db", "database reachable again") if outage == "stopped"
                     else owned_leases(outbox), 10, "the database back")
            own_kafka.thaw()
        else:
            own_kafka.thaw()
            wait_for(lambda: transport.checks[0].is_set(), 10, "the check to end")
            up()
        wait_for(lambda: not rows(outbox, status="pending"), 30, "every row published", interval=0.1)
        assert running.thread.is_alive()
    finally:
        if own_kafka.frozen:
            own_kafka.thaw()
        if outage == "frozen":
            own_postgres.thaw()
        running.stop()
        transport.close(0)
    on_the_wire_once_in_order(own_kafka.bootstrap, topic, outbox)
    engine.dispose()
    down_lines = told(caplog, "check-db", "database unreachable")
    assert down_lines == (1 if outage == "stopped" else down_lines) <= 1, caplog.messages
    assert told(caplog, "check-db", "database reachable again") == down_lines, caplog.messages
    assert "did not finish" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("outbox")], \
        caplog.messages


@pytest.mark.parametrize("outage", ["stopped", "frozen"])
def test_a_relay_stopped_in_its_progress_topic_check_with_the_database_down_returns_within_the_bound(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture, outage: str) -> None:
    """Both down (the broker frozen in the check, the database stopped or frozen under the lease
    thread): a stop returns within the stop bound, ``run`` raises nothing; once both are back a new
    relay sends every row once, in key order."""
    engine, outbox, transport, relay = in_its_check(own_postgres, own_kafka, topic, progress_topic,
                                                    "stopped-db")
    down, up = server_outage(own_postgres, outage)
    running = Running(relay, stop_timeout=3)
    try:
        wait_for(lambda: transport.checks, 20, "the progress-topic check")
        down()
        wait_for(lambda: told(caplog, "stopped-db", "database unreachable") or outage == "frozen", 10,
                 "the outage told")
        took = running.stop(close=False)
    finally:
        own_kafka.thaw()
        up()
    assert took < 3 + MARGIN, f"run returned {took:.1f}s after the stop"
    second = Relay(outbox, KafkaTransport(bootstrap_servers=own_kafka.bootstrap), worker_id="after",
                   exactly_once=True, lease_ttl=1.5, poll_interval=0.1, progress_topic=progress_topic)
    again = Running(second, stop_timeout=5)
    try:
        # The first relay's leases expire (its release could not reach the database) before these
        # are taken: a TTL.
        wait_for(lambda: not rows(outbox, status="pending"), 30, "every row published", interval=0.1)
    finally:
        again.stop()
        second.transport.close(0)
        relay.close()
        transport.close(0)
    on_the_wire_once_in_order(own_kafka.bootstrap, topic, outbox)
    engine.dispose()
    assert "did not finish" not in caplog.text


@pytest.mark.parametrize("outage", ["stopped", "restarted"])
def test_a_database_outage_between_a_take_overs_read_back_and_its_marks_loses_and_doubles_nothing(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, outage: str) -> None:
    """A relay commits its first batch and dies before its marks; the next takes its shards over, reads
    their progress back, and the database goes away just before it marks what that progress names:
    stopped (an outage, told once each way) or restarted (every pooled connection dead). Once it is
    back, the rows committed are marked, not sent again; the rest sent once, in key order."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=2)
    outbox.create_tables()
    publish(outbox, topic, KEYS)

    def relay(worker: str, **options: Any) -> Relay:
        return Relay(outbox, KafkaTransport(bootstrap_servers=own_kafka.bootstrap), worker_id=worker,
                     exactly_once=True, lease_ttl=1.0, poll_interval=0.1, batch_size=8,
                     progress_topic=progress_topic, **options)

    first = relay("first")
    killed_after_its_commit(first, monkeypatch)
    assert len(rows(outbox, status="pending")) == len(KEYS)
    second = relay("second")
    exactly_once = second._step._batch.exactly_once
    assert exactly_once is not None
    real_mark = exactly_once._mark
    marking: list[int] = []
    at_the_mark, gone = threading.Event(), threading.Event()

    def down_before_the_mark(shard: int, epoch: int, ids: list[int]) -> bool:
        if not marking:  # the first mark waits for the database to go (the test's thread stops it)
            marking.extend(ids)
            at_the_mark.set()
            gone.wait(30)
        return real_mark(shard, epoch, ids)

    monkeypatch.setattr(exactly_once, "_mark", down_before_the_mark)
    running = Running(second, stop_timeout=5)
    try:
        wait_for(at_the_mark.is_set, 30, "the take-over's first mark")
        own_postgres.stop()
        if outage == "restarted":
            own_postgres.start()
        gone.set()
        if outage == "stopped":
            wait_for(lambda: told(caplog, "second", "database unreachable"), 10, "the outage told")
            own_postgres.start()
        # The test's reads share the relay's pool: a connection the restart killed fails one of them.
        wait_for(lambda: reachable_rows(outbox, status="pending") == [], 30, "every row published",
                 interval=0.1)
    finally:
        running.stop()
        second.transport.close(0)
        first.transport.close(0)
    assert marking, "no take-over marked rows its progress named"
    on_the_wire_once_in_order(own_kafka.bootstrap, topic, outbox)
    engine.dispose()
    down_lines = told(caplog, "second", "database unreachable")
    assert down_lines == told(caplog, "second", "database reachable again") <= 1, caplog.messages
    assert outage == "restarted" or down_lines == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("outbox")], \
        caplog.messages



class Checking(KafkaTransport):
    """A Kafka transport whose progress-topic checks are told in ``checks`` (an event each, set once
    the check returned or raised): one list for all the transports a fleet makes."""

    checks: list[threading.Event]

    def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float,
                               stopping: threading.Event | None = None) -> None:
        self.checks.append(ended := threading.Event())  # a fleet's tenants check at once: each its own
        try:
            super().ensure_compacted_topic(topic, partitions, timeout, stopping)
        finally:
            ended.set()


def checking_fleet(own_postgres: LocalPostgres, own_kafka: LocalKafka, names: list[str], progress_topic: str,
                   checks: list[threading.Event], **options: Any) -> TenantRelay:
    """An exactly-once fleet of tenants ``names`` (a schema each of ``own_postgres``' database)."""
    bootstrap = own_kafka.bootstrap

    def transport() -> KafkaTransport:
        made = Checking({"message.max.bytes": "1001000"}, bootstrap_servers=bootstrap, delivery_timeout=12)
        made.checks = checks
        return made

    return TenantRelay([Tenant(name, schema=name) for name in names], transport, database=own_postgres.url,
                       worker_id="fleet", tenant_header="tenant", poll_interval=0.1, workers=2,
                       exactly_once=True, progress_topic=progress_topic, **options)


def lease_expiries(outbox: Outbox) -> list[Any]:
    """When the leases held now expire (the database's clock: ``now()`` is read beside them)."""
    leases = outbox.tables.leases
    engine = outbox.engine
    assert isinstance(engine, sa.Engine)
    with engine.connect() as conn:
        return list(conn.execute(sa.select(leases.c.expires_at - sa.func.now()).where(
            leases.c.owner.is_not(None))).scalars())


def test_a_tenant_fleet_renews_its_leases_once_the_database_is_back_though_its_progress_checks_wait(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The broker frozen, an exactly-once fleet's tenants' turns wait in their progress-topic checks
    (12 s here, the transaction timeout); the database is stopped meanwhile (its renewal told the
    outage and closed the database's gate) and started again at once. The gate opened only when a
    tenant's step answered, and every step waited in its check: the renewal thread, which skips a
    database whose gate is closed, renewed nothing until then, and the leases (TTL 3 s) lapsed with the
    database up, for another process to take, while the single relay's lease thread renews them
    during its check. The renewal tries a database whose gate is closed too; its answer opens it."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outboxes = schema_outboxes(engine, ["acme", "globex"], shards=2)
    for outbox in outboxes.values():
        publish(outbox, topic, KEYS)
    checks: list[threading.Event] = []
    fleet = checking_fleet(own_postgres, own_kafka, list(outboxes), progress_topic, checks, lease_ttl=3.0)
    own_kafka.freeze()
    running = Running(fleet, stop_timeout=5)
    try:
        wait_for(lambda: len(checks) == 2 and all(owned_leases(ob) == 2 for ob in outboxes.values()), 20,
                 "the tenants' progress-topic checks, their leases taken")
        own_postgres.stop()
        wait_for(lambda: told(caplog, "fleet", "database unreachable"), 10, "the outage told")
        own_postgres.start()
        back = time.monotonic()
        # Renewed (a TTL ahead) by a round begun after the restart: within an interval (1 s) and a round.
        wait_for(lambda: all((now := reachable_rows_of(lease_expiries, ob)) and min(now).total_seconds() > 2.0
                             for ob in outboxes.values()), 3.0, "the leases renewed")
        assert not any(check.is_set() for check in checks), \
            f"the checks ended {time.monotonic() - back:.1f}s after the database came back: nothing proved"
        assert told(caplog, "fleet", "database reachable again") == 1, caplog.messages
    finally:
        own_kafka.thaw()
        running.stop()
    engine.dispose()
    assert told(caplog, "fleet", "database unreachable") == 1, caplog.messages
    assert "did not finish" not in caplog.text


@pytest.mark.parametrize("first_back", ["database", "broker"])
def test_a_tenant_fleets_database_outage_during_its_progress_topic_checks_is_waited_out(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture, first_back: str) -> None:
    """An exactly-once tenant fleet (two tenants, a schema each of one PostgreSQL database) starts with
    the broker frozen, its tenants' turns waiting in their progress-topic checks, and the database stops
    meanwhile: one outage of that database, told once each way; both back (either first), every
    tenant's rows on the topic once, in key order, and ``run`` raises nothing."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outboxes = schema_outboxes(engine, ["acme", "globex"], shards=2)
    for outbox in outboxes.values():
        publish(outbox, topic, KEYS)
    checks: list[threading.Event] = []
    fleet = checking_fleet(own_postgres, own_kafka, list(outboxes), progress_topic, checks, lease_ttl=1.5)
    own_kafka.freeze()
    running = Running(fleet, stop_timeout=5)
    try:
        wait_for(lambda: checks, 20, "a tenant's progress-topic check")
        own_postgres.stop()
        wait_for(lambda: told(caplog, "fleet", "database unreachable"), 10, "the outage told")
        assert not checks[0].is_set(), "the check ended before the database went away"
        if first_back == "database":
            own_postgres.start()
            wait_for(lambda: told(caplog, "fleet", "database reachable again"), 10, "the database back")
            own_kafka.thaw()
        else:
            own_kafka.thaw()
            wait_for(lambda: checks[0].is_set(), 15, "the check to end")
            own_postgres.start()
        wait_for(lambda: all(reachable_rows(ob, status="pending") == [] for ob in outboxes.values()), 30,
                 "every tenant's rows published", interval=0.1)
        assert running.thread.is_alive()
    finally:
        if own_kafka.frozen:
            own_kafka.thaw()
        running.stop()
    on_wire = read_topic(own_kafka.bootstrap, topic, expected=2 * len(KEYS), settle=1.5,
                         isolation="read_committed")
    for outbox in outboxes.values():
        stored = rows(outbox)
        ids = {str(s.message_id) for s in stored}
        records = [r for r in on_wire if dict(r.headers)["outbox-message-id"].decode() in ids]
        assert Counter(dict(r.headers)["outbox-message-id"].decode() for r in records) == Counter(
            dict.fromkeys(ids, 1))
        expected: dict[bytes, list[int]] = {}
        for row in stored:
            expected.setdefault(row.key.encode(), []).append(row.seq)
        assert seqs_by_key(records) == expected
    engine.dispose()
    assert told(caplog, "fleet", "database unreachable") == 1, caplog.messages
    assert told(caplog, "fleet", "database reachable again") == 1, caplog.messages
    assert "did not finish" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("outbox")], \
        caplog.messages


@pytest.mark.parametrize("first_back", ["database", "broker"])
def test_an_exactly_once_relay_started_with_the_database_and_the_broker_down_waits_for_both(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture, first_back: str) -> None:
    """``run`` begun with PostgreSQL stopped and the broker frozen: it waits for its first leases (the
    database's outage told once), then in its progress-topic check; both back, in either order, every
    row once on the topic in key order, and ``run`` raises nothing."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=2)
    outbox.create_tables()
    publish(outbox, topic, KEYS)
    transport = checking(own_kafka)
    relay = Relay(outbox, transport, worker_id="both-down", exactly_once=True, lease_ttl=1.5,
                  poll_interval=0.1, progress_topic=progress_topic)
    engine.dispose()
    own_postgres.stop()
    own_kafka.freeze()
    running = Running(relay, stop_timeout=5)
    try:
        wait_for(lambda: told(caplog, "both-down", "database unreachable"), 10, "the outage told")
        if first_back == "database":
            own_postgres.start()
            wait_for(lambda: transport.checks, 10, "the progress-topic check, its leases taken")
            own_kafka.thaw()
        else:
            own_kafka.thaw()
            own_postgres.start()
        wait_for(lambda: reachable_rows(outbox, status="pending") == [], 30, "every row published",
                 interval=0.1)
        assert running.thread.is_alive()
    finally:
        if own_kafka.frozen:
            own_kafka.thaw()
        running.stop()
        transport.close(0)
    on_the_wire_once_in_order(own_kafka.bootstrap, topic, outbox)
    engine.dispose()
    assert told(caplog, "both-down", "database unreachable") == 1, caplog.messages
    assert told(caplog, "both-down", "database reachable again") == 1, caplog.messages
    assert "did not finish" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("outbox")], \
        caplog.messages


def test_a_progress_topic_deleted_under_a_running_relay_is_made_again_and_the_relay_goes_on(
        kafka: str, sqlite_db: str, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The progress topic deleted while an exactly-once relay runs (an operator's cleanup): its next
    transaction fails (its progress record has nowhere to go) and every take-over after it found the
    topic missing, for good: the relay checked (made) its progress topic once a run, and sent nothing
    more until restarted, saying only "cannot take shard 0 over yet (topic … not found)". A take-over
    that finds it missing has it checked again, and made, compacted, before the next one."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=2)
    outbox.create_tables()
    publish(outbox, topic, KEYS[:8])
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5), worker_id="deleted",
                  exactly_once=True, lease_ttl=2.0, poll_interval=0.1, progress_topic=progress_topic)
    running = Running(relay, stop_timeout=10)
    try:
        wait_for(lambda: not rows(outbox, status="pending"), 30, "the first rows published")
        delete_topic(kafka, progress_topic)
        publish(outbox, topic, KEYS[8:])
        wait_for(lambda: not rows(outbox, status="pending"), 30, "the rows after the deletion published")
    finally:
        running.stop()
        relay.transport.close(0)
    on_the_wire_once_in_order(kafka, topic, outbox)
    engine.dispose()
    admin = AdminClient({"bootstrap.servers": kafka})
    resource = ConfigResource("topic", progress_topic)
    assert admin.describe_configs([resource])[resource].result(10)["cleanup.policy"].value == "compact"
    assert [m for m in caplog.messages if "progress topic" in m and "made again" in m], caplog.messages


def test_two_exactly_once_relays_started_at_once_make_one_progress_topic_and_send_each_row_once(
        kafka: str, postgres_db: str, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Two relays of one outbox start together, their progress topic missing: both look it up and
    make it at once (one is told it exists, and checks what the other made); they split the shards,
    and every row is on the topic once, in key order, the progress topic compacted."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine, shards=4)
    outbox.create_tables()
    publish(outbox, topic, [f"k{i % 6}" for i in range(60)])
    relays = [Relay(outbox, KafkaTransport(bootstrap_servers=kafka, delivery_timeout=10), worker_id=worker,
                    exactly_once=True, lease_ttl=2.0, poll_interval=0.1, progress_topic=progress_topic)
              for worker in ("left", "right")]
    go = threading.Barrier(2)

    class Together(Running):
        def _run(self, stop_timeout: float) -> None:
            go.wait(10)
            super()._run(stop_timeout)

    running = [Together(relay, stop_timeout=5) for relay in relays]
    try:
        wait_for(lambda: not rows(outbox, status="pending"), 30, "every row published", interval=0.1)
    finally:
        for each in running:
            each.stop()
        for relay in relays:
            relay.transport.close(0)
    on_the_wire_once_in_order(kafka, topic, outbox)
    engine.dispose()
    admin = AdminClient({"bootstrap.servers": kafka})
    resource = ConfigResource("topic", progress_topic)
    assert admin.describe_configs([resource])[resource].result(10)["cleanup.policy"].value == "compact"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("outbox")], \
        caplog.messages


def test_a_relay_killed_in_its_progress_topic_check_is_taken_over_and_nothing_is_lost_or_doubled(
        own_kafka: LocalKafka, postgres_db: str, topic: str, progress_topic: str, tmp_path: Path) -> None:
    """``outbox relay --exactly-once`` SIGKILLed while its progress-topic check waits for the frozen
    broker (its leases taken, its requests in the broker's sockets): once the broker is back, another
    relay takes its shards over when their leases expire and sends every row once, in key order."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine, shards=2)
    outbox.create_tables()
    publish(outbox, topic, KEYS)
    own_kafka.freeze()
    log = tmp_path / "killed.log"
    process = start_cli_relay(postgres_db, own_kafka.bootstrap, log, "--exactly-once", "--worker-id",
                              "killed", "--lease-ttl", "2", "--progress-topic", progress_topic)
    try:
        wait_for(lambda: owned_leases(outbox) == 2, 30, "the relay's leases, its check begun")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        own_kafka.thaw()
    after = Relay(outbox, KafkaTransport(bootstrap_servers=own_kafka.bootstrap), worker_id="after",
                  exactly_once=True, lease_ttl=2.0, poll_interval=0.1, progress_topic=progress_topic)
    running = Running(after, stop_timeout=5)
    try:
        wait_for(lambda: not rows(outbox, status="pending"), 30, "every row published", interval=0.1)
    finally:
        running.stop()
        after.transport.close(0)
    on_the_wire_once_in_order(own_kafka.bootstrap, topic, outbox)
    engine.dispose()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.mark.parametrize("outage", ["stopped", "frozen"])
def test_a_tenant_fleet_stopped_in_its_progress_topic_checks_with_the_database_down_returns_within_the_bound(
        own_postgres: LocalPostgres, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture, outage: str) -> None:
    """An exactly-once fleet's tenants wait in their progress-topic checks (the broker frozen) and the
    database is stopped or frozen under its lease renewal: a stop returns within its bound, ``run``
    raising nothing, and a fleet started once both are back sends every tenant's row once."""
    engine = create_engine(own_postgres.url)
    outboxes = schema_outboxes(engine, ["acme", "globex"], shards=2)
    for outbox in outboxes.values():
        publish(outbox, topic, KEYS)
    engine.dispose()
    checks: list[threading.Event] = []
    fleet = checking_fleet(own_postgres, own_kafka, list(outboxes), progress_topic, checks, lease_ttl=1.5)
    down, up = ((own_postgres.stop, own_postgres.start) if outage == "stopped"
                else (own_postgres.freeze, own_postgres.thaw))
    own_kafka.freeze()
    running = Running(fleet, stop_timeout=3)
    try:
        wait_for(lambda: len(checks) == 2, 20, "the tenants' progress-topic checks")
        down()
        went = time.monotonic()
        # Stopped: the renewal tells it; frozen: the renewal waits in it past a renewal interval.
        wait_for(lambda: told(caplog, "fleet", "database unreachable") if outage == "stopped"
                 else time.monotonic() > went + 1.0, 10, "the outage")
        took = running.stop()
    finally:
        own_kafka.thaw()
        up()
    assert took < 3 + MARGIN, f"run returned {took:.1f}s after the stop"
    again = Running(checking_fleet(own_postgres, own_kafka, list(outboxes), progress_topic, [],
                                   lease_ttl=1.5), stop_timeout=5)
    try:
        wait_for(lambda: all(reachable_rows(ob, status="pending") == [] for ob in outboxes.values()), 30,
                 "every tenant's rows published", interval=0.1)
    finally:
        again.stop()
    on_wire = read_topic(own_kafka.bootstrap, topic, expected=2 * len(KEYS), settle=1.5,
                         isolation="read_committed")
    assert Counter(dict(r.headers)["outbox-message-id"].decode() for r in on_wire) == Counter(
        {str(row.message_id): 1 for ob in outboxes.values() for row in rows(ob)})
    engine.dispose()
