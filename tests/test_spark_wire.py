"""The Spark audit reads the topic itself (read_committed) and finds exactly what is wrong on it.

On a real Apache Kafka: records produced by hand with confluent-kafka carry a duplicate, a
reordering, foreign records and an aborted transaction (which read_committed must not count);
a real relay's topic is the clean case.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pandas as pd
import pytest
import sqlalchemy as sa
from _relay_helpers import drain, publish, rows
from _spark_seed import AS_OF, SLA, spark_for_tests
from confluent_kafka import Producer
from conftest import unavailable
from typer.testing import CliRunner

from outbox import ConfigurationError, Outbox, Relay
from outbox.cli import app
from outbox.core._wire import to_record
from outbox.spark import AuditResult, Window, Wire, WireUnreachableError, audit
from outbox.spark import _session as session_module
from outbox.spark._report import build_summary, wire_summary
from outbox.spark._session import KAFKA_SOURCE_HINT, kafka_source_jars, require_kafka_source
from transports.kafka import KafkaTransport

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark(java_home):
    if not kafka_source_jars():
        unavailable(KAFKA_SOURCE_HINT)
    return spark_for_tests()


def _record(row, *, spelled: bool = False, incarnation: str | None = None, message_id=None):
    """The broker record the relay would send for ``row``; ``spelled`` writes the id and the
    header names another way (upper case, braces) that mean the same."""
    record = to_record(message_id=message_id or row.message_id, topic=row.topic, key=row.key,
                       seq=row.seq, payload=row.payload, content_type=row.content_type,
                       headers=None, created_at=row.created_at.replace(tzinfo=UTC),
                       incarnation=incarnation)
    headers = record.headers
    if spelled:
        headers = [(name.upper(), b"{" + value.upper() + b"}" if name == "outbox-message-id" else value)
                   for name, value in headers]
    return {"key": record.key, "value": record.value, "headers": headers}


def seed_topics(kafka: str, url: str) -> dict:
    """An outbox with two topics: ``clean`` sent by a real relay, ``faulty`` written by hand with
    every fault the wire audit names, and an aborted transaction it must not count."""
    outbox = Outbox(sa.create_engine(url))
    outbox.create_tables()
    ours = outbox.load_schema().incarnation
    clean, faulty = f"clean-{uuid.uuid4().hex[:8]}", f"faulty-{uuid.uuid4().hex[:8]}"

    # The clean case: a real relay sends two keys' messages.
    publish(outbox, clean, ["x", "y"] * 5)
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka))
    drain(relay)
    relay.close()

    # The faulty topic: rows marked published as if a relay had sent them; d stays pending.
    publish(outbox, faulty, ["a", "a", "a", "b", "b", "b", "c", "d"])
    m = outbox.tables.messages
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        conn.execute(sa.update(m).where(m.c.topic == faulty, m.c.key != "d").values(
            status="published", published_at=datetime.now(UTC)))
    row = {(r.key, r.seq): r for r in rows(outbox, topic=faulty)}
    a1, a2, a3, b1, b2, b3, c1 = (row[k] for k in (("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2),
                                                  ("b", 3), ("c", 1)))

    producer = Producer({"bootstrap.servers": kafka, "enable.idempotence": True})
    sent = [_record(a1, incarnation=ours, spelled=True), _record(a2, incarnation=ours),
            _record(a3, incarnation=ours),
            _record(b1, incarnation=ours), _record(b3, incarnation=ours), _record(b2, incarnation=ours),
            _record(a1, incarnation=ours),  # a1 again: a duplicate, not a reordering
            {"key": b"z", "value": b"not ours", "headers": [("source", b"billing")]},
            {"key": None, "value": b"not ours either"},  # no header at all
            {"key": b"z", "value": b"", "headers": [("outbox-message-id", b"not-a-uuid")]},
            _record(a1, incarnation=ours, message_id=uuid.uuid4()),  # an id this outbox never wrote
            _record(a1, incarnation=str(uuid.uuid4()), message_id=uuid.uuid4())]  # another outbox's
    for record in sent:
        producer.produce(faulty, partition=0, **record)
    assert producer.flush(30) == 0
    # An aborted transaction: c1 (missing), a2 again and a foreign record, none of them committed.
    aborted = Producer({"bootstrap.servers": kafka, "transactional.id": f"wire-{uuid.uuid4()}"})
    aborted.init_transactions(30)
    aborted.begin_transaction()
    for record in (_record(c1, incarnation=ours), _record(a2, incarnation=ours),
                   {"key": b"z", "value": b"aborted", "headers": []}):
        aborted.produce(faulty, partition=0, **record)
    assert aborted.flush(30) == 0
    aborted.abort_transaction(30)
    return {"clean": clean, "faulty": faulty, "sent": len(sent), "a1": a1, "b2": b2, "c1": c1}


def assert_findings(result, seeded: dict) -> None:
    """Exactly the seeded faults, in the Parquet datasets and the summary."""
    a1, b2, c1 = seeded["a1"], seeded["b2"], seeded["c1"]
    missing = pd.read_parquet(result.path("wire_missing"))
    assert list(missing.message_id) == [str(c1.message_id)]  # d is pending: not yet due
    duplicates = pd.read_parquet(result.path("wire_duplicates"))
    assert [(r.message_id, r.key, r.seq, r.copies) for r in duplicates.itertuples()] == [
        (str(a1.message_id), "a", 1, 2)]
    reordered = pd.read_parquet(result.path("wire_out_of_order"))
    assert [(r.message_id, r.key, r.seq, r.after_seq) for r in reordered.itertuples()] == [
        (str(b2.message_id), "b", 2, 3)]
    foreign = pd.read_parquet(result.path("wire_foreign"))
    assert sorted(foreign.reason) == ["broken_envelope", "no_envelope", "no_envelope", "other_outbox",
                                      "unknown_message"]

    w = result.summary["wire"]
    assert w["topics"][seeded["clean"]] == {
        "records": 10, "missing": 0, "duplicated_messages": 0, "extra_copies": 0,
        "out_of_order_messages": 0, "out_of_order_keys": 0, "foreign": 0}
    assert w["topics"][seeded["faulty"]] == {
        "records": seeded["sent"], "missing": 1, "duplicated_messages": 1, "extra_copies": 1,
        "out_of_order_messages": 1, "out_of_order_keys": 1, "foreign": 5}
    assert result.ok is False and result.totals["wire_missing"] == 1
    assert "on the wire 1 missing, 1 out of order, 1 duplicated" in result.path("report.md").read_text()


def test_the_wire_audit_finds_what_is_missing_duplicated_reordered_and_foreign(spark, kafka, tmp_path):
    url = f"sqlite:///{tmp_path / 'producer.db'}"
    seeded = seed_topics(kafka, url)

    # Through the command, which picks up the shared session: its options reach the audit.
    out = tmp_path / "audit"
    command = CliRunner().invoke(app, ["spark", "audit", "--outbox-db", url, "--out", str(out),
                                       "--wire-bootstrap", kafka])
    assert command.exit_code == 1, command.output
    assert "## On the wire, per topic (read_committed)" in command.output
    summary = json.loads((out / "summary.json").read_text())
    assert_findings(AuditResult(summary=summary, out_dir=out), seeded)


def test_exactly_once_fails_on_a_duplicate_at_least_once_counts_it():
    found = {"wire_duplicates": {"t": 1}, "wire_extra_copies": {"t": 1}}
    clean = wire_summary(["t"], {"t": 3}, {}, {}, exactly_once=True)
    at_least_once = wire_summary(["t"], {"t": 3}, found, {}, exactly_once=False)
    exactly_once = wire_summary(["t"], {"t": 3}, found, {}, exactly_once=True)
    assert (clean["ok"], at_least_once["ok"], exactly_once["ok"]) == (True, True, False)

    def verdict(wire):
        return build_summary(as_of=AS_OF, window=Window.parse(None, now=AS_OF), sla=SLA, group=None,
                             topics=[], groups=[], found={"lost": {}, "duplicates": {}, "out_of_order": {}},
                             bad_keys={}, wire=wire)

    assert verdict(at_least_once)["ok"] and verdict(at_least_once)["totals"]["wire_duplicated_messages"] == 1
    assert not verdict(exactly_once)["ok"]


def test_a_spark_without_the_kafka_source_is_told_what_to_run(spark, monkeypatch):
    monkeypatch.setattr(session_module, "KAFKA_SOURCE_CLASS", "org.example.NoSuchSource")
    with pytest.raises(ConfigurationError, match="run scripts/setup") as error:
        require_kafka_source(spark)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bootstrap": ""}, "wire bootstrap"),
    ({"bootstrap": "kafka-1:9092,kafka-2"}, "must be host:port.*got 'kafka-2'"),
    ({"bootstrap": "b:9092", "topics": ("bad topic",)}, "invalid topic"),
    ({"bootstrap": "b:9092", "options": {"isolation.level": "read_uncommitted"}}, "set by the audit"),
])
def test_bad_wire_settings_are_refused_before_spark(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Wire(**kwargs)


def test_a_cluster_nobody_answers_at_is_named_in_seconds_before_spark_reads(tmp_path):
    """Spark's Kafka source would retry for minutes (about three here) before a JVM stack trace."""
    url = f"sqlite:///{tmp_path / 'producer.db'}"
    Outbox(sa.create_engine(url)).create_tables()
    with pytest.raises(WireUnreachableError, match=r"no Kafka broker answers at 127\.0\.0\.1:1 "):
        audit(url, out_dir=tmp_path / "audit", wire=Wire("127.0.0.1:1"))
