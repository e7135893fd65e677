"""Time-partitioned outbox tables on PostgreSQL: conversion keeps every row, retention drops settled
days and keeps the rest, and the retention property holds on them too."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
import test_retention
from _in_process import outbox_in_process
from _relay_helpers import ScriptedTransport, drain, publish, rows
from _retention_rows import outbox_row
from test_retention import NOW

from outbox import Outbox, Relay, create_engine
from outbox.housekeeping import maintain_partitions, partition_outbox, run_retention
from outbox.housekeeping._partitions import _open_rows, is_partitioned

pytestmark = pytest.mark.postgres
DAY = timedelta(days=1)


@pytest.fixture
def filled(postgres_db: str):
    """A partitioned outbox table with day partitions around test_retention's NOW."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    assert partition_outbox(engine, outbox.tables, now=NOW - 13 * DAY, ahead_days=14) == 0
    yield outbox
    engine.dispose()


@pytest.fixture
def prepare():
    """Remake the day partitions an earlier example's retention dropped (the tables are empty)."""
    return lambda outbox: maintain_partitions(outbox.engine, outbox.tables, NOW - 30 * DAY,
                                              now=NOW - 13 * DAY, ahead_days=14)


@pytest.mark.slow
def test_the_retention_property_holds_on_a_partitioned_table(filled: Outbox, prepare) -> None:
    """test_retention's property, its examples run on day partitions (some dropped whole)."""
    test_retention.test_retention_deletes_exactly_the_settled_rows_past_the_cutoff(
        filled=filled, prepare=prepare)


def partitions(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'outbox_messages'::regclass")).scalars())


def test_converting_keeps_every_row_and_the_relay_carries_on(postgres_db: str) -> None:
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    old = [outbox_row(status, datetime.now(UTC) - timedelta(days=age))
           for age, status in [(40, "published"), (3, "failed"), (1, "skipped"), (0, "published")]]
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages), old)
    ids = publish(outbox, "orders", ["a", "b", "a"])
    before = [tuple(r) for r in rows(outbox)]

    assert partition_outbox(engine, outbox.tables) == len(before)

    with engine.connect() as conn:
        assert is_partitioned(conn, outbox.tables.messages)
    assert [tuple(r) for r in rows(outbox)] == before  # every column of every row
    assert partition_outbox(engine, outbox.tables) is None  # a second run changes nothing
    more = publish(outbox, "orders", ["a", "c"])
    after = rows(outbox)
    assert [r.id for r in after][-2:] > [r.id for r in after][:-2]  # the sequence carries on
    assert [r.seq for r in after if r.message_id in more] == [3, 1]  # and so do the keys' seqs
    outbox.load_schema()
    transport = ScriptedTransport()
    drain(Relay(outbox, transport))
    assert {r.message_id: r.status for r in rows(outbox)}.keys() >= set(ids + more)
    assert all(r.status == "published" for r in rows(outbox) if r.message_id in ids + more)
    engine.dispose()


def test_retention_drops_a_settled_day_and_keeps_a_day_with_a_pending_row(postgres_db: str) -> None:
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    partition_outbox(engine, outbox.tables, now=today - 20 * DAY, ahead_days=25)
    settled_day, open_day = today - 15 * DAY, today - 14 * DAY
    pending = outbox_row("pending", open_day + timedelta(hours=3))
    pending["available_at"] = today + 30 * DAY  # delayed: still pending when retention runs
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages), [
            *[outbox_row("published", settled_day + timedelta(minutes=m)) for m in range(500)],
            *[outbox_row("published", open_day + timedelta(minutes=m)) for m in range(300)], pending,
            *[outbox_row("published", today + timedelta(minutes=m)) for m in range(10)]])

    result = run_retention(outbox, older_than="7d")

    assert result.partitions is not None
    assert f"outbox_messages_p{settled_day:%Y%m%d}" in result.partitions.dropped
    assert result.partitions.kept == {f"outbox_messages_p{open_day:%Y%m%d}": "1 row(s) not published"}
    assert f"outbox_messages_p{open_day:%Y%m%d}" in partitions(engine)
    assert result.deleted["outbox_messages"] == 300  # the kept day's published rows, one by one
    left = rows(outbox)
    assert {r.message_id for r in left if r.created_at < today} == {pending["message_id"]}
    assert len(left) == 11
    assert f"outbox_messages_p{today + 7 * DAY:%Y%m%d}" in partitions(engine)  # made ahead
    engine.dispose()


@pytest.mark.slow
def test_init_db_partitioned_then_housekeeping_from_the_command_line(
        postgres_db: str, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:  # python -m outbox, in this process
        return outbox_in_process(capfd, *args, "--db", postgres_db, cwd=tmp_path)

    made = cli("init-db", "--partitioned")
    assert made.returncode == 0 and "partitioned outbox_messages by day (0 row(s) moved)" in made.stdout
    assert "partitioned already" in cli("init-db", "--partitioned").stdout
    engine = create_engine(postgres_db)
    tables = Outbox(engine).tables
    old = datetime.now(UTC) - 10 * DAY
    with engine.begin() as conn:  # a day that lands in the default partition: deleted row by row
        conn.execute(sa.insert(tables.messages), [outbox_row("published", old), outbox_row("failed", old)])
    dry = cli("housekeeping", "run", "--older-than", "7d", "--dry-run")
    assert dry.returncode == 0 and "1 row(s) before" in dry.stdout and "would be deleted" in dry.stdout
    done = cli("housekeeping", "run", "--older-than", "7d")
    assert done.returncode == 0 and "1 row(s) before" in done.stdout, done.stdout
    assert [r.status for r in rows(Outbox(engine))] == ["failed"]
    engine.dispose()


def test_a_dry_run_tells_what_the_run_then_does(postgres_db: str) -> None:
    """Rows of a partition that would be dropped are counted with it, exactly, not also as row
    deletions; and a dropped partition never analyzed is "not known", not "about 0 rows"."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    partition_outbox(engine, outbox.tables, now=NOW - 20 * DAY)
    with engine.begin() as conn:  # 21 days of 10 published rows, and a pending one 10 days old
        conn.execute(sa.insert(outbox.tables.messages),
                     [outbox_row("published", NOW - d * DAY) for d in range(21) for _ in range(10)]
                     + [outbox_row("pending", NOW - 10 * DAY)])

    dry = run_retention(outbox, older_than="7d", now=NOW, dry_run=True)
    real = run_retention(outbox, older_than="7d", now=NOW)

    assert dry.partitions is not None and real.partitions is not None
    assert dry.partitions.dropped == {name: 10 for name in real.partitions.dropped}
    assert len(dry.partitions.dropped) == 8  # 13..20 days ago; the days after went to DEFAULT
    assert set(real.partitions.dropped.values()) == {None}
    assert dry.deleted == real.deleted == {"outbox_messages": 13 * 10 - 8 * 10}
    engine.dispose()


def test_a_day_with_an_unfinished_row_is_kept_without_queueing_for_the_tables_lock(postgres_db: str) -> None:
    """A queued ACCESS EXCLUSIVE request stalls every publisher behind it: a day that cannot go is
    found by a plain read first, so a relay's open transaction does not make retention wait."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    partition_outbox(engine, outbox.tables, now=NOW - 20 * DAY)
    failed = outbox_row("failed", NOW - 15 * DAY)
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages), [outbox_row("published", NOW - 15 * DAY), failed])
    with engine.connect() as reader, reader.begin():  # a reader's open transaction on the table
        reader.execute(sa.select(sa.func.count()).select_from(outbox.tables.messages)).scalar_one()
        result = run_retention(outbox, older_than="7d", now=NOW)
    assert result.partitions is not None
    assert result.partitions.kept[f"outbox_messages_p{NOW - 15 * DAY:%Y%m%d}"] == "1 row(s) not published"
    engine.dispose()


def test_the_check_under_the_tables_lock_reads_only_the_unfinished_rows(postgres_db: str) -> None:
    """The check runs while DETACH holds the parent's ACCESS EXCLUSIVE lock: it must not read the
    whole settled day (a sequential scan of 50M rows would stall publishers for many seconds)."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    partition_outbox(engine, outbox.tables, now=NOW - 20 * DAY)
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages),
                     [outbox_row("published", NOW - 15 * DAY) for _ in range(5_000)])
    day = f"outbox_messages_p{NOW - 15 * DAY:%Y%m%d}"
    with engine.begin() as conn:
        assert _open_rows(conn, day) == 0
        read = conn.execute(sa.text("SELECT seq_tup_read FROM pg_stat_xact_user_tables WHERE relname = :t"),
                            {"t": day}).scalar_one()
    assert read == 0
    engine.dispose()
