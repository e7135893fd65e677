"""Archive: old rows move to Parquet exactly once, whatever point a run is killed at."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import sqlalchemy as sa
from _spark_seed import AS_OF, build, seed, spark_for_tests

from outbox import ConfigurationError, OutboxTables
from outbox.spark import archive
from outbox.spark._archive import _plan
from outbox.spark._chunks import (
    ArchiveUnreadableError,
    delete_archived,
    read_manifest,
    run_chunk,
    settle,
    write_files,
)
from outbox.spark._layout import committed_files, manifest_dir, write_atomically

pytestmark = pytest.mark.spark
TABLES = OutboxTables()
RETENTION = timedelta(seconds=1500)


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """These Spark jobs run on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


@pytest.fixture(scope="module")
def spark(java_home):
    return spark_for_tests()


def snapshot(url: str, table: sa.Table) -> dict:
    """Every row of a table keyed by its message id (and group), columns as stored."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table)).mappings().all()
    engine.dispose()
    key = (lambda r: (r["consumer_group"], str(r["message_id"]))) if "consumer_group" in table.c \
        else (lambda r: str(r["message_id"]))
    return {key(r): dict(r) for r in rows}


def archived_rows(root: Path, table: str) -> list[dict]:
    """All rows in every Parquet file under the table's directory, committed or not."""
    files = sorted(str(p) for p in (root / table).rglob("*.parquet"))
    if not files:
        return []
    dataset = ds.dataset(files, format="parquet", partitioning="hive", partition_base_dir=str(root / table))
    return dataset.to_table().to_pylist()


def old_outbox(before: dict) -> set[str]:
    cutoff = AS_OF - RETENTION
    return {k for k, r in before.items() if r["status"] == "published" and r["created_at"] < cutoff}


def old_inbox(before: dict) -> set[tuple[str, str]]:
    return {k for k, r in before.items() if r["processed_at"] < AS_OF - RETENTION}


def assert_archived_exactly_once(url: str, root: Path, before: dict, inbox_before: dict) -> None:
    """Old rows: once in the archive, gone from the table. Everything else: untouched."""
    for name, table, was, old in (
        ("outbox_messages", TABLES.messages, before, old_outbox(before)),
        ("inbox_messages", TABLES.inbox_messages, inbox_before, old_inbox(inbox_before)),
    ):
        rows = archived_rows(root, name)
        keys = [r["message_id"] if name == "outbox_messages" else (r["consumer_group"], r["message_id"])
                for r in rows]
        assert len(keys) == len(set(keys)), f"{name}: a row is archived twice"
        assert set(keys) == old
        now = snapshot(url, table)
        assert set(now) == set(was) - old
        assert all(now[k] == was[k] for k in now), f"{name}: a row that stays was changed"
    by_id = {str(r["message_id"]): r for r in before.values()}
    for row in archived_rows(root, "outbox_messages"):
        original = by_id[row["message_id"]]
        assert row["payload"] == original["payload"]
        assert json.loads(row["headers"]) == original["headers"]
        assert (row["topic"], row["date"]) == (original["topic"], original["created_at"].date().isoformat())


def seeded(url: str, n: int) -> tuple[dict, dict]:
    sc = build(n=n, keys=40)
    seed(sc, url, url)
    return snapshot(url, TABLES.messages), snapshot(url, TABLES.inbox_messages)


def test_archive_moves_old_rows_and_leaves_the_rest(spark, db_url, tmp_path):
    before, inbox_before = seeded(db_url, 3_000)
    assert any(r["status"] == "failed" and r["created_at"] < AS_OF - RETENTION for r in before.values())
    root = tmp_path / "archive"

    result = archive(db_url, root, retention=RETENTION, dedup_window=RETENTION, as_of=AS_OF,
                     chunk_rows=400, delete_batch=150, spark=spark)

    assert_archived_exactly_once(db_url, root, before, inbox_before)
    assert result.archived["outbox_messages"] == result.deleted["outbox_messages"] == len(old_outbox(before))
    assert result.chunks > 2
    again = archive(db_url, root, retention=RETENTION, dedup_window=RETENTION, as_of=AS_OF, spark=spark)
    assert again.archived == {"outbox_messages": 0, "inbox_messages": 0}
    assert_archived_exactly_once(db_url, root, before, inbox_before)


def test_rerun_completes_a_run_killed_between_any_two_steps(spark, sqlite_db, tmp_path):
    """Leave one chunk at each crash point by hand, then let a new run finish the job."""
    before, inbox_before = seeded(sqlite_db, 3_000)
    root = tmp_path / "archive"
    chunks = _plan(root, "outbox_messages", sqlite_db, AS_OF - RETENTION, "", None, 300, 100)
    assert len(chunks) >= 4
    table = TABLES.messages
    engine = sa.create_engine(sqlite_db)

    def rows_of(chunk):
        from outbox.spark._chunks import eligible
        from outbox.spark._source import range_filter
        with engine.connect() as conn:
            return conn.execute(sa.select(*table.columns).where(
                *eligible(table, chunk.cutoff), *range_filter(table, chunk.bounds))).all()

    stem, _rows = run_chunk(chunks[0])                         # finished
    settle(engine, table, root, read_manifest(root, "outbox_messages", stem), 100)
    write_files(chunks[1], table, rows_of(chunks[1]))          # files written, no commit
    for chunk, deleted_share in ((chunks[2], 0), (chunks[3], 0.5)):  # committed; none / half deleted
        manifest = write_files(chunk, table, rows_of(chunk))
        write_atomically(manifest_dir(root, "outbox_messages") / f"{chunk.stem}.json",
                         json.dumps(manifest).encode())
        keys = manifest["keys"][: int(len(manifest["keys"]) * deleted_share)]
        delete_archived(engine, table, manifest | {"keys": keys}, 100)
    engine.dispose()

    result = archive(sqlite_db, root, retention=RETENTION, dedup_window=RETENTION, as_of=AS_OF,
                     chunk_rows=300, spark=spark)

    assert result.recovered_chunks == 2 and result.debris_removed >= 1
    assert_archived_exactly_once(sqlite_db, root, before, inbox_before)


def commit_by_hand(url: str, root: Path, count: int) -> list[dict]:
    """Commit ``count`` chunks the way a task does (files, then manifest) and stop there."""
    chunks = _plan(root, "outbox_messages", url, AS_OF - RETENTION, "", None, 300, 100)[:count]
    table, manifests = TABLES.messages, []
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        for chunk in chunks:
            from outbox.spark._chunks import eligible
            from outbox.spark._source import range_filter
            rows = conn.execute(sa.select(*table.columns).where(
                *eligible(table, chunk.cutoff), *range_filter(table, chunk.bounds))).all()
            manifest = write_files(chunk, table, rows)
            write_atomically(manifest_dir(root, "outbox_messages") / f"{chunk.stem}.json",
                             json.dumps(manifest).encode())
            manifests.append(manifest)
    engine.dispose()
    return manifests


@pytest.mark.parametrize("damage", ["file missing", "rows missing", "other rows"])
def test_a_chunk_that_does_not_read_back_is_not_deleted(spark, sqlite_db, tmp_path, damage):
    """Before deleting, the driver reads the chunk's files back; what it cannot read stays in the table."""
    before, _inbox = seeded(sqlite_db, 3_000)
    root = tmp_path / "archive"
    first, second = commit_by_hand(sqlite_db, root, 2)
    victim = root / second["files"][0]["path"]
    if damage == "file missing":
        victim.unlink()
    else:
        import pyarrow.parquet as pq
        table = pq.read_table(victim)
        shrunk = table.slice(1) if damage == "rows missing" else table.set_column(
            table.schema.get_field_index("id"), "id", pa.array([i + 10**9 for i in table["id"].to_pylist()]))
        pq.write_table(shrunk, victim)

    with pytest.raises(ArchiveUnreadableError, match="nothing of this chunk was deleted"):
        archive(sqlite_db, root, retention=RETENTION, as_of=AS_OF, spark=spark)

    left = set(snapshot(sqlite_db, TABLES.messages))
    by_id = {r["id"]: k for k, r in before.items()}
    assert {by_id[i] for i in second["keys"]} <= left, "rows of an unreadable chunk were deleted"
    assert len(left) >= len(before) - len(first["keys"])


@pytest.mark.parametrize("directory", ["of an earlier run", "archived into before the origin was recorded"])
def test_a_run_for_another_database_never_settles_this_ones_chunks(spark, sqlite_db, tmp_path, directory):
    """An archive directory is one outbox database's (its incarnation; its rows by message id, never by
    the directory's path nor a row's number): database A's run killed after it committed a chunk, a
    run of database B in the same directory must not delete B's rows of that chunk's ids (B's rows
    1, 2, 3 … are not A's, and no copy of them is in the archive; A's chunk, marked done, would then
    never leave A). B's run is refused, touching nothing; A's next run finishes A's chunk."""
    other = f"sqlite:///{tmp_path}/other.db"
    seeded(sqlite_db, 3_000)
    sc = build(n=3_000, keys=40, seed=11)
    seed(sc, other, other)
    before = snapshot(other, TABLES.messages)
    root = tmp_path / "archive"
    if directory == "of an earlier run":  # A's run of a longer retention: the directory is A's
        archive(sqlite_db, root, retention=2 * RETENTION, as_of=AS_OF, spark=spark)
    [chunk] = commit_by_hand(sqlite_db, root, 1)
    done = manifest_dir(root, "outbox_messages") / f"{chunk['stem']}.done"
    try:
        archive(other, root, retention=RETENTION, as_of=AS_OF, spark=spark)
    except (ConfigurationError, ArchiveUnreadableError) as exc:
        assert ("another outbox database" if directory == "of an earlier run" else "another database's chunk"
                ) in str(exc), exc
    gone = set(before) - set(snapshot(other, TABLES.messages))
    kept = {r["message_id"] for r in archived_rows(root, "outbox_messages")}
    assert gone <= kept, f"{len(gone - kept)} rows of the other database deleted without a copy"
    assert not gone and not done.exists()
    assert archive(sqlite_db, root, retention=RETENTION, as_of=AS_OF, spark=spark).recovered_chunks == 1
    assert done.exists()


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from _spark_seed import spark_for_tests
    from outbox.spark import archive
    archive({url!r}, {root!r}, retention={retention!r}, dedup_window={retention!r},
            as_of={as_of!r}, chunk_rows=150, delete_batch=50, spark=spark_for_tests())
""")


def settled(root: Path) -> int:
    """Chunks whose rows the driver has read back and deleted (``.done`` markers)."""
    directory = manifest_dir(root, "outbox_messages")
    return len(list(directory.glob("*.done"))) if directory.is_dir() else 0


def kill_when(process: subprocess.Popen, root: Path, done: int) -> None:
    """SIGKILL the archive job (driver, JVM and workers) once ``done`` chunks are settled."""
    deadline = time.monotonic() + 180
    while settled(root) < done:
        assert process.poll() is None, f"archive job ended before the kill: {process.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "archive job made no progress"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_archive_killed_with_sigkill_and_rerun(spark, java_home, sqlite_db, tmp_path):
    before, inbox_before = seeded(sqlite_db, 12_000)
    old = old_outbox(before)
    root = tmp_path / "archive"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), url=sqlite_db, root=str(root),
                                    retention=f"{RETENTION.total_seconds()}s", as_of=AS_OF.isoformat()))
    # A killed JVM cannot remove its scratch (blockmgr-*, spark-*, 10 MB a run): the job's JVM
    # keeps it in the test's directory, not in /tmp, where it outlived the suite.
    (tmp_path / "jvm-tmp").mkdir()
    scratch = {**os.environ, "SPARK_SUBMIT_OPTS": " ".join(
        [os.environ.get("SPARK_SUBMIT_OPTS", ""), f"-Djava.io.tmpdir={tmp_path / 'jvm-tmp'}"]).strip()}
    for more in (5, 15):  # two kills: a fresh run, then a run that is itself recovering
        job = subprocess.Popen([sys.executable, str(script)], start_new_session=True, env=scratch,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        kill_when(job, root, settled(root) + more)
        remaining = old & set(snapshot(sqlite_db, TABLES.messages))
        assert 0 < len(remaining) < len(old), "the kill did not land mid-run"
        # At the moment of the crash: nothing deleted without a committed copy.
        in_committed = {r["message_id"] for f in committed_files(root, "outbox_messages")
                        for r in ds.dataset(str(f), format="parquet").to_table().to_pylist()}
        assert old - remaining <= in_committed

    # The rerun recovers what the kills left (committed chunks, debris) before it plans the rest;
    # the rest, some 7,000 rows, goes in chunks of 2,000: one wave of Spark tasks, not five of 200.
    archive(sqlite_db, root, retention=RETENTION, dedup_window=RETENTION, as_of=AS_OF,
            chunk_rows=2_000, spark=spark)

    assert_archived_exactly_once(sqlite_db, root, before, inbox_before)


def test_bad_archive_arguments_are_named(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ConfigurationError, match="invalid retention"):
        archive(url, tmp_path / "a", retention="forever")
    with pytest.raises(ConfigurationError, match="chunk_rows must be a positive int"):
        archive(url, tmp_path / "a", retention="1d", chunk_rows=0)
    with pytest.raises(ConfigurationError, match="outbox_messages does not exist"):
        archive(url, tmp_path / "a", retention="1d")
