"""``archive``: move old published outbox rows (and old inbox dedup rows) to Parquet.

Rows leave the database only after a committed copy exists and the driver
has read it back, chunk by chunk (see ``_chunks``). Each run first finishes
what a killed run left behind, then plans new chunks over the rows now
eligible, and runs them as Spark tasks in waves so progress can be reported;
the driver settles (reads back, deletes, marks done) each chunk a wave
returns. Rows newer than the retention are never read for archiving and
never deleted.

An archive directory is one outbox database's (per table: the outbox's rows,
and the inbox rows of the dedup window, from the inbox database): what its
chunks belong to is the database's incarnation, recorded beside the
manifests at its first run, never the directory's path or the URL. A run of
another database (another schema or prefix of one database included) is
refused before it touches anything: it would otherwise finish the deletes
of the first one's unfinished chunks in its own tables, by their ids.
"""

from __future__ import annotations

import fcntl
import math
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from pyspark.sql import SparkSession

from ..core._envelope import utcnow
from ..core._errors import ConfigurationError, OutboxError
from ._chunks import Chunk, eligible, read_manifest, run_chunk, settle
from ._layout import origin_file, remove_debris, unfinished_manifests, write_atomically
from ._session import SessionFactory, session_from
from ._source import plan_ranges
from ._storage import local_path, require_shared
from ._tablemap import check_table, connect, safe_url, table_for
from ._window import parse_duration, parse_instant
from ._wire import incarnation

Progress = Callable[[str, int, int], None]


class ArchiveBusyError(OutboxError, RuntimeError):
    """Another archive run holds the archive directory's lock."""


@dataclass
class ArchiveResult:
    """Rows archived and deleted per table in this run, including chunks finished for a killed run."""

    archived: dict[str, int] = field(default_factory=dict)
    deleted: dict[str, int] = field(default_factory=dict)
    recovered_chunks: int = 0
    debris_removed: int = 0
    chunks: int = 0


def archive(
    outbox_url: str,
    archive_dir: str | Path,
    *,
    retention: timedelta | str | float,
    inbox_url: str | None = None,
    dedup_window: timedelta | str | float | None = None,
    chunk_rows: int = 50_000,
    delete_batch: int = 1_000,
    as_of: datetime | str | None = None,
    spark: SparkSession | SessionFactory | None = None,
    prefix: str = "",
    schema: str | None = None,
    progress: Progress | None = None,
    shared_storage: bool = False,
) -> ArchiveResult:
    """Archive published outbox rows created more than ``retention`` ago, then delete them.

    With ``dedup_window``, inbox rows processed longer ago than that are
    archived too (from ``inbox_url``, default ``outbox_url``); after that the
    inbox no longer recognises a redelivery of those messages, so choose a
    window far longer than any redelivery can take. Safe to kill at any point
    and run again; only one run per ``archive_dir`` at a time.

    ``archive_dir`` is made absolute here; on a master other than ``local``
    it must be storage every node mounts at that path, which
    ``shared_storage=True`` declares (refused otherwise). ``spark`` is a
    session or a function that builds one once the arguments are checked.
    """
    now = utcnow() if as_of is None else parse_instant(as_of, "as_of")
    jobs = [("outbox_messages", outbox_url, now - parse_duration(retention, "retention"))]
    if dedup_window is not None:
        jobs.append(("inbox_messages", inbox_url or outbox_url,
                     now - parse_duration(dedup_window, "dedup window")))
    for name, value in (("chunk_rows", chunk_rows), ("delete_batch", delete_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
    root = local_path(archive_dir, "archive_dir")
    if root.exists() and not root.is_dir():
        raise ConfigurationError(f"archive_dir {root} exists and is not a directory")
    for name, url, _cutoff in jobs:
        check_table(url, table_for(name, prefix, schema))
    report = progress or (lambda _step, _done, _total: None)
    report("starting Spark", 0, 0)
    session = session_from(spark)
    require_shared(session, root, "archive_dir", shared_storage)
    root.mkdir(parents=True, exist_ok=True)
    result = ArchiveResult()
    with _exclusive(root):
        origins = _claim(root, [(name, url) for name, url, _cutoff in jobs], prefix, schema)
        for name, url, cutoff in jobs:
            table, engine = table_for(name, prefix, schema), connect(url)
            try:
                result.debris_removed += remove_debris(root, name)
                for manifest in unfinished_manifests(root, name):  # committed by a killed run
                    settle(engine, table, root, manifest, delete_batch)
                    result.recovered_chunks += 1
                _record(root, name, origins[name])  # what a killed run left was this database's
                chunks = _plan(root, name, url, cutoff, prefix, schema, chunk_rows, delete_batch)
                result.chunks += len(chunks)
                archived = deleted = 0
                wave = max(1, 4 * session.sparkContext.defaultParallelism)
                report(f"archiving {name}", 0, len(chunks))
                for start in range(0, len(chunks), wave):
                    batch = chunks[start:start + wave]
                    for stem, rows in session.sparkContext.parallelize(batch, len(batch)).map(
                            run_chunk).collect():
                        if rows:
                            manifest = read_manifest(root, name, stem)
                            deleted += settle(engine, table, root, manifest, delete_batch)
                            archived += rows
                    report(f"archiving {name}", start + len(batch), len(chunks))
                result.archived[name], result.deleted[name] = archived, deleted
            finally:
                engine.dispose()
    return result


def _claim(root: Path, jobs: list[tuple[str, str]], prefix: str, schema: str | None
           ) -> dict[str, str | None]:
    """Each table's incarnation, or a refusal when a table's archive in ``root`` is another database's.

    Checked for every table before any is touched. A directory archived into before the origin was
    recorded is taken as this database's once its unfinished chunks settled here (``_record``: each
    chunk's rows are checked by message id, ``_chunks.delete_archived``); tables without an
    incarnation (older than the third release's schema) cannot be told apart, and are not checked.
    """
    origins = {name: incarnation(url, prefix, schema) for name, url in jobs}
    for name, url in jobs:
        path, ours = origin_file(root, name), origins[name]
        theirs = path.read_text().strip() if path.is_file() else None
        if ours is not None and theirs is not None and theirs != ours:
            raise ConfigurationError(
                f"archive directory {root} holds the {name} of another outbox database (incarnation "
                f"{theirs}), not of {safe_url(url)}'s (incarnation {ours}): give each database, schema "
                "and prefix an archive directory of its own. Nothing was archived or deleted.")
    return origins


def _record(root: Path, name: str, origin: str | None) -> None:
    """Record whose ``name`` rows ``root`` archives, if not recorded yet."""
    if origin is not None and not origin_file(root, name).is_file():
        write_atomically(origin_file(root, name), origin.encode())


def _plan(root: Path, name: str, url: str, cutoff: datetime, prefix: str, schema: str | None,
          chunk_rows: int, delete_batch: int) -> list[Chunk]:
    table, engine = table_for(name, prefix, schema), connect(url)
    filters = eligible(table, cutoff)
    try:
        with engine.connect() as conn:
            total = conn.execute(sa.select(sa.func.count()).select_from(table).where(*filters)).scalar_one()
            if total == 0:
                return []
            ranges = plan_ranges(conn, table, filters, math.ceil(total / chunk_rows))
    finally:
        engine.dispose()
    run = f"{utcnow():%Y%m%dT%H%M%S}-{secrets.token_hex(4)}"
    return [
        Chunk(root=str(root), table=name, url=url, prefix=prefix, schema=schema, cutoff=cutoff,
              bounds=r.value, stem=f"{run}-{i:06d}", delete_batch=delete_batch)
        for i, r in enumerate(ranges)
    ]


@contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """Hold the archive directory's lock; the OS drops it when the process dies, even by SIGKILL."""
    fd = os.open(root / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchiveBusyError(f"another archive run is using {root}") from None
        yield
    finally:
        os.close(fd)
