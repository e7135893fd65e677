"""Rows written behind publish()'s back never stall the relay: each fails alone, every other key flows.

The bad rows are written with SQL (an older release, a script, a bug could), on
SQLite, PostgreSQL and MariaDB, and sent by a real relay loop to the mock Kafka
cluster: every good row is published in order, each bad row is failed with a
reason naming what is wrong and alerted once, its key waits, and the loop
never logs a batch-level failure.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import publish, rows, seqs_by_key, wait_for

from outbox import Alert, Outbox, Relay
from outbox.core._sharding import shard_for_key
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

ALL = frozenset({"sqlite", "postgresql", "mysql"})
LOOSE = frozenset({"sqlite"})
"""SQLite stores whatever a statement gives it; the servers refuse wrong types and lengths."""
NOT_MARIADB = frozenset({"sqlite", "postgresql"})


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    return proof_db_url


@dataclass(frozen=True)
class Bad:
    """A row publish() would never write, and the words its failure must name."""

    name: str
    reason: str
    dialects: frozenset[str] = ALL
    columns: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, str] = field(default_factory=dict)
    """Column -> SQL expression, for values no driver would bind (bytes that are not UTF-8)."""


def headers(text: str, reason: str, dialects: frozenset[str] = ALL) -> Bad:
    return Bad(f"headers {text}", reason, dialects, {"headers": text})


CASES = [
    # MariaDB's JSON check refuses a lone surrogate's escape; PostgreSQL's json type keeps it.
    headers('{"h": "v\\ud800"}', "header 'h' is not valid utf-8", NOT_MARIADB),
    headers('{"h\\ud800": "v"}', "header name is not valid utf-8", NOT_MARIADB),
    VICTIM := headers('{"h": 1}', "header 'h' must be text, got int"),
    headers('{"h": null}', "header 'h' must be text, got nonetype"),
    headers('{"h": {"a": "b"}}', "header 'h' must be text, got dict"),
    headers('["a", "b"]', "json object of text, got a list"),
    headers('"text"', "json object of text, got a str"),
    headers('{"": "v"}', "empty or has a nul"),
    headers('{"a\\u0000b": "v"}', "empty or has a nul"),
    headers('{"outbox-seq": "9"}', "reserved for the outbox envelope"),
    # The take-over's message check reads the header named exactly so: a row may not carry another.
    headers('{"Outbox-Message-Id": "0192ab53-7e1c-7a3e-9c1a-5f2e8d4b6a01"}',
            "reserved for the outbox envelope"),
    headers('{"Content-Type": "x"}', "reserved for the outbox envelope"),
    headers("{not json", "not valid json", LOOSE),
    Bad("empty key", "key must be 1-255 characters", columns={"key": ""}),
    Bad("key with NUL", "key must be 1-255 characters", frozenset({"sqlite", "mysql"}),
        {"key": "a\x00b"}),
    Bad("long key", "key must be 1-255 characters", LOOSE, {"key": "k" * 256}),
    Bad("key not UTF-8", "cannot be read", LOOSE, raw={"key": "CAST(x'6beda080' AS TEXT)"}),
    # MySQL's seq trigger numbers a keyed row that comes without one.
    Bad("keyed, no seq", "keyed row has seq none", NOT_MARIADB, {"seq": None}),
    Bad("keyed, seq 0", "row has seq 0, outside", columns={"seq": 0}),
    Bad("content type not ASCII", "content_type must be", columns={"content_type": "tëxt/plain"}),
    Bad("empty content type", "content_type must be", columns={"content_type": ""}),
    Bad("long content type", "content_type must be", LOOSE, {"content_type": "a/" + "b" * 120}),
    Bad("topic with a space", "invalid topic", columns={"topic": "bad topic"}),
    Bad("topic not ASCII", "invalid topic", columns={"topic": "tópico"}),
    Bad("long topic", "invalid topic", LOOSE, {"topic": "t" * 250}),
    Bad("topic not UTF-8", "cannot be read", LOOSE, raw={"topic": "CAST(x'74eda080' AS TEXT)"}),
    Bad("payload as text", "payload is str", LOOSE, raw={"payload": "'text'"}),
    Bad("created_at not a time", "cannot be read", LOOSE, raw={"created_at": "'garbage'"}),
    Bad("message id not a UUID", "cannot be read", LOOSE, raw={"message_id": "'zz'"}),
    # MariaDB's CHAR(32) id is dashed by the fetch whatever it holds: sent, every inbox would
    # park it as a broken envelope while the relay counted it published.
    Bad("message id 32 characters, not hex", "is not a uuid", frozenset({"mysql"}),
        raw={"message_id": "'" + "z" * 32 + "'"}),
    Bad("created_at infinity", "cannot be read", frozenset({"postgresql"}),
        raw={"created_at": "'infinity'"}),
    Bad("over message.max.bytes", "too large", columns={"payload": b"x" * 1_040_000}),
]


def insert_row(outbox: Outbox, topic: str, key: str | None, bad: Bad) -> int:
    """Write one pending row with SQL, bumping outbox_keys as publish() would; returns its id."""
    tables, engine = outbox.tables, outbox.engine
    assert isinstance(engine, sa.Engine)
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "message_id": uuid.uuid4(), "topic": topic, "key": key, "seq": 1 if key is not None else None,
        "shard": shard_for_key(key, outbox.shards), "payload": b"{}",
        "content_type": "application/json", "created_at": now, "available_at": now,
        "attempts": 0, "status": "pending", **bad.columns,
    }
    text = values.pop("headers", "{}")
    json_text: Any = sa.bindparam("headers_text", text, type_=sa.Text)
    if engine.dialect.name == "postgresql":
        json_text = sa.cast(json_text, sa.dialects.postgresql.JSON)
    insert = sa.insert(tables.messages).values(
        headers=json_text, **{name: sa.literal_column(sql) for name, sql in bad.raw.items()})
    with engine.begin() as conn:
        row_id = conn.execute(insert, {k: v for k, v in values.items() if k not in bad.raw}
                              ).inserted_primary_key[0]
        if values["key"] is not None and "key" not in bad.raw:
            conn.execute(sa.insert(tables.keys).values(topic=values["topic"], key=values["key"],
                                                       last_seq=values["seq"] or 0))
    return row_id


def outcomes(outbox: Outbox) -> dict[int, tuple[str, str | None]]:
    """Row id -> (status, last_error): the only columns every bad row can be read back by."""
    m, engine = outbox.tables.messages, outbox.engine
    assert isinstance(engine, sa.Engine)
    with engine.connect() as conn:
        return {row.id: (row.status, row.last_error)
                for row in conn.execute(sa.select(m.c.id, m.c.status, m.c.last_error))}


def count(outbox: Outbox, status: str) -> int:
    return sum(1 for state, _ in outcomes(outbox).values() if state == status)


def wait_for_or_none(condition: Any, timeout: float) -> Any:
    try:
        return wait_for(condition, timeout, "the relay")
    except AssertionError:
        return None


def test_bad_rows_fail_alone_while_every_other_key_flows(
    outbox: Outbox, kafka: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    dialect = "mysql" if outbox.engine.dialect.name == "mariadb" else outbox.engine.dialect.name
    cases = [bad for bad in CASES if dialect in bad.dialects]
    good_keys = [f"g{i % 40}" for i in range(200)]
    bad_ids: dict[int, Bad] = {}
    for n, bad in enumerate(cases):  # interleaved: bad rows fall into many batches
        publish(outbox, topic, good_keys[n * 5:(n + 1) * 5])
        bad_topic = bad.columns.get("topic", topic)
        bad_ids[insert_row(outbox, bad_topic, f"bad{n}", bad)] = bad
    publish(outbox, topic, good_keys[len(cases) * 5:])
    # A bad head holds its key: the good row behind it waits for an operator.
    victim = insert_row(outbox, topic, "victim", VICTIM)
    bad_ids[victim] = VICTIM
    behind = publish(outbox, topic, ["victim"])[0]

    alerts: list[Alert] = []
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka), alert=alerts.append,
                  batch_size=25, poll_interval=0.05)
    caplog.set_level(logging.WARNING, logger="outbox")
    runner = threading.Thread(target=relay.run, name="relay-under-test")
    runner.start()
    done = False
    try:
        done = bool(wait_for_or_none(
            lambda: count(outbox, "published") == len(good_keys)
            and count(outbox, "failed") == len(bad_ids), 30))
    finally:
        relay.stop()
        runner.join(30)
    assert not runner.is_alive()
    final = outcomes(outbox)
    assert done, {row_id: state for row_id, state in final.items() if state[0] != "published"}

    failed = {row_id: error for row_id, (state, error) in final.items() if state == "failed"}
    assert set(failed) == set(bad_ids)
    for row_id, bad in bad_ids.items():
        assert bad.reason in (failed[row_id] or "").lower(), (bad.name, failed[row_id])
    assert sorted(a.details["id"] for a in alerts) == sorted(bad_ids)
    assert {a.kind for a in alerts} == {"message_failed"}
    assert [r.status for r in rows(outbox, message_id=behind)] == ["pending"]  # its key waits
    records = read_topic(kafka, topic, expected=len(good_keys))
    expected = {f"g{k}".encode(): list(range(1, 6)) for k in range(40)}
    assert seqs_by_key(records) == expected
    assert not [r for r in caplog.records if r.name.startswith("outbox.relay")
                and r.levelno >= logging.ERROR], caplog.text
