"""Statements run again and again while a table is empty must not keep a plan for a table of no rows.

A table with no page whose pg_class.reltuples is 0 (VACUUM after every row was deleted, or
TRUNCATE then ANALYZE) is "clearly empty" to PostgreSQL's planner whatever its statistics say.
psycopg prepares a statement it has run five times on a connection, and PostgreSQL may then keep
a generic plan (after five more runs) until the table's statistics next change (autovacuum's
ANALYZE): a plan made while the table was clearly empty is one for a table of no rows, a Seq Scan
where an index probe belongs, and it stays in use while a burst fills the table.
``test_relay_plans.test_a_fetch_run_on_an_emptied_table_reads_a_batch_after_a_burst`` proved it of
the relay's keeping-up fetch (fixed: planned each run). These tests try the other statements the
product runs repeatedly on a table that is often empty, each as the product runs it on one
connection (an engine of one pooled connection): 12 runs on the emptied table, a burst committed
from another connection, then the next run's buffers read from ``auto_explain`` (a NOTICE).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from _plans import emptied, explained, explained_plans, insert_outbox_rows
from _relay_helpers import ScriptedTransport
from inbox_support import record

from outbox import Inbox, Outbox, Relay, create_engine

pytestmark = pytest.mark.postgres

BURST = 20_000
RUNS = 12
"""Past psycopg's five runs (prepared) and PostgreSQL's five custom plans (generic kept)."""
BUFFERS_PER_ROW = 8
"""An index probe touches a few pages per row it finds (or per probe that finds none); a plan
for a table of no rows reads the whole table (hundreds of pages here) each run."""



@pytest.fixture
def one_connection(pg: sa.Engine) -> Iterator[sa.Engine]:
    """An engine of one pooled connection on ``pg``'s database: every run of the product's code
    runs on the same session, as a relay's or an inbox's steady state does (a pool's connections
    each keep their own prepared statements)."""
    engine = create_engine(pg.url.render_as_string(hide_password=False), pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()  # auto_explain stays loaded in that session: closed, not given to anyone


# -- the relay --------------------------------------------------------------------------------


@pytest.mark.parametrize("probe", [False, True], ids=["after-fetch", "probe"])
@pytest.mark.parametrize("truncate", [False, True], ids=["vacuumed", "truncated"])
def test_an_idle_look_ahead_run_on_an_emptied_table_reads_its_index_not_the_table_after_a_burst(
        pg: sa.Engine, one_connection: sa.Engine, truncate: bool, probe: bool) -> None:
    """A fleet's idle poll (``RelayStep.run(look_ahead=True)``) reads, on its empty fetch's
    connection, the next delayed row and whether any row is retried (``RelayStatements.look_ahead``):
    every poll of a quiet tenant's hour, in autocommit, so psycopg prepares it. Its condition
    repeats ix_outbox_key_waits' predicate so that it reads that tiny index; a plan kept from the
    emptied table reads the whole table instead, at every idle poll after a burst was sent, until
    autovacuum next ANALYZEs (seen: a Seq Scan, 870 buffers a poll for 20,000 published rows; 35
    when planned each run). The same of a poll's probe (``probe=True``), which asks it before any
    fetch with whether a row is due: both read indexes only."""
    outbox = Outbox(one_connection)
    outbox.create_tables()
    emptied(pg, "outbox_messages", lambda conn: insert_outbox_rows(conn, 100, "published"),
             truncate=truncate)
    relay = Relay(outbox, ScriptedTransport(), worker_id="w", batch_size=62)
    try:
        step = relay._step
        for _ in range(RUNS):  # a quiet tenant's idle polls
            assert step.run(look_ahead=True, probe=probe).batch.fetched == 0
        with pg.begin() as writer:  # a burst, sent (published) faster than autovacuum ANALYZEs
            insert_outbox_rows(writer, BURST, "published")
        notices = explained(one_connection)
        assert step.run(look_ahead=True, probe=probe).batch.fetched == 0
    finally:
        relay.close()
    plans = explained_plans(notices, lambda text: text.startswith("SELECT min(CASE"))
    assert len(plans) == 1, notices
    (buffers, rows), = plans
    assert rows == 1
    # No row is delayed or retried: planned each run, it probes an index per owned shard, a page
    # or two each (35 buffers seen for 16 shards), however many published rows the table holds.
    assert buffers <= BUFFERS_PER_ROW * outbox.shards, f"{buffers} buffers for an idle poll finding nothing"


def test_a_poll_run_on_an_emptied_table_reads_the_delayed_rows_not_the_table_after_a_burst(
        pg: sa.Engine) -> None:
    """``RelayStep.poll_within`` asks for the next delayed row (``RelayStatements.next_delayed``)
    every poll not read ahead, on a connection of its own that it gives back without a commit: the
    pool's reset is a ROLLBACK, at which psycopg forgets its prepared statements, so on a default
    engine the statement is planned afresh (35 buffers). An application may make its engine
    AUTOCOMMIT: there was then no transaction to roll back, the statement was prepared, and a plan
    kept from the emptied table read the whole table at every poll after a burst was sent (seen: a
    Seq Scan, 870 buffers for 20,000 rows). (A worker's connection is out of autocommit there now,
    ``worker_engine``; the statement is planned at every run either way, ``PLANNED_EACH_RUN``.)"""
    engine = create_engine(pg.url.render_as_string(hide_password=False), pool_size=1, max_overflow=0,
                           isolation_level="AUTOCOMMIT")
    try:
        outbox = Outbox(engine)
        outbox.create_tables()
        emptied(pg, "outbox_messages", lambda conn: insert_outbox_rows(conn, 100, "published"))
        relay = Relay(outbox, ScriptedTransport(), worker_id="w", batch_size=62)
        try:
            step = relay._step
            for _ in range(RUNS):  # a quiet relay's polls
                assert step.run().batch.fetched == 0
                step.poll_within()
            with pg.begin() as writer:  # a burst, sent (published) faster than autovacuum ANALYZEs
                insert_outbox_rows(writer, BURST, "published")
            assert step.run().batch.fetched == 0
            notices = explained(engine)
            step.poll_within()
        finally:
            relay.close()
    finally:
        engine.dispose()
    plans = explained_plans(notices, lambda text: text.startswith("SELECT min(outbox_messages.available_at)"))
    assert len(plans) == 1, notices
    (buffers, rows), = plans
    assert rows == 1
    assert buffers <= BUFFERS_PER_ROW * outbox.shards, f"{buffers} buffers for a poll finding nothing"


@pytest.mark.parametrize("truncate", [False, True], ids=["vacuumed", "truncated"])
def test_marking_a_batch_after_a_trickle_into_an_emptied_table_reads_its_rows_after_a_burst(
        pg: sa.Engine, one_connection: sa.Engine, truncate: bool) -> None:
    """A quiet hour after retention emptied the table and VACUUM cut it to no page: single
    messages trickle in, and each batch marks its one row published (``_build_mark``'s fenced
    UPDATE ... FROM unnest(...)), in a transaction that commits, so psycopg prepares it. Planned
    on a table of one page, a Seq Scan of it hashed is cheapest, and the plan is kept: once a
    burst arrives each batch's mark reads the whole table to find its rows (seen: 995 buffers for
    62 rows of 20,000, 187 when planned each run), until autovacuum next ANALYZEs."""
    outbox = Outbox(one_connection)
    outbox.create_tables()
    emptied(pg, "outbox_messages", lambda conn: insert_outbox_rows(conn, 100, "published"),
             truncate=truncate)
    limit = 62
    relay = Relay(outbox, ScriptedTransport(), worker_id="w", batch_size=limit)
    try:
        assert relay.run_once().published == 0  # takes the leases
        for _ in range(RUNS):  # the trickle: a message, a batch of one
            with pg.begin() as writer:
                insert_outbox_rows(writer, 1, "pending")
            assert relay.run_once().published == 1
        with pg.begin() as writer:
            insert_outbox_rows(writer, BURST, "pending")
        notices = explained(one_connection)
        assert relay.run_once().published == limit
    finally:
        relay.close()
    plans = explained_plans(notices, lambda text: text.startswith("UPDATE outbox_messages SET attempts")
                   and "published_at" in text)
    assert len(plans) == 1, notices
    (buffers, rows), = plans
    assert rows == limit  # every row found pending under a held lease
    assert buffers <= BUFFERS_PER_ROW * limit, f"{buffers} buffers to mark {rows} rows"


# -- the inbox --------------------------------------------------------------------------------

_STORED = ("gen_random_uuid(), 'orders', 'h' || g, 5, convert_to(repeat('x', 200), 'UTF8'), "
           "'application/json', '{}', now(), 0, g, NULL, NULL")


def _held_rows(conn: sa.Connection, n: int) -> None:
    """``n`` messages held behind a gap, one key each (not the keys the test handles)."""
    conn.execute(sa.text(
        "INSERT INTO inbox_held (consumer_group, message_id, topic, key, seq, payload, content_type, "
        f"headers, created_at, kafka_partition, kafka_offset, incarnation, event_type, received_at) "
        f"SELECT 'billing', {_STORED}, now() FROM generate_series(1, :n) g"), {"n": n})


def _key_rows(conn: sa.Connection, n: int) -> None:
    """``n`` keys the group has applied messages of (not the keys the test handles)."""
    conn.execute(sa.text(
        "INSERT INTO inbox_keys (consumer_group, topic, key, last_seq, parked) "
        "SELECT 'billing', 'orders', 'h' || g, 1, false FROM generate_series(1, :n) g"), {"n": n})


def _inbox(engine: sa.Engine) -> Inbox:
    box = Inbox(engine, group="billing", concurrency=1, gap_timeout=3600)
    box.create_tables()
    box.handler("orders")(lambda session, message: None)
    return box


def _in_order(box: Inbox, i: int) -> None:
    box.handle(record("orders", "a", i))  # applied: its successors looked up in inbox_held


def _out_of_order(box: Inbox, i: int) -> None:
    box.handle(record("orders", f"gap{i}", 2))  # held (seq 1 missing): its seq's holder looked up


def _gap_filled(box: Inbox, i: int) -> None:
    box.handle(record("orders", f"gap{i}", 2))  # held
    box.handle(record("orders", f"gap{i}", 1))  # applied, then seq 2 from inbox_held, its row deleted


_SUCCESSORS = ("successors", _in_order, lambda text: "FROM inbox_held" in text and "successor." in text)
_HOLDER = ("holder", _out_of_order, lambda text: text.startswith("SELECT inbox_held.consumer_group")
           and "inbox_held.seq =" in text)
_REMOVE = ("remove", _gap_filled, lambda text: text.startswith("DELETE FROM inbox_held"))


@pytest.mark.parametrize("truncate", [False, True], ids=["vacuumed", "truncated"])
@pytest.mark.parametrize(("what", "run", "marker"), [_SUCCESSORS, _HOLDER, _REMOVE],
                         ids=["successors", "holder", "remove"])
def test_an_inbox_run_on_an_emptied_held_table_probes_its_keys_not_the_table_after_a_burst(
        pg: sa.Engine, one_connection: sa.Engine, what: str, run: Callable[[Inbox, int], None],
        marker: Callable[[str], bool], truncate: bool) -> None:
    """``inbox_held`` is empty but for gaps: rows come and go, so autovacuum cuts it to no page.
    Every message applied looks up its key's held successors (``PostgresHeld._successors``, a
    LATERAL probe of ux_inbox_held_seq per key, "a plan that does not depend on table statistics"),
    every message held looks up its seq's holder (``HeldTable.hold``), and a held message applied
    is deleted by its id (``HeldTable.remove``); all in transactions that commit, so psycopg
    prepares them. A plan kept from the emptied table reads the whole held
    table instead (a Hash Join over a Seq Scan; a Seq Scan), once per batch or per held message,
    while a burst of out-of-order messages waits there (seen: 834 buffers for 20,000 held rows,
    where a probe reads 3)."""
    box = _inbox(one_connection)
    emptied(pg, "inbox_held", lambda conn: _held_rows(conn, 100), truncate=truncate)
    for i in range(1, RUNS + 1):
        run(box, i)
    with pg.begin() as writer:  # a burst of messages held behind gaps
        _held_rows(writer, BURST)
    notices = explained(one_connection)
    run(box, RUNS + 1)
    plans = explained_plans(notices, marker)
    assert len(plans) == 1, (what, notices)
    (buffers, rows), = plans
    assert rows <= 1
    assert buffers <= BUFFERS_PER_ROW, f"{what}: {buffers} buffers for {rows} row(s) of one key"


@pytest.mark.parametrize("truncate", [False, True], ids=["vacuumed", "truncated"])
def test_an_inbox_run_on_an_emptied_keys_table_locks_its_keys_not_the_table_after_a_burst(
        pg: sa.Engine, one_connection: sa.Engine, truncate: bool) -> None:
    """Every batch locks its keys' rows (``PostgresKeys._lock``: a LATERAL probe of the primary key
    per key, ``FOR UPDATE``), in transactions that commit. Should ``inbox_keys`` be clearly empty
    while the inbox runs (a maintenance job's VACUUM ANALYZE of the new, empty tables; keys
    deleted by an operator), a plan kept from then reads all of ``inbox_keys`` per key of every
    batch once keys pour in (seen: a Seq Scan, 189 buffers per key for 20,000 keys, where the
    probe reads 2 to 4)."""
    box = _inbox(one_connection)
    emptied(pg, "inbox_keys", lambda conn: _key_rows(conn, 100), truncate=truncate)
    for i in range(1, RUNS + 1):
        _in_order(box, i)
    with pg.begin() as writer:
        _key_rows(writer, BURST)
    notices = explained(one_connection)
    _in_order(box, RUNS + 1)
    plans = explained_plans(notices, lambda text: "FROM inbox_keys" in text and "FOR UPDATE" in text)
    assert plans, notices
    for buffers, rows in plans:
        assert rows <= 1
        assert buffers <= BUFFERS_PER_ROW, f"{buffers} buffers to lock {rows} key row(s)"



def test_a_table_is_emptied_once_a_snapshot_that_saw_its_rows_has_ended(pg: sa.Engine) -> None:
    """What every vacuumed case stands on: an older snapshot of the database (an autovacuum
    worker's ANALYZE of a catalog, on a loaded host) keeps VACUUM from removing the deleted rows,
    so the table keeps its page and is not "clearly empty"; ``emptied`` waits that snapshot out."""
    Inbox(pg, group="billing").create_tables()
    ending: list[float] = []
    with pg.connect() as reader:
        reader.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        reader.execute(sa.text("SELECT 1")).one()  # its snapshot, taken before the DELETE

        def end_the_snapshot() -> None:
            time.sleep(1.0)  # the length of the old snapshot, not a synchronisation
            ending.append(time.monotonic())
            reader.rollback()

        ender = threading.Thread(target=end_the_snapshot)
        ender.start()
        emptied(pg, "inbox_keys", lambda conn: _key_rows(conn, 100))
        done = time.monotonic()
        ender.join()
    assert done > ending[0]
