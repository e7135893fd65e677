"""PostgreSQL: the unlocked retention batch under inputs its first proofs did not list."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa
from _retention_rows import NOW, OLD, filled, outbox_row, passes_at_once

from outbox import create_engine
from outbox.housekeeping import run_retention

pytestmark = pytest.mark.postgres

def _within(seconds: float, call):
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as exc:
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else None


@pytest.mark.parametrize("level", ["AUTOCOMMIT", "REPEATABLE READ", "SERIALIZABLE"])
def test_a_held_row_is_passed_over_at_any_isolation_level_of_the_callers_engine(postgres_db: str,
                                                                                 level: str) -> None:
    """``run_retention`` takes the application's engine as it is: its isolation level must not
    turn "waits at most UNLOCKED_WAIT" into "waits for as long as the holder holds". On an
    AUTOCOMMIT engine the batch's ``SET LOCAL lock_timeout`` was a no-op outside a transaction
    block and the pass waited for the held row until its holder let go (seen: still waiting
    after 20 s before a worker's engine took its connections out of autocommit, ``worker_engine``)."""
    engine = create_engine(postgres_db, isolation_level=level)
    outbox, ids = filled(create_engine(postgres_db), 50)
    holder = outbox.engine.connect()
    holder.begin()
    holder.execute(sa.text("SELECT id FROM outbox_messages WHERE id = :id FOR UPDATE"), {"id": ids[10]})
    try:
        started = time.monotonic()
        outcome = _within(20, lambda: run_retention(engine, older_than="7d", now=NOW, duty=1.0,
                                                    batch_size=20))
        took = time.monotonic() - started
    finally:
        holder.rollback()
        holder.close()
    try:
        assert outcome is not None, f"the pass still waited for the held row after {took:.0f} s"
        kind, result = outcome
        assert kind == "ok", result
        assert result.deleted == {"outbox_messages": 49}, result.deleted
        with engine.connect() as conn:  # the application's connections keep their own level
            assert conn.connection.dbapi_connection.autocommit == (level == "AUTOCOMMIT")
    finally:
        engine.dispose()
        outbox.engine.dispose()


def test_an_engine_with_a_schema_translate_map_deletes_in_its_schema_only(postgres_db: str) -> None:
    base = create_engine(postgres_db)
    with base.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA tenant_a"))
    filled(base, 5)
    tenant = base.execution_options(schema_translate_map={None: "tenant_a"})
    filled(tenant, 7)
    result = run_retention(tenant, older_than="7d", now=NOW, duty=1.0, batch_size=3)
    assert result.deleted == {"outbox_messages": 7}
    with base.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM public.outbox_messages")).scalar_one() == 5
        assert conn.execute(sa.text("SELECT count(*) FROM tenant_a.outbox_messages")).scalar_one() == 0
    base.dispose()


@pytest.mark.parametrize("size", [1, 2, 100_000])
def test_batch_size_edges_delete_exactly_the_settled_rows(postgres_db: str, size: int) -> None:
    outbox, ids = filled(create_engine(postgres_db), 9)
    with outbox.engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages), [
            outbox_row("pending", OLD), outbox_row("failed", OLD), outbox_row("skipped", OLD),
            outbox_row("published", NOW - timedelta(days=1))])
        conn.execute(sa.text("UPDATE outbox_messages SET status = 'pending' WHERE id = :id"), {"id": ids[4]})
    result = run_retention(outbox, older_than="7d", now=NOW, duty=1.0, batch_size=size)
    with outbox.engine.connect() as conn:
        left = sorted(conn.execute(sa.text("SELECT status FROM outbox_messages")).scalars())
    outbox.engine.dispose()
    assert result.deleted == {"outbox_messages": 8}
    assert left == ["failed", "pending", "pending", "published", "skipped"], left


def test_three_passes_with_a_held_row_between_them_count_every_row_once(postgres_db: str) -> None:
    """Passes at once, one row held throughout (each pass falls back to the locking pick at its
    batch), small batches so that unlocked and locked batches of different passes interleave:
    every other row is deleted and counted exactly once; the held row stays."""
    outbox, ids = filled(create_engine(postgres_db), 600)
    holder = outbox.engine.connect()
    holder.begin()
    holder.execute(sa.text("SELECT id FROM outbox_messages WHERE id = :id FOR UPDATE"), {"id": ids[300]})
    try:
        results = passes_at_once(outbox, 3, batch_size=7)
    finally:
        holder.rollback()
        holder.close()
    with outbox.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id FROM outbox_messages")).scalars().all()
    outbox.engine.dispose()
    assert len(results) == 3 and sum(results) == 599 and left == [ids[300]], (results, left)
