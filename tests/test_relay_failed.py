"""Permanent failures through the real transport: failed row, only its key blocked, one alert,
and ``outbox failed list|retry|skip`` / ``outbox stats`` from the command line."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from _relay_helpers import publish, rows, seqs_by_key
from typer.testing import CliRunner

from outbox import Alert, Outbox, Relay
from outbox.cli import app
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.any_kafka
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
    outbox: Outbox, db_url: str, any_kafka: str, topic: str
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
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka), alert=alerts.append)
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
    records = read_topic(any_kafka, topic, expected=3)
    assert seqs_by_key(records) == {b"a": [1, 3], b"b": [1]}
    assert "no failed rows" in cli("failed", "list", "--db", db_url)


STRICT = {"allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 1000}
"""A producer that creates no topic, and believes the broker's "unknown topic" after 1 s (30 s by
default: a topic being created answers "unknown" for a moment on Apache Kafka)."""


def test_unknown_topic_fails_and_retry_sends_the_key_in_order(
    outbox: Outbox, db_url: str, any_kafka: str, topic: str
) -> None:
    publish(outbox, topic, ["k", "k", "k"])
    alerts: list[Alert] = []
    strict = KafkaTransport(bootstrap_servers=any_kafka, **STRICT)
    relay = Relay(outbox, strict, alert=alerts.append)
    settle(relay)
    relay.close()
    assert [r.status for r in rows(outbox)] == ["failed", "pending", "pending"]
    assert len(alerts) == 1
    # The operator creates the topic (here: a relay whose producer may auto-create it) and retries.
    assert "1 row(s) pending again" in cli("failed", "retry", "--all", "--db", db_url, *WHO)
    assert "[retried by alice at " in rows(outbox)[0].last_error  # who and why, kept with the row
    fixed = Relay(outbox, KafkaTransport(bootstrap_servers=any_kafka))
    settle(fixed)
    fixed.close()
    assert [r.status for r in rows(outbox)] == ["published"] * 3
    assert seqs_by_key(read_topic(any_kafka, topic, expected=3)) == {b"k": [1, 2, 3]}


def test_retry_right_after_creating_the_topic_publishes_without_a_second_alert(
    outbox: Outbox, db_url: str, any_kafka: str, topic: str
) -> None:
    """The same relay and transport: an unknown-topic error must not be remembered past the fix."""
    from confluent_kafka import Producer

    publish(outbox, topic, ["k", "k"])
    alerts: list[Alert] = []
    strict = KafkaTransport(bootstrap_servers=any_kafka, **STRICT)
    relay = Relay(outbox, strict, alert=alerts.append)
    settle(relay)
    assert [r.status for r in rows(outbox)] == ["failed", "pending"] and len(alerts) == 1
    # The operator creates the topic (here: a metadata request that may auto-create it).
    creator = Producer({"bootstrap.servers": any_kafka})
    assert creator.list_topics(topic, timeout=10).topics[topic].error is None
    assert "1 row(s) pending again" in cli("failed", "retry", "--all", "--db", db_url, *WHO)
    settle(relay)
    relay.close()
    assert [r.status for r in rows(outbox)] == ["published"] * 2
    assert len(alerts) == 1
    assert seqs_by_key(read_topic(any_kafka, topic, expected=2)) == {b"k": [1, 2]}


def test_retry_and_skip_need_ids_or_all(db_url: str, outbox: Outbox) -> None:
    result = runner.invoke(app, ["failed", "retry", "--db", db_url, *WHO])
    assert result.exit_code != 0 and "--all" in result.output


def test_unknown_topic_fails_through_kafka_python_ng(
    outbox: Outbox, db_url: str, any_kafka: str, topic: str
) -> None:
    """kafka-python-ng only logs UnknownTopicOrPartition and waits max_block_ms (60 s)."""
    from kafka import KafkaProducer

    from transports.kafka_python import KafkaPythonTransport

    publish(outbox, topic, ["k", "k", None])
    alerts: list[Alert] = []
    producer = KafkaProducer(bootstrap_servers=any_kafka.split(","), acks="all")  # max_block_ms 60 s
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
    assert seqs_by_key(read_topic(any_kafka, topic, expected=3)) == {b"k": [1, 2]}
