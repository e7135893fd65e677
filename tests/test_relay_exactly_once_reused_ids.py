"""Row ids are never given twice, so an exactly-once progress record never names a new row.

A shard's progress record names the rows its last transaction committed by id, and a take-over
marks the pending rows it names published without sending them (docs/relay.md, "Exactly once on
the wire"). SQLite gives a new row one more than the greatest id left in the table (its id column
has no AUTOINCREMENT), MySQL before 8.0 resets its counter so at each restart: once retention or
the Spark archive deleted the greatest ids, they were given again, and a new row of such an id was
marked published at the next take-over and never sent. Retention and the archive now keep the row
of the greatest id.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from _relay_helpers import drain, publish, rows

from outbox import Outbox, Relay, create_engine
from outbox.housekeeping import run_retention
from transports.kafka import KafkaTransport
from transports.testing import read_topic

MESSAGE_ID = "outbox-message-id"


def drained(outbox: Outbox, kafka: str, progress_topic: str, worker_id: str) -> None:
    """An exactly-once relay named ``worker_id`` takes the shard over, sends what is pending and stops."""
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka), exactly_once=True,
                  progress_topic=progress_topic, worker_id=worker_id)
    drain(relay)
    relay.close()


def test_rows_after_a_retention_that_emptied_the_table_are_sent_after_a_take_over(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str) -> None:
    """Three rows sent in one transaction (the shard's last progress names their ids), all deleted by
    retention, three new rows, and a relay that takes the shard over: the three new rows reach the
    broker. Before, they took the ids 1-3 again and were marked published unsent."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    publish(outbox, topic, ["a", "b", "c"])
    drained(outbox, kafka, progress_topic, "first")
    gone = run_retention(outbox, older_than=timedelta(days=1), now=datetime.now(UTC) + timedelta(days=2),
                         duty=1.0)
    publish(outbox, topic, ["d", "e", "f"])
    drained(outbox, kafka, progress_topic, "second")
    on_wire = read_topic(kafka, topic, expected=6, settle=1.0, isolation="read_committed")
    assert sorted(r.key for r in on_wire) == [b"a", b"b", b"c", b"d", b"e", b"f"]
    assert gone.deleted[outbox.tables.messages.name] == 2  # the newest row stays
    m = outbox.tables.messages
    with engine.connect() as conn:
        assert conn.execute(sa.select(m.c.id).order_by(m.c.id)).scalars().all() == [3, 4, 5, 6]
    assert {r.status for r in rows(outbox)} == {"published"}
    engine.dispose()


def test_a_new_row_given_an_id_the_last_progress_record_names_is_sent_after_a_take_over(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str) -> None:
    """Rows deleted by hand (not by retention, which keeps the newest), and SQLite gives their ids to
    new messages: the shard's last progress record names ids 1-3 with the messages sent under them,
    the table holds other messages under those ids, and a take-over sends them. Before the record
    named each row's message the take-over marked them published unsent."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    publish(outbox, topic, ["a", "b", "c"])
    drained(outbox, kafka, progress_topic, "first")
    with engine.begin() as conn:
        conn.execute(sa.delete(outbox.tables.messages))
    publish(outbox, topic, ["d", "e", "f"])
    assert [r.id for r in rows(outbox)] == [1, 2, 3]  # the ids the last progress record names
    drained(outbox, kafka, progress_topic, "second")
    on_wire = read_topic(kafka, topic, expected=6, settle=1.0, isolation="read_committed")
    assert sorted(r.key for r in on_wire) == [b"a", b"b", b"c", b"d", b"e", b"f"]
    assert {r.status for r in rows(outbox)} == {"published"}
    engine.dispose()
