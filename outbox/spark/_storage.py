"""Where the jobs' files live: an absolute path that the driver and every executor see alike.

The archive's chunks and the audit's Parquet lists are written by Spark
tasks, which run in the executors' working directories, on other machines
when the master is not ``local``. A relative path would name a directory
inside each executor's scratch space, and a local disk of the driver is
simply not there for a remote executor: the job would succeed and the driver
would find nothing. So paths are made absolute here, on the driver, and a
non-local master needs the user's word (``shared_storage=True``,
``--shared-storage``) that the path is one file system mounted at the same
place on every node. The archive then still reads each chunk back on the
driver before deleting anything (``_chunks.verify``), so a false declaration
costs a failed run, never rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from ..core._errors import ConfigurationError

SHARED_FLAG = "--shared-storage"


def local_path(value: str | os.PathLike[str], what: str) -> Path:
    """``value`` (a path or a ``file:`` URI) as an absolute path, resolved against this process's cwd."""
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigurationError(f"{what} must be a non-empty path, got {value!r}")
    text = os.fspath(value)
    scheme = urlparse(text).scheme
    if scheme == "file":
        text = urlparse(text).path
    elif len(scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise ConfigurationError(
            f"{what} {text!r}: only file system paths are supported (a local disk, or NFS/HDFS "
            "mounted at the same path on every node), not {scheme}:// URIs"
        )
    return Path(os.path.abspath(text))


def uri(path: Path) -> str:
    """The ``file://`` URI Spark's readers and writers get, so no node resolves it differently.

    Not ``Path.as_uri()``: Hadoop does not decode its percent-escapes (``topic%3Dorders``).
    """
    return f"file://{path}"


def require_shared(session: SparkSession, path: Path, what: str, shared: bool) -> None:
    """Refuse a path the executors may not share with the driver, unless the user vouches for it."""
    master = session.sparkContext.master or ""
    if shared or master.startswith("local"):
        return
    raise ConfigurationError(
        f"{what} {path} is a path on this machine, but master {master} runs executors elsewhere, "
        "which would write to (or read from) their own disks. Use a directory every node mounts "
        f"at the same path (NFS, a FUSE-mounted HDFS …) and say so with {SHARED_FLAG} "
        "(shared_storage=True)."
    )
