"""Debezium's outbox event router beside us, on Apache Kafka: its events through our inbox.

Debezium 3.6.1's PostgreSQL connector with the outbox ``EventRouter`` runs on a
Kafka Connect worker (``outbox.testing.LocalKafkaConnect``) over a
Debezium-layout outbox table; the inbox reads its topic with
``foreign_records="debezium"``. Proved here: every event applied once (a
duplicate insert of one event, and everything a killed worker sends again),
each key's events in the order they were committed, a failing event parking
its key and what follows, and a replay applying them in order. Also: a
record without an id, new at an offset the group read before (the topic
recreated), is a new message on the real broker.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from _relay_helpers import drain
from confluent_kafka import Producer

from outbox import Inbox, Message, Outbox, Relay
from outbox.testing import (
    ConnectRest,
    DebeziumOutbox,
    LocalKafkaConnect,
    create_topic,
    debezium_over_our_outbox,
    delete_topic,
)
from tests.inbox_support import AlertLog, business, effects
from tests.inbox_worker import TEST_CONSUMER_SETTINGS
from transports.kafka import KafkaSource, KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka


class OrderViolation(AssertionError):
    pass


def apply_in_order(session, message: Message) -> None:  # type: ignore[no-untyped-def]
    """One business row per event, (key, n); ``n`` must follow the key's last one."""
    n = message.json()["n"]
    previous = session.scalar(sa.select(sa.func.max(effects.c.seq)).where(
        effects.c.topic == message.topic, effects.c.key == message.key)) or 0
    if n != previous + 1:
        raise OrderViolation(f"{message.key}: {n} after {previous}")
    session.execute(effects.insert().values(topic=message.topic, key=message.key, seq=n,
                                            message_id=message.message_id))


def redeliveries(engine: sa.Engine, group: str) -> int:
    """Copies the group's inbox dropped as duplicates (each record's deliveries beyond its first)."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT coalesce(sum(deliveries - 1), 0) FROM inbox_messages "
                                        "WHERE consumer_group = :g"), {"g": group}).scalar_one())


def applied(engine: sa.Engine) -> dict[str, list[int]]:
    """Each key's applied n, in the order they were applied."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(effects.c.key, effects.c.seq).order_by(effects.c.id)).all()
    found: dict[str, list[int]] = {}
    for key, n in rows:
        found.setdefault(key, []).append(n)
    return found


@contextmanager
def consuming(inbox: Inbox, bootstrap: str, topics: list[str]) -> Iterator[None]:
    """``inbox.run`` on a thread for the duration; its exception, if any, fails the test."""
    source = KafkaSource(bootstrap_servers=bootstrap, group_id=inbox.group, topics=topics,
                         **TEST_CONSUMER_SETTINGS)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            inbox.run(source, install_signal_handlers=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        inbox.stop()
        thread.join(60)
    assert not thread.is_alive(), "Inbox.run did not return after stop()"
    if errors:
        raise errors[0]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def debezium_inbox(url: str, **kwargs) -> tuple[Inbox, sa.Engine]:  # type: ignore[no-untyped-def]
    engine = sa.create_engine(url, pool_size=10)
    inbox = Inbox(engine, group=f"g-{uuid.uuid4().hex[:8]}", foreign_records="debezium",
                  retry_backoff=0.01, retry_backoff_max=0.05, alert=AlertLog(), **kwargs)
    inbox.create_tables()
    business.create_all(engine)
    return inbox, engine


def insert_events(debezium: DebeziumOutbox, kind: str, keys: list[str], rounds: int, *,
                  first: int = 1) -> list[uuid.UUID]:
    """``rounds`` transactions, each one event of every key (n = round), interleaved; their ids."""
    ids = []
    for n in range(first, first + rounds):
        with debezium.engine.begin() as conn:
            for key in keys:
                ids.append(debezium.insert(conn, kind, key, {"n": n, "key": key}, type="OrderChanged"))
    return ids


@pytest.fixture
def kind() -> str:
    """An aggregate type of the test's own: its topic is the test's (the broker is the session's)."""
    return f"orders{uuid.uuid4().hex[:8]}"


def test_debezium_events_are_applied_once_each_key_in_commit_order(
        debezium: DebeziumOutbox, debezium_db: str, kafka: str, kind: str) -> None:
    topic = debezium.topic(kind)
    create_topic(kafka, topic, 4)
    keys = [f"order-{k}" for k in range(6)]
    ids = insert_events(debezium, kind, keys, 10)
    twice = ids[7]  # the producer writes one event a second time (a retried business transaction)
    with debezium.engine.begin() as conn:
        row = conn.execute(sa.select(debezium.table).where(debezium.table.c.id == twice)).one()
        conn.execute(debezium.table.delete().where(debezium.table.c.id == twice))
    with debezium.engine.begin() as conn:
        conn.execute(debezium.table.insert().values(**row._mapping))
    on_the_wire = read_topic(kafka, topic, expected=61, timeout=120)
    assert len(on_the_wire) == 61
    inbox, engine = debezium_inbox(debezium_db, concurrency=4, batch_size=20)
    inbox.handler(topic)(apply_in_order)
    with consuming(inbox, kafka, [topic]):
        wait_for(lambda: sum(map(len, applied(engine).values())) == 60, "60 events applied")
        wait_for(lambda: redeliveries(engine, inbox.group) == 1, "the second copy dropped")
    assert applied(engine) == {key: list(range(1, 11)) for key in keys}
    with engine.connect() as conn:
        recorded = conn.execute(sa.text("SELECT deliveries FROM inbox_messages WHERE message_id = :id"),
                                {"id": twice}).scalar_one()
    assert recorded == 2


def test_what_a_killed_worker_sends_again_is_dropped_as_duplicates(
        own_connect: LocalKafkaConnect, debezium_db: str, kafka: str, kind: str) -> None:
    """A worker killed before its offsets reached the offsets file starts again from the
    replication slot's confirmed position: Debezium sends those events a second time."""
    with DebeziumOutbox(own_connect, debezium_db, kafka) as debezium:
        topic = debezium.topic(kind)
        create_topic(kafka, topic, 4)
        keys = [f"order-{k}" for k in range(4)]
        insert_events(debezium, kind, keys, 5)
        assert len(read_topic(kafka, topic, expected=20, timeout=120)) == 20
        own_connect.kill()
        own_connect.start()  # the connector again, from the slot: the 20 events come once more
        twice = read_topic(kafka, topic, expected=40, timeout=180)
        assert len(twice) == 40
        assert len({dict(r.headers)["id"] for r in twice}) == 20
        insert_events(debezium, kind, keys, 1, first=6)
        inbox, engine = debezium_inbox(debezium_db, concurrency=4, batch_size=10)
        inbox.handler(topic)(apply_in_order)
        with consuming(inbox, kafka, [topic]):
            wait_for(lambda: sum(map(len, applied(engine).values())) == 24, "24 events applied")
            wait_for(lambda: redeliveries(engine, inbox.group) == 20, "20 second copies dropped")
        assert applied(engine) == {key: [1, 2, 3, 4, 5, 6] for key in keys}


def test_a_failing_event_parks_its_key_and_a_replay_applies_the_rest_in_order(
        debezium: DebeziumOutbox, debezium_db: str, kafka: str, kind: str) -> None:
    topic = debezium.topic(kind)
    create_topic(kafka, topic, 4)
    broken = {"on": True}

    def handler(session, message: Message) -> None:  # type: ignore[no-untyped-def]
        if broken["on"] and message.key == "k1" and message.json()["n"] == 3:
            raise RuntimeError("the billing service is down")
        apply_in_order(session, message)

    inbox, engine = debezium_inbox(debezium_db, concurrency=4, batch_size=10)
    inbox.handler(topic)(handler)
    with consuming(inbox, kafka, [topic]):
        insert_events(debezium, kind, ["k1", "k2"], 6)
        wait_for(lambda: len(inbox.parked(topic, "k1")) == 4, "k1 parked from its event 3 on")
        wait_for(lambda: applied(engine).get("k2") == [1, 2, 3, 4, 5, 6], "k2 applied in full")
        assert applied(engine)["k1"] == [1, 2]
        insert_events(debezium, kind, ["k1"], 1, first=7)  # arrives while k1 is parked: parked behind
        wait_for(lambda: len(inbox.parked(topic, "k1")) == 5, "k1's event 7 parked behind")
        parked = inbox.parked(topic, "k1")
        assert [p.reason.value for p in parked] == ["failed"] + ["key_parked"] * 4
        assert parked[0].attempts == 3
        assert [a.kind for a in inbox.alert] == ["key_parked"]
        broken["on"] = False
        result = inbox.replay(topic, "k1")
        assert (result.applied, result.unparked) == (5, True)
        insert_events(debezium, kind, ["k1"], 1, first=8)
        wait_for(lambda: applied(engine).get("k1") == list(range(1, 9)), "k1 applied in full, in order")
    assert not inbox.parked()


def test_a_record_new_at_an_offset_read_before_is_a_new_message_after_the_topic_is_recreated(
        kafka: str, postgres_db: str) -> None:
    """Offsets start again when a topic is deleted and created again; the group's committed
    offsets go with the topic. A record without an id at offset 0 of the new topic is not the
    one the group read at offset 0 before: identified by its position, it was dropped as a
    duplicate (accept) and the handler never saw it."""
    topic = f"legacy-{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(postgres_db, pool_size=10)
    inbox = Inbox(engine, group=f"g-{uuid.uuid4().hex[:8]}", foreign_records="accept")
    inbox.create_tables()
    seen: list[bytes] = []
    inbox.handler(topic)(lambda session, message: seen.append(message.payload))

    def produce(*values: bytes) -> None:
        producer = Producer({"bootstrap.servers": kafka, "log_level": 0})
        for value in values:
            producer.produce(topic, value, b"legacy-key", partition=0)
        assert producer.flush(30) == 0

    create_topic(kafka, topic, 1)
    produce(b"first life 0", b"first life 1")
    with consuming(inbox, kafka, [topic]):
        wait_for(lambda: len(seen) == 2, "the first life's two records")
    delete_topic(kafka, topic)
    wait_for(lambda: _recreated(kafka, topic), "the topic recreated", timeout=60)
    produce(b"second life 0", b"second life 1")
    with consuming(inbox, kafka, [topic]):
        wait_for(lambda: len(seen) == 4, "the second life's two records", timeout=60)
    # accept hands them over unkeyed: unordered, so compared as sets
    assert sorted(seen) == [b"first life 0", b"first life 1", b"second life 0", b"second life 1"]
    assert redeliveries(engine, inbox.group) == 0


def _recreated(kafka: str, topic: str) -> bool:
    try:
        create_topic(kafka, topic, 1)
    except Exception:  # still being deleted: the controller refuses the name for a moment
        return False
    return True


def test_the_routers_tombstones_reach_the_handler_and_its_heartbeats_park_as_foreign(
        kafka_connect: ConnectRest, debezium_db: str, kafka: str, kind: str) -> None:
    """``route.tombstone.on.empty.payload``: a row without a payload is a tombstone with its id and
    key. Heartbeats sent to the events' own topic (``topic.heartbeat.prefix`` and ``topic.prefix``
    named so) have no ``id``: parked as foreign, one alert, and the stream goes on."""
    topic = DebeziumOutbox.topic(kind)
    create_topic(kafka, topic, 1)
    settings = {"transforms.outbox.route.tombstone.on.empty.payload": "true", "heartbeat.interval.ms": "300",
                "topic.heartbeat.prefix": "outbox.event", "topic.prefix": kind}
    with DebeziumOutbox(kafka_connect, debezium_db, kafka, settings=settings) as debezium:
        with debezium.engine.begin() as conn:
            first = debezium.insert(conn, kind, "k", {"n": 1})
            gone = debezium.insert(conn, kind, "k", None, type="OrderDeleted")
            last = debezium.insert(conn, kind, "k", {"n": 2})
        inbox, _ = debezium_inbox(debezium_db)
        seen: list[Message] = []
        inbox.handler(topic)(lambda session, message: seen.append(message))
        with consuming(inbox, kafka, [topic]):
            wait_for(lambda: len(seen) == 3, "the three events")
            wait_for(lambda: len(inbox.parked(topic)) >= 2, "heartbeats parked")
        assert [m.message_id for m in seen] == [first, gone, last]
        assert (seen[1].payload, seen[1].content_type, seen[1].key, seen[1].event_type) == (
            b"", "application/octet-stream", "k", "OrderDeleted")
        assert all(p.reason.value == "foreign" and "no 'id' header" in (p.error or "")
                   for p in inbox.parked(topic))
        assert [a.kind for a in inbox.alert] == ["foreign_record"]


def test_our_envelope_through_debeziums_router_is_read_as_ours_and_deduplicated_against_our_relay(
        kafka_connect: ConnectRest, debezium_db: str, kafka: str) -> None:
    """The move from our relay to Debezium: Debezium's router sends our outbox table with our
    envelope (``debezium_over_our_outbox``) while our relay still runs; the inbox reads both
    copies as ours, by seq, and applies each message once."""
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    create_topic(kafka, topic, 4)
    engine = sa.create_engine(debezium_db, pool_size=5)
    outbox = Outbox(engine)
    outbox.create_tables()
    settings = debezium_over_our_outbox()
    with DebeziumOutbox(kafka_connect, debezium_db, kafka, table="outbox_messages", probe=False,
                        settings=settings):
        for n in range(1, 6):
            with outbox._sessions() as session, session.begin():
                for key in ("k1", "k2", "k3"):
                    outbox.publish(session, topic, {"n": n}, key=key, headers={"traceparent": "x"})
        assert len(read_topic(kafka, topic, expected=15, timeout=120)) == 15  # Debezium's copies
        relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka))
        drain(relay)  # and ours, the same ids
        relay.close()
        assert len(read_topic(kafka, topic, expected=30, timeout=60)) == 30
        inbox, inbox_engine = debezium_inbox(debezium_db)
        inbox.handler(topic)(apply_in_order)
        with consuming(inbox, kafka, [topic]):
            wait_for(lambda: sum(map(len, applied(inbox_engine).values())) == 15, "15 messages applied")
            wait_for(lambda: redeliveries(inbox_engine, inbox.group) == 15, "the other 15 dropped")
        assert applied(inbox_engine) == {key: [1, 2, 3, 4, 5] for key in ("k1", "k2", "k3")}
        assert not inbox.parked()
