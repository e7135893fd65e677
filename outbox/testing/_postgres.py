"""A throwaway PostgreSQL server from the local binaries, for tests and benchmarks."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

# Durability off: tests want speed, and a crash of a throwaway cluster loses nothing.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def postgres_bindir() -> Path | None:
    """The directory holding initdb/pg_ctl: PATH first, then Debian's layout."""
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(found[0]).parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_postgres(settings: Mapping[str, str] | None = None) -> Iterator[str]:
    """Run a new cluster in a temp dir on a free port; yield its SQLAlchemy URL.

    As root, the server runs as the ``postgres`` user (initdb refuses root).
    The cluster is stopped and its directory removed when the context exits.
    """
    bindir = postgres_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL binaries (initdb, pg_ctl) not found")
    as_user: list[str] = []
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
    data = root / "data"
    if as_user:
        shutil.chown(root, "postgres")
    port = free_port()
    options = {
        "listen_addresses": "127.0.0.1",
        "port": str(port),
        "unix_socket_directories": str(root),
        "max_connections": "200",
        **(settings or {}),
    }
    opts = " ".join(f"-c {k}={v}" for k, v in options.items())
    try:
        _run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "postgres",
              "-A", "trust", "-E", "UTF8", "--no-sync"])
        _run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"),
              "-o", opts, "-w", "-t", "60", "start"])
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        finally:
            _run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                  "-w", "stop"], check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """Create an empty database on the server at ``server_url``; yield its URL; drop it after."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _run(cmd: list[str], *, check: bool = True) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
