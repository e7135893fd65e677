"""A mark whose commit the relay never heard of, then ids given again, on SQLite and Apache Kafka.

A running exactly-once relay keeps the rows it committed to Kafka "unmarked" until it knows their
mark committed, and a fetched row of such an id is taken as sent (marked, not sent again). A mark
whose commit's answer was lost (the database went away as it committed) leaves its rows published
and still unmarked in memory; rows then deleted by hand let SQLite give their ids to new messages,
which that relay fetched and marked published unsent, unless it compares the row's message with
the one it committed under that id (``_progress.message_tag``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import publish, rows, wait_for

from outbox import Outbox, Relay, create_engine
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka


def ids_given_again_after_an_unanswered_mark(worker: Relay, outbox: Outbox, engine: sa.Engine, topic: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker`` sends a, b, c and marks them, and its mark's commit answers with an outage (committed
    all the same: it still names them); the rows are deleted by hand and SQLite gives their ids 1-3 to
    the new messages d, e, f."""
    batch = worker._step._batch
    real_marking = batch._marking
    lost: list[bool] = []

    @contextmanager
    def answer_lost() -> Iterator[Any]:
        with real_marking() as conn:
            yield conn
        if not lost:  # committed; the relay hears an outage instead
            lost.append(True)
            raise sa.exc.OperationalError("COMMIT", None, sqlite3.OperationalError("disk I/O error"))

    monkeypatch.setattr(batch, "_marking", answer_lost)

    def step() -> bool:
        with suppress(sa.exc.OperationalError):  # the outage, as run() would wait it out
            worker.run_once()
        return bool(lost) and not rows(outbox, status="pending")

    wait_for(step, 30, "a, b, c marked, the mark's answer lost")
    with engine.begin() as conn:
        conn.execute(sa.delete(outbox.tables.messages))
    publish(outbox, topic, ["d", "e", "f"])
    assert [r.id for r in rows(outbox)] == [1, 2, 3]  # the ids the relay committed a, b, c under


def test_rows_given_the_ids_of_rows_whose_mark_went_unanswered_are_sent(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows a, b, c go out in one transaction; their mark commits and its answer is lost (an outage at
    the commit). The rows are deleted by hand and SQLite gives ids 1-3 to d, e, f: the same relay must
    send them, not take them for a, b, c."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    publish(outbox, topic, ["a", "b", "c"])
    worker = Relay(outbox, KafkaTransport(bootstrap_servers=kafka), exactly_once=True,
                   progress_topic=progress_topic, worker_id="worker", lease_ttl=5.0)
    ids_given_again_after_an_unanswered_mark(worker, outbox, engine, topic, monkeypatch)
    wait_for(lambda: (worker.run_once(), not rows(outbox, status="pending"))[1], 30, "d, e, f marked")
    worker.close()
    engine.dispose()
    on_wire = read_topic(kafka, topic, expected=6, settle=1.0, isolation="read_committed")
    assert sorted(r.key for r in on_wire) == [b"a", b"b", b"c", b"d", b"e", b"f"], \
        "d, e, f were marked published without being sent"


def test_rows_given_those_ids_are_sent_after_a_fenced_transaction_too(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, and the transaction that sends d, e, f is fenced (another producer of the shard's
    transactional id made meanwhile): the relay makes its producer again, reads its progress and
    marks the rows its shard still names (``_recover``). Those must not be d, e, f under the ids
    a, b, c went out under."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    publish(outbox, topic, ["a", "b", "c"])
    transport = KafkaTransport(bootstrap_servers=kafka)
    worker = Relay(outbox, transport, exactly_once=True,
                   progress_topic=progress_topic, worker_id="worker", lease_ttl=5.0)
    ids_given_again_after_an_unanswered_mark(worker, outbox, engine, topic, monkeypatch)
    tid = f"outbox-{outbox.load_schema().incarnation}-0"
    other = KafkaTransport(bootstrap_servers=kafka)
    fencer = other.transactional(tid, 30.0)  # fences the relay's producer of the shard
    fencer.close()
    other.close()
    wait_for(lambda: (worker.run_once(), not rows(outbox, status="pending"))[1], 30, "d, e, f marked")
    worker.close()
    engine.dispose()
    on_wire = read_topic(kafka, topic, expected=6, settle=1.0, isolation="read_committed")
    assert sorted(r.key for r in on_wire) == [b"a", b"b", b"c", b"d", b"e", b"f"], \
        "d, e, f were marked published without being sent"
