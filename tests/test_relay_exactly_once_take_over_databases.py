"""An exactly-once take-over's message check on each database, on Apache Kafka.

A take-over marks a row its last progress record names only where the database's row of that id holds
the message the record names (``_progress.message_tag`` of the ids both sides read). Each database reads
its message ids its own way (PostgreSQL's uuid as text, SQLite's 32 hex digits through the driver,
MySQL/MariaDB's CHAR(32) dashed in the statement), and a tag that differed between the record and the
database would send every committed row again after each take-over: exactly-once silently lost.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import drain, killed_after_its_commit, publish, rows, wait_for
from prometheus_client import CollectorRegistry

from outbox import CloudEvents, Outbox, Relay, create_engine, relay_metrics
from outbox.testing import LocalPostgres
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

ROWS = 1_201
"""More rows than three of the take-over's message queries take (500 ids a statement)."""



def relay(outbox: Outbox, kafka: str, progress_topic: str, worker_id: str, **options: Any) -> Relay:
    return Relay(outbox, KafkaTransport(bootstrap_servers=kafka), exactly_once=True, batch_size=ROWS,
                 progress_topic=progress_topic, lease_ttl=1.0, worker_id=worker_id, **options)



def copies_on_the_wire(kafka: str, topic: str, expected: int) -> Counter[uuid.UUID]:
    """How many times each message is on ``topic`` for a read_committed reader (ids in any form)."""
    on_wire = read_topic(kafka, topic, expected=expected, settle=2.0, isolation="read_committed")
    return Counter(uuid.UUID(dict(r.headers)["outbox-message-id"].decode()) for r in on_wire)


def crashed_and_taken_over(url: str, kafka: str, topic: str, progress_topic: str,
                           monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                           **options: Any) -> None:
    """A relay commits a batch of ``ROWS`` rows and dies before its mark; the next relay takes the shard
    over (its record read, three message queries): each message on the wire once, none taken for
    another database's."""
    engine = create_engine(url)
    outbox = Outbox(engine, shards=1)  # one shard: one progress record names the whole batch
    outbox.create_tables()
    publish(outbox, topic, [None] * ROWS)
    if engine.dialect.name != "postgresql":  # uuid there: no case
        m = outbox.tables.messages
        with engine.begin() as conn:
            conn.execute(sa.update(m).values(message_id=sa.func.upper(m.c.message_id)))
    killed_after_its_commit(relay(outbox, kafka, progress_topic, "first", **options), monkeypatch)
    assert len(rows(outbox, status="pending")) == ROWS

    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        second = relay(outbox, kafka, progress_topic, "second", **options)
        drain(second, timeout=60)
        second.close()
    messages = {uuid.UUID(str(r.message_id)) for r in rows(outbox)}
    engine.dispose()

    copies = copies_on_the_wire(kafka, topic, ROWS)
    assert len(messages) == ROWS
    assert copies == Counter(dict.fromkeys(messages, 1)), \
        f"{sum(copies.values()) - ROWS} rows sent twice after the take-over"
    assert not [line for line in caplog.messages if "--new-incarnation" in line], caplog.messages


def test_a_take_over_marks_every_row_its_crashed_owner_committed_on_each_database(
        proof_db_url: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The rows' ids stored in upper case where the column is text (rows written by hand or another
    tool: MySQL's CHAR(32), SQLite's): the record's tags and the database's are of one id whatever its
    form."""
    crashed_and_taken_over(proof_db_url, kafka, topic, progress_topic, monkeypatch, caplog)


def test_a_take_over_in_cloudevents_mode_marks_every_row_its_crashed_owner_committed(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """CloudEvents binary mode keeps the ``outbox-message-id`` header the tags are read from: without
    it every tag would be unknown and every committed row sent again."""
    crashed_and_taken_over(sqlite_db, kafka, topic, progress_topic, monkeypatch, caplog,
                           cloudevents=CloudEvents())

def lines(caplog: pytest.LogCaptureFixture, worker: str, text: str) -> int:
    return sum(1 for r in caplog.records if f"relay {worker}:" in r.getMessage() and text in r.getMessage())


@pytest.mark.slow  # a server of its own, stopped and started
def test_a_database_outage_during_the_take_overs_message_query_is_one_outage_and_the_take_over_resumes(
        own_postgres: LocalPostgres, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A relay commits rows 1-3 and dies before its mark. The next relay's take-over reads the record
    and asks the database for the rows' messages: the database goes down under that query (stopped
    there, a real outage). One outage, told once each way and counted once, no row's attempt counted;
    once it is back the take-over is made again and marks rows 1-3: each message on the wire once."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    publish(outbox, topic, ["k1", "k2", "k3"])
    killed_after_its_commit(relay(outbox, kafka, progress_topic, "first"), monkeypatch)

    second = relay(outbox, kafka, progress_topic, "second", poll_interval=0.1,
                   metrics=relay_metrics(CollectorRegistry()))
    sql = second._step._batch.sql
    real_messages = sql.messages
    asked, gone = threading.Event(), threading.Event()

    def down_under_the_query(conn: Any, ids: Any) -> Any:
        if not asked.is_set():  # the first query waits for the database to go (the test's thread
            asked.set()  # stops it: stopped from this thread, pg_ctl stop -w hung once in four runs)
            gone.wait(30)
        return real_messages(conn, ids)

    monkeypatch.setattr(sql, "messages", down_under_the_query)
    thread = threading.Thread(target=second.run, daemon=True)
    thread.start()
    try:
        wait_for(asked.is_set, 30, "the take-over's message query")
        own_postgres.stop()
        gone.set()
        wait_for(lambda: lines(caplog, "second", "database unreachable") > 0, 30, "the outage seen")
        own_postgres.start()
        wait_for(lambda: not rows(outbox, status="pending"), 60, "every row published", interval=0.1)
    finally:
        second.stop()
        thread.join(30)
    assert not thread.is_alive()
    messages = {uuid.UUID(str(r.message_id)) for r in rows(outbox)}
    attempts = Counter(r.attempts for r in rows(outbox))
    engine.dispose()
    assert asked.is_set()
    assert copies_on_the_wire(kafka, topic, 3) == Counter(dict.fromkeys(messages, 1))
    assert second.metrics.outages.labels("database")._value.get() == 1
    # The take-over's own query met the outage and told it as the database's: not the broker's, not a
    # take-over failure (the next fetch would have told the database's outage anyway).
    assert second.metrics.outages.labels("broker")._value.get() == 0
    told = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and "relay second" in r.getMessage()]
    assert [m for m in told if "database unreachable" not in m and "reachable again" not in m] == [], told
    assert lines(caplog, "second", "database unreachable") == 1
    assert lines(caplog, "second", "database reachable again") == 1
    assert attempts == {1: 3}, f"attempts: {attempts}"
