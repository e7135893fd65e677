"""Retention deletes exactly the settled rows past their cutoff, on every database, and nothing else."""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from _in_process import outbox_in_process
from _retention_rows import inbox_row, outbox_row, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import ConfigurationError, Outbox, create_engine
from outbox.housekeeping import run_retention

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
RETENTION, WINDOW = timedelta(days=7), timedelta(days=3)
# Ages in hours around both cutoffs, the exact cutoff included (it is kept: "older than" is strict).
AGES = st.one_of(st.integers(0, 24 * 12), st.sampled_from([72, 168, 167, 169, 71, 73]))


@pytest.fixture
def filled(proof_db_url: str):
    engine = create_engine(proof_db_url)
    outbox = Outbox(engine)
    outbox.create_tables()
    yield outbox
    engine.dispose()


@pytest.fixture
def prepare():
    """Called after each example emptied the tables; test_partitions makes it remake partitions."""
    return lambda outbox: None


OUTBOX_ROWS = st.lists(st.tuples(st.sampled_from(["pending", "published", "failed", "skipped"]), AGES),
                       max_size=30)
INBOX_ROWS = st.lists(st.tuples(st.sampled_from(["g", "G", "g ", "other"]), AGES,
                                st.one_of(st.none(), AGES), st.sampled_from(["processed", "discarded"])),
                      max_size=30)


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(outbox_rows=OUTBOX_ROWS, inbox_rows=INBOX_ROWS, batch_size=st.integers(1, 7),
       outbox_only=st.booleans())
def test_retention_deletes_exactly_the_settled_rows_past_the_cutoff(
        filled: Outbox, prepare, outbox_rows, inbox_rows, batch_size: int, outbox_only: bool) -> None:
    t, engine = filled.tables, filled.engine
    hours = lambda h: NOW - timedelta(hours=h)  # noqa: E731
    outbox = [outbox_row(status, hours(age)) for status, age in outbox_rows]
    inbox = [inbox_row(group, hours(processed), None if created is None else hours(created), outcome)
             for group, processed, created, outcome in inbox_rows]
    with engine.begin() as conn:
        for table in (t.messages, t.inbox_messages, t.keys, t.inbox_keys, t.inbox_held, t.inbox_parked):
            conn.execute(sa.delete(table))
    prepare(filled)
    with engine.begin() as conn:
        if outbox:
            conn.execute(sa.insert(t.messages), outbox)
        if inbox:
            conn.execute(sa.insert(t.inbox_messages), inbox)
        # A key's positions, which must survive the deletion of every row they count.
        conn.execute(sa.insert(t.keys), [{"topic": "t", "key": "k", "last_seq": 9}])
        conn.execute(sa.insert(t.inbox_keys), [{"consumer_group": "g", "topic": "t", "key": "k",
                                                "last_seq": 9, "parked": False}])
    before = snapshot(engine, t)

    result = run_retention(filled, older_than=RETENTION, dedup_window=None if outbox_only else WINDOW,
                           batch_size=batch_size, now=NOW)

    after = snapshot(engine, t)
    outbox_cut, inbox_cut = NOW - RETENTION, NOW - WINDOW
    # The row of the greatest id (the last inserted) stays on SQLite and MySQL, whose ids would be
    # given again once it went (``housekeeping._targets.outbox_target``); PostgreSQL never does.
    newest = outbox[-1]["message_id"] if outbox and engine.dialect.name != "postgresql" else None
    kept_outbox = {r["message_id"] for r in outbox
                   if not (r["status"] == "published" and r["created_at"] < outbox_cut)
                   or r["message_id"] == newest}
    settled_inbox = {(r["consumer_group"], r["message_id"]) for r in inbox
                     if r["processed_at"] < inbox_cut
                     and (r["created_at"] is None or r["created_at"] < inbox_cut)}
    all_inbox = {(r["consumer_group"], r["message_id"]) for r in inbox}
    kept_inbox = all_inbox if outbox_only else all_inbox - settled_inbox
    assert after["messages"] == kept_outbox
    assert after["inbox"] == kept_inbox
    for unchanged in ("outbox_keys", "inbox_keys", "held", "parked"):
        assert after[unchanged] == before[unchanged]
    if result.partitions is None:  # dropped partitions' rows are counted apart, estimated
        assert result.deleted["outbox_messages"] == len(outbox) - len(kept_outbox)
    assert result.deleted.get("inbox_messages", 0) == len(inbox) - len(kept_inbox)

    again = run_retention(filled, older_than=RETENTION, dedup_window=WINDOW, batch_size=batch_size, now=NOW)
    assert again.total == (len(settled_inbox) if outbox_only else 0)
    assert snapshot(engine, t)["inbox"] == all_inbox - settled_inbox


def test_a_dry_run_counts_and_deletes_nothing(filled: Outbox) -> None:
    t = filled.tables
    old = NOW - timedelta(days=30)
    with filled.engine.begin() as conn:
        conn.execute(sa.insert(t.messages), [outbox_row("published", old), outbox_row("pending", old)])
    before = snapshot(filled.engine, t)
    result = run_retention(filled, older_than="7d", dry_run=True, now=NOW)
    assert result.dry_run and result.deleted == {"outbox_messages": 1}
    assert snapshot(filled.engine, t) == before


@pytest.mark.parametrize("kwargs, named", [
    ({}, "older_than"), ({"older_than": "7 days"}, "retention"), ({"older_than": "-1d"}, "retention"),
    ({"older_than": 0}, "retention"), ({"dedup_window": "soon"}, "dedup window"),
    ({"older_than": "7d", "batch_size": 0}, "batch_size"),
    ({"older_than": "7d", "batch_size": True}, "batch_size"),
    ({"older_than": "7d", "duty": 0}, "duty"), ({"older_than": "7d", "duty": 1.5}, "duty"),
    ({"older_than": "7d", "duty": True}, "duty"), ({"older_than": "7d", "duty": float("nan")}, "duty"),
])
def test_bad_settings_are_refused_before_any_sql(kwargs, named: str) -> None:
    engine = create_engine("sqlite://")  # no tables: a refusal must come before the first statement
    with pytest.raises(ConfigurationError, match=named):
        run_retention(Outbox(engine), **kwargs)


def old_published(outbox: Outbox, rows: int) -> None:
    """Only ``rows`` published rows 30 days old in the outbox table, and a pending row after them:
    the newest row, which retention keeps anyway on SQLite and MySQL (``outbox_target``)."""
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        conn.execute(sa.delete(outbox.tables.messages))
        conn.execute(sa.insert(outbox.tables.messages),
                     [*(outbox_row("published", NOW - timedelta(days=30)) for _ in range(rows)),
                      outbox_row("pending", NOW)])


@contextmanager
def timed_transactions(takes: float) -> Iterator[list[list[float]]]:
    """The [begin, commit] times of every transaction any engine runs meanwhile, and [begin] of one
    that was not committed (a read); each made to take at least ``takes`` seconds (a batch that takes
    a noticeable while)."""
    spans: list[list[float]] = []

    def began(conn: sa.Connection) -> None:
        spans.append([time.monotonic()])
        time.sleep(takes)

    def committed(conn: sa.Connection) -> None:
        spans[-1].append(time.monotonic())

    sa.event.listen(sa.Engine, "begin", began)
    sa.event.listen(sa.Engine, "commit", committed)
    try:
        yield spans
    finally:
        sa.event.remove(sa.Engine, "begin", began)
        sa.event.remove(sa.Engine, "commit", committed)


def test_a_pass_rests_between_batches_for_the_share_of_time_it_does_not_work(filled: Outbox) -> None:
    """A pass deletes ``duty`` of the time and rests the remainder between batches, so that the
    relay and the inbox beside it keep the rest of the database; ``duty=1`` never rests."""
    duty = 0.25
    old_published(filled, 12)
    with timed_transactions(0.02) as spans:
        result = run_retention(filled, older_than="7d", batch_size=4, now=NOW, duty=duty)
    batches = [span for span in spans if len(span) == 2]
    assert result.deleted == {"outbox_messages": 12} and len(batches) == 4  # the 4th finds nothing
    for (start, end), (following, _) in itertools.pairwise(batches):
        rested, worked = following - end, end - start
        assert rested >= worked * (1 - duty) / duty * 0.99, (rested, worked)

    old_published(filled, 8)
    with timed_transactions(0.5) as spans:
        run_retention(filled, older_than="7d", batch_size=4, now=NOW, duty=1.0)
    batches = [span for span in spans if len(span) == 2]
    assert len(batches) == 3
    for (start, end), (following, _) in itertools.pairwise(batches):
        rested, worked = following - end, end - start
        assert rested < worked / 2, (rested, worked)  # no rest: a rest as long as the work at duty 0.5


def test_by_default_a_pass_rests_more_than_five_times_as_long_as_it_works(filled: Outbox) -> None:
    """The default duty is 0.15: beside a relay, a quarter of the time deleting (the default
    before the outbox's batches stopped locking rows) deleted no more rows a second there and
    raised a relay-like probe's median p99 to 21.5 ms against 12.1 (docs/operations.md)."""
    old_published(filled, 8)
    with timed_transactions(0.02) as spans:
        run_retention(filled, older_than="7d", batch_size=4, now=NOW)
    batches = [span for span in spans if len(span) == 2]
    assert len(batches) == 3
    for (start, end), (following, _) in itertools.pairwise(batches):
        rested, worked = following - end, end - start
        assert rested >= 0.85 / 0.15 * worked * 0.99, (rested, worked)


def test_a_stop_ends_a_rest_at_once(filled: Outbox) -> None:
    old_published(filled, 4)
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    started = time.monotonic()
    result = run_retention(filled, older_than="7d", batch_size=2, now=NOW, duty=1e-9, stop=stop)
    assert result.stopped and result.deleted == {"outbox_messages": 2}
    assert time.monotonic() - started < 10  # the rest after the first batch would be years


def test_a_batch_deletes_at_most_batch_size_rows(filled: Outbox) -> None:
    """A batch is one short transaction of at most ``batch_size`` rows, whatever the database
    plans: on PostgreSQL a ``DELETE … WHERE id IN (SELECT … LIMIT n FOR UPDATE SKIP LOCKED)``
    planned as a rescanned semi-join deleted every settled row in one statement (each rescan
    skips the rows the statement deleted already and picks n more)."""
    old_published(filled, 12)
    seen: list[int] = []
    result = run_retention(filled, older_than="7d", batch_size=4, now=NOW, duty=1.0,
                           progress=lambda table, deleted: seen.append(deleted))
    assert result.deleted == {"outbox_messages": 12}
    assert seen == [4, 8, 12]


def test_a_default_batch_leaves_a_relay_commit_little_wal_to_flush(own_postgres) -> None:
    """A relay's commit flushes every byte of WAL written before its own, retention's included:
    a default batch writes at most 512 kB of it, even when every page it touches is the first
    since a checkpoint (a full image each: the state of rows retained for days). 5,000-row
    batches wrote about 1.7 MB each."""
    engine = create_engine(own_postgres.url)
    outbox = Outbox(engine)
    outbox.create_tables()
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox.tables.messages), [
            {**outbox_row("published", NOW - timedelta(days=30)), "payload": b"p" * 100}
            for _ in range(6000)])
    wal: list[int] = []
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM outbox_messages"))  # the hint bits a first read would set
        conn.execute(sa.text("CHECKPOINT"))

        def written(table: str, deleted: int) -> None:
            wal.append(conn.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'")).scalar_one())

        written("", 0)
        result = run_retention(outbox, older_than="7d", now=NOW, duty=1.0, progress=written)
    engine.dispose()
    assert result.deleted == {"outbox_messages": 6000}
    per_batch = [int(b - a) for a, b in itertools.pairwise(wal)]
    assert len(per_batch) >= 2 and max(per_batch) <= 512 * 1024, per_batch


PERIODS = st.one_of(
    st.from_regex(r"\A(\d{1,25}(\.\d{1,3})?[smhdw]){1,3}\Z"), st.floats(), st.integers(-10**30, 10**30),
    st.timedeltas())


@given(period=PERIODS)
def test_any_period_is_a_usable_cutoff_or_a_configuration_error(period) -> None:
    """Huge, infinite or NaN periods ("99999999999d", 1e300) are refused by name, never an
    OverflowError out of the cutoff's arithmetic; whatever is taken gives a computable cutoff."""
    engine = create_engine("sqlite://")
    try:
        result = run_retention(Outbox(engine), older_than=period, dry_run=True, now=NOW)
    except ConfigurationError as exc:
        assert "retention" in str(exc)
    except sa.exc.OperationalError:  # no tables: the period passed, and the cutoff was computed
        pass
    else:
        raise AssertionError(f"counted rows of tables that do not exist: {result}")




@pytest.mark.slow
def test_the_command_deletes_with_progress_and_a_dry_run_deletes_nothing(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    outbox = Outbox(create_engine(url))
    outbox.create_tables()
    old = datetime.now(UTC) - timedelta(days=8)
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        conn.execute(sa.insert(outbox.tables.messages),
                     [outbox_row("published", old) for _ in range(30)] + [outbox_row("pending", old)])

    def cli(*args: str) -> subprocess.CompletedProcess[str]:  # python -m outbox, in this process
        return outbox_in_process(capfd, "housekeeping", "run", "--db", url, *args, cwd=tmp_path)

    dry = cli("--older-than", "7d", "--dry-run")
    assert dry.returncode == 0 and "outbox_messages: 30 row(s) before" in dry.stdout
    assert "dry run" in dry.stdout
    done = cli("--older-than", "7d", "--batch-size", "7")
    assert done.returncode == 0 and "outbox_messages: 30 row(s) before" in done.stdout, done.stderr
    assert "deleted in" in done.stdout
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        assert list(conn.execute(sa.select(outbox.tables.messages.c.status)).scalars()) == ["pending"]
