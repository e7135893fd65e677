"""Where the archive keeps data, manifests and markers, and which files are committed.

    {root}/{table}/topic={topic}/date={yyyy-mm-dd}/{stem}.parquet
    {root}/_manifests/{table}/{stem}.json   # commit point: files and keys of one chunk
    {root}/_manifests/{table}/{stem}.done   # its rows are deleted from the database
    {root}/_manifests/{table}/origin        # whose rows: the database's incarnation (``_archive``)

A data file counts only when a manifest with its stem exists; anything else
under the table directory is debris from a killed run and is removed before
the next run starts. The directory must be on a file system with atomic
rename (local disk, NFS, HDFS mounted through FUSE), shared by driver and
executors on a cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MANIFESTS = "_manifests"


def table_dir(root: Path, table: str) -> Path:
    return root / table


def manifest_dir(root: Path, table: str) -> Path:
    return root / MANIFESTS / table


def origin_file(root: Path, table: str) -> Path:
    """Where the incarnation of the database whose ``table`` is archived under ``root`` is kept."""
    return manifest_dir(root, table) / "origin"


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` so that it either exists complete or not at all, even after SIGKILL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (the entry, not just the file, hits the disk)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_stems(root: Path, table: str) -> set[str]:
    directory = manifest_dir(root, table)
    if not directory.is_dir():
        return set()
    return {p.stem for p in directory.glob("*.json")}


def unfinished_manifests(root: Path, table: str) -> list[dict[str, Any]]:
    """Committed chunks whose rows may still be in the database (no ``.done`` marker)."""
    directory = manifest_dir(root, table)
    if not directory.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))
            if not p.with_suffix(".done").exists()]


def committed_files(root: Path, table: str) -> list[Path]:
    """Every data file of a committed chunk, the only files readers should look at."""
    directory = manifest_dir(root, table)
    if not directory.is_dir():
        return []
    files = []
    for manifest in sorted(directory.glob("*.json")):
        files += [root / f["path"] for f in json.loads(manifest.read_text())["files"]]
    return files


def remove_debris(root: Path, table: str) -> int:
    """Delete data and temp files no manifest commits (left by a killed run); return the count."""
    directory = table_dir(root, table)
    if not directory.is_dir():
        return 0
    committed = committed_stems(root, table)
    removed = 0
    for path in directory.rglob("*"):
        if path.is_file() and (path.name.endswith(".tmp") or path.name.split(".")[0] not in committed):
            path.unlink()
            removed += 1
    for path in manifest_dir(root, table).glob("*.tmp") if manifest_dir(root, table).is_dir() else []:
        path.unlink()
    return removed
