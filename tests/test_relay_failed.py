"""Permanent failures through the real transport: failed row, only its key blocked, one alert,
and ``outbox failed list|retry|skip`` / ``outbox stats`` from the command line."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import publish, rows, seqs_by_key, wait_for
from typer.testing import CliRunner

from outbox import Alert, Outbox, Relay, create_engine
from outbox.cli import app
from outbox.testing import LocalKafka, create_topic, delete_topic
from tests.conftest import unavailable
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka
WHO = ["--by", "alice", "--reason", "the fix is deployed"]  # every operator action says who and why
runner = CliRunner()


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """The relay's failed-row handling runs on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


def cli(*args: str) -> str:
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def settle(relay: Relay, rounds: int = 4) -> None:
    for _ in range(rounds):
        relay.run_once()


def test_too_large_fails_blocks_only_its_key_alerts_once_and_skip_unblocks(
    outbox: Outbox, db_url: str, kafka: str, topic: str
) -> None:
    # Over librdkafka's default message.max.bytes (1,000,000): publish() refuses such a payload
    # now, so the row is made as an older release (or raw SQL) would have left it.
    publish(outbox, topic, ["a"])
    big = publish(outbox, topic, ["a"], payload=b"x")[0]
    m = outbox.tables.messages
    assert isinstance(outbox.engine, sa.Engine)
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(m).where(m.c.message_id == big).values(payload=b"x" * 1_040_000))
    publish(outbox, topic, ["a", "b"])
    alerts: list[Alert] = []
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka), alert=alerts.append)
    settle(relay)
    assert [(r.key, r.status) for r in rows(outbox)] == [
        ("a", "published"), ("a", "failed"), ("a", "pending"), ("b", "published")
    ]
    assert "too large" in rows(outbox, message_id=big)[0].last_error.lower()
    assert [(a.kind, a.message_id) for a in alerts] == [("message_failed", str(big))]

    assert str(big) in cli("failed", "list", "--db", db_url)
    stats = cli("stats", "--db", db_url)
    assert topic in stats and "total" in stats
    assert "1 row(s) skipped" in cli("failed", "skip", str(big), "--db", db_url, *WHO)
    note = rows(outbox, message_id=big)[0].last_error
    assert "[skipped by alice at " in note and note.endswith(": the fix is deployed]")  # the console's record
    settle(relay)
    relay.close()
    assert [r.status for r in rows(outbox)] == ["published", "skipped", "published", "published"]
    assert len(alerts) == 1
    records = read_topic(kafka, topic, expected=3)
    assert seqs_by_key(records) == {b"a": [1, 3], b"b": [1]}
    assert "no failed rows" in cli("failed", "list", "--db", db_url)


STRICT = {"allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 1000}
"""A producer that creates no topic, and believes the broker's "unknown topic" after 1 s (30 s by
default: a topic being created answers "unknown" for a moment on Apache Kafka)."""


def test_unknown_topic_fails_and_retry_sends_the_key_in_order(
    outbox: Outbox, db_url: str, kafka: str, topic: str
) -> None:
    publish(outbox, topic, ["k", "k", "k"])
    alerts: list[Alert] = []
    strict = KafkaTransport(bootstrap_servers=kafka, **STRICT)
    relay = Relay(outbox, strict, alert=alerts.append)
    settle(relay)
    relay.close()
    assert [r.status for r in rows(outbox)] == ["failed", "pending", "pending"]
    assert len(alerts) == 1
    # The operator creates the topic (here: a relay whose producer may auto-create it) and retries.
    assert "1 row(s) pending again" in cli("failed", "retry", "--all", "--db", db_url, *WHO)
    assert "[retried by alice at " in rows(outbox)[0].last_error  # who and why, kept with the row
    fixed = Relay(outbox, KafkaTransport(bootstrap_servers=kafka))
    settle(fixed)
    fixed.close()
    assert [r.status for r in rows(outbox)] == ["published"] * 3
    assert seqs_by_key(read_topic(kafka, topic, expected=3)) == {b"k": [1, 2, 3]}


def test_retry_right_after_creating_the_topic_publishes_without_a_second_alert(
    outbox: Outbox, db_url: str, kafka: str, topic: str
) -> None:
    """The same relay and transport: an unknown-topic error must not be remembered past the fix."""
    publish(outbox, topic, ["k", "k"])
    alerts: list[Alert] = []
    strict = KafkaTransport(bootstrap_servers=kafka, **STRICT)
    relay = Relay(outbox, strict, alert=alerts.append)
    settle(relay)
    assert [r.status for r in rows(outbox)] == ["failed", "pending"] and len(alerts) == 1
    create_topic(kafka, topic, 4)  # the operator's fix
    assert "1 row(s) pending again" in cli("failed", "retry", "--all", "--db", db_url, *WHO)
    settle(relay)
    relay.close()
    assert [r.status for r in rows(outbox)] == ["published"] * 2
    assert len(alerts) == 1
    assert seqs_by_key(read_topic(kafka, topic, expected=2)) == {b"k": [1, 2]}


def test_retry_and_skip_need_ids_or_all(db_url: str, outbox: Outbox) -> None:
    result = runner.invoke(app, ["failed", "retry", "--db", db_url, *WHO])
    assert result.exit_code != 0 and "--all" in result.output


def test_unknown_topic_fails_through_kafka_python_ng(
    outbox: Outbox, db_url: str, kafka: str, topic: str
) -> None:
    """kafka-python-ng only logs UnknownTopicOrPartition and waits max_block_ms (60 s)."""
    from kafka import KafkaProducer

    from transports.kafka_python import KafkaPythonTransport

    publish(outbox, topic, ["k", "k", None])
    alerts: list[Alert] = []
    producer = KafkaProducer(bootstrap_servers=kafka.split(","), acks="all")  # max_block_ms 60 s
    strict = KafkaPythonTransport(producer, allow_auto_create_topics=False)
    relay = Relay(outbox, strict, alert=alerts.append)
    started = time.monotonic()
    settle(relay)
    took = time.monotonic() - started
    relay.close()
    assert [r.status for r in rows(outbox)] == ["failed", "pending", "failed"]
    assert "UnknownTopicOrPartition" in rows(outbox)[0].last_error
    assert len(alerts) == 2 and took < 20, (alerts, took)
    assert "2 row(s) pending again" in cli("failed", "retry", "--all", "--db", db_url, *WHO)
    fixed = Relay(outbox, KafkaPythonTransport(producer))  # may auto-create the topic
    settle(fixed)
    fixed.close()
    producer.close(5)
    assert [r.status for r in rows(outbox)] == ["published"] * 3
    assert seqs_by_key(read_topic(kafka, topic, expected=3)) == {b"k": [1, 2]}


def _transport_of(client: str, kafka: str) -> Any:
    if client == "kafka_python":
        from kafka import KafkaProducer

        from transports.kafka_python import KafkaPythonTransport

        return KafkaPythonTransport(KafkaProducer(bootstrap_servers=kafka.split(","), acks="all",
                                                  linger_ms=5))
    return KafkaTransport(bootstrap_servers=kafka)


@pytest.mark.parametrize("client", ["kafka", "kafka_python"])
def test_a_record_the_broker_refuses_for_size_fails_alone_and_the_other_key_flows(
    sqlite_db: str, kafka: str, topic: str, client: str
) -> None:
    """Apache Kafka refuses a whole request when a record in it is over the topic's ``max.message.bytes``.

    Two keys share the topic's one partition, so their records travel in the same requests
    (pipelined: all twenty in one; in waves: a:5 with b:5). The broker answers the request
    "message too large" for every record in it; only a:5 is too large on its own. The
    transport sends the refused records again one per request: a:5 alone is refused and fails,
    everything of b and a:1-4 is delivered, a:6-10 wait behind the failed row.
    (Before: every record of the refused request came back failed, b's first one included.)
    """
    create_topic(kafka, topic, 1, config={"max.message.bytes": "4096"})
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    publish(outbox, topic, ["a", "b"] * 4)
    big = publish(outbox, topic, ["a"], payload=os.urandom(8000))[0]  # incompressible: > 4096 after lz4
    publish(outbox, topic, ["b"] + ["a", "b"] * 5)
    alerts: list[Alert] = []
    relay = Relay(outbox, _transport_of(client, kafka), alert=alerts.append)
    settle(relay)
    relay.close()
    statuses = {(r.key, r.seq): r.status for r in rows(outbox)}
    assert statuses == {**{("a", n): "published" for n in range(1, 5)}, ("a", 5): "failed",
                        **{("a", n): "pending" for n in range(6, 11)},
                        **{("b", n): "published" for n in range(1, 11)}}, statuses
    assert "large" in rows(outbox, message_id=big)[0].last_error.lower()  # "too large", "TooLarge"
    assert [(a.kind, a.message_id) for a in alerts] == [("message_failed", str(big))]
    assert seqs_by_key(read_topic(kafka, topic, expected=14)) == {
        b"a": [1, 2, 3, 4], b"b": list(range(1, 11))}
    outbox.engine.dispose()  # type: ignore[union-attr]


@pytest.mark.parametrize("client", ["kafka", "kafka_python"])
def test_a_keyless_row_on_a_compacted_topic_stops_no_key(
    sqlite_db: str, kafka: str, topic: str, client: str
) -> None:
    """A compacted topic takes no record without a key: Apache Kafka refuses the whole request
    (INVALID_RECORD) that holds one. The keyless row alone is refused; both keys flow.

    Through KafkaTransport the row fails (INVALID_RECORD is permanent). kafka-python-ng 2.2
    knows no error code 87 and reports ``UnknownError``, which may pass later: the row is
    retried, alone, and no key waits for it.
    """
    create_topic(kafka, topic, 1, config={"cleanup.policy": "compact"})
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    publish(outbox, topic, ["a", "b"] * 3)
    keyless = publish(outbox, topic, [None])[0]
    publish(outbox, topic, ["a", "b"] * 3)
    alerts: list[Alert] = []
    relay = Relay(outbox, _transport_of(client, kafka), alert=alerts.append)
    settle(relay)
    relay.close()
    statuses = {(r.key, r.seq): r.status for r in rows(outbox)}
    assert statuses == {**{(k, n): "published" for k in "ab" for n in range(1, 7)},
                        (None, None): "failed" if client == "kafka" else "pending"}, statuses
    assert rows(outbox, message_id=keyless)[0].last_error
    assert [a.message_id for a in alerts] == ([str(keyless)] if client == "kafka" else [])
    assert seqs_by_key(read_topic(kafka, topic, expected=12)) == {b"a": list(range(1, 7)),
                                                                  b"b": list(range(1, 7))}
    outbox.engine.dispose()  # type: ignore[union-attr]


@pytest.mark.slow  # a broker of its own: topics are created by hand only
def test_a_topic_deleted_under_the_relay_fails_only_its_keys_and_flows_again_once_created(
    tmp_path: Path, topic: str
) -> None:
    """Apache Kafka without auto-creation: one of two topics is deleted under a running relay.

    A writer publishes to both topics throughout, ten keys each. The deleted topic's keys fail
    at their head (one alert per key, records in flight included: "unknown partition", the
    pipeline behind them held); the other topic's keys are never held, every row published
    and in order. The operator creates the topic again and runs ``outbox failed retry --all``:
    the relay sends each key from its failed head, in order, without a second alert (the
    transport forgets the topic's partition count when it is refused as unknown: before, a
    retry within the 30 s cache failed again on librdkafka's "no such topic").
    """
    try:
        broker = LocalKafka({"auto.create.topics.enable": "false"})
    except FileNotFoundError as exc:
        unavailable(str(exc))
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    doomed, other = f"{topic}-doomed", f"{topic}-other"
    with broker:
        create_topic(broker.bootstrap, doomed, 2)
        create_topic(broker.bootstrap, other, 2)
        outbox = Outbox(create_engine(db))
        outbox.create_tables()
        alerts: list[Alert] = []
        # "Unknown" believed after 2 s (librdkafka's and the transport's wait for a topic being
        # created: 30 s by default, which a deleted topic's first batch waits out too).
        transport = KafkaTransport(bootstrap_servers=broker.bootstrap, delivery_timeout=10,
                                   **{"topic.metadata.propagation.max.ms": 2000})
        relay = Relay(outbox, transport, alert=alerts.append, poll_interval=0.05, batch_size=200)
        running = threading.Thread(target=relay.run, name="relay-under-test")
        writing = threading.Event()
        writing.set()

        def write() -> None:
            while writing.is_set():
                with outbox._sessions() as session, session.begin():
                    for t in (doomed, other):
                        for k in range(10):
                            outbox.publish(session, t, {"k": k}, key=f"k{k}")
                time.sleep(0.02)

        writer = threading.Thread(target=write, name="writer")
        running.start()
        writer.start()
        try:
            wait_for(lambda: len(rows(outbox, topic=doomed, status="published")) >= 200, 30, "a flow")
            delete_topic(broker.bootstrap, doomed)
            written = len(rows(outbox, topic=other))
            wait_for(lambda: len({r.key for r in rows(outbox, topic=doomed, status="failed")}) == 10,
                     60, "every key of the deleted topic failed at its head")
            # The other topic flows on: what was written by the deletion, and more, gets published.
            wait_for(lambda: len(rows(outbox, topic=other, status="published")) >= written + 20,
                     60, "the other topic's rows written after the deletion")
            create_topic(broker.bootstrap, doomed, 2)
            assert "pending again" in cli("failed", "retry", "--all", "--db", db, *WHO)
            time.sleep(1)
        finally:
            writing.clear()
            writer.join(30)
        try:
            wait_for(lambda: not rows(outbox, status="pending") and not rows(outbox, status="failed"),
                     60, "every row published after the retry")
        finally:
            relay.stop()
            running.join(30)
        assert not running.is_alive()
        stored = rows(outbox)
        assert {r.status for r in stored} == {"published"}
        failed_ids = {a.message_id for a in alerts}
        assert {a.kind for a in alerts} == {"message_failed"} and len(alerts) == 10, alerts
        assert all(r.topic == doomed for r in stored if str(r.message_id) in failed_ids)
        # The other topic: everything, once each at first, in seq order. Both topics are read to
        # each partition's end, not to a count: a record sent again after a delivery time-out
        # could make up the count before a key's last seqs were read.
        others = [r for r in stored if r.topic == other]
        on_other = read_topic(broker.bootstrap, other, expected=len(others), whole=True)
        assert seqs_by_key(on_other) == {
            f"k{k}".encode(): list(range(1, len(others) // 10 + 1)) for k in range(10)}, (
            f"{len(on_other)} records read to each partition's end, {len(others)} rows")
        # The topic created again holds each key from (at most) its failed head to its last row,
        # in order: what was written before the deletion went with the old topic.
        heads = {r.key: r.seq for r in stored if str(r.message_id) in failed_ids}
        last = {f"k{k}": max(r.seq for r in stored if r.topic == doomed and r.key == f"k{k}")
                for k in range(10)}
        again = seqs_by_key(read_topic(broker.bootstrap, doomed,
                                       expected=sum(last[k] - heads[k] + 1 for k in heads), whole=True))
        for key, seqs in again.items():
            k = key.decode()
            assert seqs == list(range(seqs[0], last[k] + 1)) and seqs[0] <= heads[k], (k, seqs[:5], heads[k])
        outbox.engine.dispose()  # type: ignore[union-attr]

