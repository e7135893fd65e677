"""PostgreSQL: retention deletes published outbox rows without locking them first, and stays correct.

A published row is final (the relay marks pending rows, an operator's actions select failed
ones), so a batch picks and deletes in one statement without a row lock
(``outbox.housekeeping._pg_batches``). These prove what that must keep: a row someone else
holds is waited for at most ``UNLOCKED_WAIT`` and then passed over; a row that stops being
published while the delete waits for it is kept; the inbox's records are still picked
``FOR UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa
from _retention_rows import NOW, filled, passes_at_once

from outbox import create_engine
from outbox.housekeeping import run_retention


def waiting_on_a_lock(engine: sa.Engine, deadline: float = 30) -> None:
    """Return once some backend waits for a row lock (a tuple or transaction lock)."""
    end = time.monotonic() + deadline
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while time.monotonic() < end:
            if conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                    "AND wait_event IN ('transactionid', 'tuple')")).scalar_one():
                return
            time.sleep(0.01)
    raise AssertionError("no backend waited for a row lock")


def test_an_outbox_pass_writes_no_row_lock(own_postgres) -> None:
    """The WAL of a pass over published rows holds deletes and no heap LOCK record: the locking
    pick wrote one per row before the delete wrote again (342 bytes of WAL a row against 286 on
    pages just checkpointed)."""
    outbox, _ = filled(create_engine(own_postgres.url), 3000)
    with outbox.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
        start = conn.execute(sa.text("SELECT pg_current_wal_insert_lsn()")).scalar_one()
        result = run_retention(outbox, older_than="7d", now=NOW, duty=1.0)
        conn.execute(sa.text("SELECT pg_switch_wal()"))  # the records up to here become readable
        # The first two columns: "Heap/DELETE" and how many (their names differ between versions).
        records = {row[0]: row[1] for row in conn.execute(sa.text(
            "SELECT * FROM pg_get_wal_stats(:start, pg_current_wal_lsn(), true)"), {"start": start})}
    outbox.engine.dispose()
    assert result.deleted == {"outbox_messages": 3000}
    assert records.get("Heap/DELETE", 0) >= 3000, records
    assert records.get("Heap/LOCK", 0) == 0, records


def test_a_row_held_by_another_transaction_is_passed_over_not_waited_for(own_postgres) -> None:
    """A published row locked by someone else's long transaction (an operator's SQL): the
    batch's delete waits ``UNLOCKED_WAIT`` for it, then the batch runs again with the locking pick
    and passes over it; everything else goes, and the next pass takes the row."""
    outbox, ids = filled(create_engine(own_postgres.url), 50)
    holder = outbox.engine.connect()
    holder.begin()
    holder.execute(sa.text("SELECT id FROM outbox_messages WHERE id = :id FOR UPDATE"), {"id": ids[10]})
    try:
        started = time.monotonic()
        result = run_retention(outbox, older_than="7d", now=NOW, duty=1.0, batch_size=20)
        took = time.monotonic() - started
    finally:
        holder.rollback()
        holder.close()
    assert result.deleted == {"outbox_messages": 49}
    assert took < 5, took
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM outbox_messages")).scalars().all() == [ids[10]]
    assert run_retention(outbox, older_than="7d", now=NOW, duty=1.0).deleted == {"outbox_messages": 1}
    outbox.engine.dispose()


def test_a_row_no_longer_published_when_the_delete_reaches_it_is_kept(own_postgres) -> None:
    """A batch picked a published row; meanwhile an operator's SQL set it back to pending and
    commits while the delete waits for it: the delete checks the row again as that transaction
    left it and keeps it (no lock before the delete must not mean a stale decision)."""
    outbox, ids = filled(create_engine(own_postgres.url), 30)
    replay = outbox.engine.connect()
    replay.begin()
    replay.execute(sa.text("UPDATE outbox_messages SET status = 'pending', published_at = NULL "
                           "WHERE id = :id"), {"id": ids[5]})
    results = []
    run = threading.Thread(target=lambda: results.append(
        run_retention(outbox, older_than="7d", now=NOW, duty=1.0, batch_size=100)))
    run.start()
    try:
        waiting_on_a_lock(outbox.engine)
    finally:
        replay.commit()
        replay.close()
    run.join(30)
    assert results and results[0].deleted == {"outbox_messages": 29}
    with outbox.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id, status FROM outbox_messages")).all()
    outbox.engine.dispose()
    assert [tuple(row) for row in left] == [(ids[5], "pending")]


def test_two_passes_at_once_delete_every_row_once(own_postgres) -> None:
    """Two passes over the same rows at once: both pick the same keys, and the later delete waits for
    the earlier one's rows and finds them gone. Every row is deleted, and counted once."""
    outbox, _ = filled(create_engine(own_postgres.url), 2000)
    results = passes_at_once(outbox, 2, batch_size=100)
    with outbox.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT count(*) FROM outbox_messages")).scalar_one()
    outbox.engine.dispose()
    assert left == 0 and sum(results) == 2000 and len(results) == 2, results


def test_the_batch_statement_picks_once_and_deletes_through_the_primary_key(own_postgres) -> None:
    """The plan behind "a batch is exactly what it picked" on a table of 20,000 settled rows: the
    pick is an InitPlan (evaluated once: a semi-join's inner side was rescanned and deleted every
    row in one statement) and the delete is an index scan of the primary key on ``id = ANY``
    (a hash join read the whole table for each batch); no sequential scan anywhere."""
    outbox, _ = filled(create_engine(own_postgres.url), 20_000)
    with outbox.engine.begin() as conn:
        conn.execute(sa.text("ANALYZE outbox_messages"))
    plans: list[str] = []

    def explained(conn, cursor, statement, parameters, context, executemany) -> None:
        # The batch's own statement and parameters, explained on its cursor just before it runs.
        if statement.lstrip().startswith("WITH") and "DELETE FROM outbox_messages" in statement and not plans:
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))

    sa.event.listen(sa.Engine, "before_cursor_execute", explained)
    try:
        result = run_retention(outbox, older_than="7d", now=NOW, duty=1.0, batch_size=1000)
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", explained)
    outbox.engine.dispose()
    assert result.deleted == {"outbox_messages": 20_000} and plans
    plan = plans[0]
    assert "InitPlan" in plan and "Seq Scan" not in plan and "Hash" not in plan, plan
    assert "Index Cond: (id = ANY" in plan and "outbox_messages_pkey" in plan, plan
