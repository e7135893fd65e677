"""One archive chunk, start to finish: copy rows to Parquet, commit, then delete them.

Runs inside a Spark task, so it touches only the database and the archive
directory. The order of steps is what makes a SIGKILL harmless at any point:

1. read the chunk's eligible rows;
2. write one Parquet file per (topic, date), each complete or absent;
3. **commit**: atomically write the manifest naming exactly those files and
   the keys of exactly those rows;

and then, on the driver (``settle``):

4. read the manifest and its files back from the archive root, as replay
   will read them, and check the rows and keys against the manifest;
5. delete those keys from the database in bounded batches (only rows still
   published/processed, never anything else);
6. write the ``.done`` marker.

Killed before 3, the files are debris (removed on the next run) and the rows
are still in the database, to be archived again. Killed after 3, the next
run finishes steps 4-6 from the manifest before planning anything new, so no
row is archived twice and none is deleted without a committed copy. Step 4
is what makes a root the executors do not really share with the driver
harmless: the driver finds nothing to read back and deletes nothing.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa

from ..core._errors import OutboxError
from ..core._tables import OutboxStatus
from ._layout import manifest_dir, table_dir, write_atomically
from ._source import range_filter
from ._tablemap import arrow_schema, connect, table_for, to_batch


@dataclass(frozen=True)
class Chunk:
    """Everything a task needs to archive one range (picklable, primitive values only)."""

    root: str
    table: str
    url: str
    prefix: str
    schema: str | None
    cutoff: datetime
    bounds: tuple[Any, ...]
    stem: str
    delete_batch: int

    def sa_table(self) -> sa.Table:
        return table_for(self.table, self.prefix, self.schema)


def eligible(table: sa.Table, cutoff: datetime) -> list[sa.ColumnElement[bool]]:
    """Rows old enough to leave the database: published outbox rows, processed inbox rows.

    The outbox row of the greatest id stays (``housekeeping._targets.outbox_target`` says why:
    SQLite and MySQL before 8.0 give a deleted greatest id again, and an exactly-once progress
    record naming the old row would mark the new one published unsent)."""
    if "status" in table.c:
        return [table.c.status == OutboxStatus.PUBLISHED, table.c.created_at < cutoff,
                table.c.id < sa.select(sa.func.max(table.c.id)).scalar_subquery()]
    return [table.c.processed_at < cutoff]


def _date_column(table: sa.Table) -> str:
    return "created_at" if "status" in table.c else "processed_at"


def _key_columns(table: sa.Table) -> list[sa.Column[Any]]:
    return [table.c.id] if "id" in table.c else [table.c.consumer_group, table.c.message_id]


class ArchiveUnreadableError(OutboxError, RuntimeError):
    """A committed chunk cannot be read back from the archive root: its rows are not deleted."""


def run_chunk(chunk: Chunk) -> tuple[str, int]:
    """Copy one chunk to Parquet and commit its manifest (in a task); return (stem, rows)."""
    table = chunk.sa_table()
    engine = connect(chunk.url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(*table.columns)
                .where(*eligible(table, chunk.cutoff), *range_filter(table, chunk.bounds))
                .order_by(*_key_columns(table))
            ).all()
        if not rows:
            return chunk.stem, 0
        manifest = write_files(chunk, table, rows)
        write_atomically(manifest_dir(Path(chunk.root), chunk.table) / f"{chunk.stem}.json",
                         json.dumps(manifest).encode())
        return chunk.stem, len(rows)
    finally:
        engine.dispose()


def settle(engine: sa.Engine, sa_table: sa.Table, root: Path, manifest: dict[str, Any],
           batch: int) -> int:
    """Read a committed chunk back, then delete its rows and mark it done; return rows deleted."""
    message_ids = verify(root, sa_table, manifest)
    deleted = delete_archived(engine, sa_table, manifest, batch, message_ids)
    mark_done(root, manifest["table"], manifest["stem"])
    return deleted


def read_manifest(root: Path, table: str, stem: str) -> dict[str, Any]:
    path = manifest_dir(root, table) / f"{stem}.json"
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArchiveUnreadableError(
            f"chunk {stem} was committed by a Spark task but its manifest {path} is not there for "
            "the driver: the archive root is not shared by driver and executors. Nothing of this "
            "chunk was deleted from the database."
        ) from None
    return manifest


def verify(root: Path, sa_table: sa.Table, manifest: dict[str, Any]) -> dict[int, str] | None:
    """Raise unless the manifest's files, read here, hold exactly the manifest's rows and keys.

    Returns, for the outbox table, each row's message id by its id (read back from the files): what
    the row is, where the id is only where it was (``delete_archived``).
    """
    names = [c.name for c in _key_columns(sa_table)]
    found: list[Any] = []
    message_ids: dict[int, str] = {}
    for entry in manifest["files"]:
        path = root / entry["path"]
        try:
            columns = pq.read_table(path, columns=names + (["message_id"] if names == ["id"] else [])
                                    ).to_pydict()
        except (OSError, pa.ArrowException) as exc:
            raise ArchiveUnreadableError(
                f"archive file {path} of chunk {manifest['stem']} cannot be read back ({exc}); "
                "nothing of this chunk was deleted from the database"
            ) from None
        keys = columns["id"] if names == ["id"] else [list(k) for k in zip(*columns.values(), strict=True)]
        if len(keys) != entry["rows"]:
            raise ArchiveUnreadableError(
                f"archive file {path} holds {len(keys)} rows, its manifest says {entry['rows']}; "
                "nothing of this chunk was deleted from the database"
            )
        found += keys
        if names == ["id"]:
            message_ids.update(zip(columns["id"], map(_canonical, columns["message_id"]), strict=True))
    if sorted(map(str, found)) != sorted(map(str, manifest["keys"])):
        raise ArchiveUnreadableError(
            f"the files of chunk {manifest['stem']} under {root} do not hold the rows its manifest "
            "lists; nothing of this chunk was deleted from the database"
        )
    return message_ids if names == ["id"] else None


def _canonical(message_id: Any) -> str:
    return str(message_id if isinstance(message_id, uuid.UUID) else uuid.UUID(str(message_id)))


def write_files(chunk: Chunk, table: sa.Table, rows: Sequence[sa.Row[Any]]) -> dict[str, Any]:
    """One Parquet file per (topic, date); returns the manifest (not yet committed)."""
    columns = [c for c in table.columns if c.name != "topic"]
    schema = arrow_schema(columns)
    parts: dict[tuple[str, str], list[sa.Row[Any]]] = defaultdict(list)
    date_column = _date_column(table)
    for row in rows:
        parts[(row.topic, getattr(row, date_column).date().isoformat())].append(row)
    root = Path(chunk.root)
    files = []
    for (topic, day), part in sorted(parts.items()):
        values = [tuple(getattr(r, c.name) for c in columns) for r in part]
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_batches([to_batch(values, columns, schema)]), sink)
        path = table_dir(root, chunk.table) / f"topic={topic}" / f"date={day}" / f"{chunk.stem}.parquet"
        write_atomically(path, sink.getvalue().to_pybytes())
        files.append({"path": str(path.relative_to(root)), "rows": len(part)})
    key_names = [c.name for c in _key_columns(table)]
    keys = [row.id for row in rows] if key_names == ["id"] else [
        [row.consumer_group, str(row.message_id)] for row in rows
    ]
    return {"table": chunk.table, "stem": chunk.stem, "cutoff": chunk.cutoff.isoformat(),
            "files": files, "keys": keys}


def delete_archived(engine: sa.Engine, table: sa.Table, manifest: dict[str, Any], batch: int,
                    message_ids: dict[int, str] | None = None) -> int:
    """Delete exactly the manifest's rows, ``batch`` per transaction; safe to repeat.

    ``message_ids`` (``verify``'s, read back from the files) are what the outbox rows are: a row
    of a manifest's id holding another message is another database's row of that number (a chunk
    of another outbox database archived into this directory), and nothing of the chunk is deleted.
    """
    deleted = 0
    keys = manifest["keys"]
    if "id" in table.c:
        for start in range(0, len(keys), batch):
            ids = keys[start:start + batch]
            with engine.begin() as conn:
                if message_ids is not None:
                    _same_messages(conn, table, ids, message_ids, manifest["stem"])
                deleted += conn.execute(
                    sa.delete(table).where(table.c.id.in_(ids), table.c.status == OutboxStatus.PUBLISHED)
                ).rowcount
        return deleted
    by_group: dict[str, list[uuid.UUID]] = defaultdict(list)
    for group, message_id in keys:
        by_group[group].append(uuid.UUID(message_id))
    for group, ids in by_group.items():
        for start in range(0, len(ids), batch):
            with engine.begin() as conn:
                deleted += conn.execute(sa.delete(table).where(
                    table.c.consumer_group == group, table.c.message_id.in_(ids[start:start + batch])
                )).rowcount
    return deleted


def _same_messages(conn: sa.Connection, table: sa.Table, ids: list[int], message_ids: dict[int, str],
                   stem: str) -> None:
    """Raise unless every row of ``ids`` still in the table holds the message the archive holds."""
    found = conn.execute(sa.select(table.c.id, table.c.message_id).where(table.c.id.in_(ids))).all()
    strangers = [row.id for row in found if _canonical(row.message_id) != message_ids.get(row.id)]
    if strangers:
        raise ArchiveUnreadableError(
            f"chunk {stem} archived other messages than this database's rows {strangers[:3]} hold "
            f"({len(strangers)} rows): it is another database's chunk, in this archive directory; nothing "
            "of this chunk was deleted from the database (give each database an archive directory)")


def mark_done(root: Path, table: str, stem: str) -> None:
    write_atomically(manifest_dir(root, table) / f"{stem}.done", b"")
