"""A throwaway PostgreSQL server from the local binaries, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

from ._ports import free_port

# Durability off: tests want speed, and a crash of a throwaway cluster loses nothing.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def postgres_bindir() -> Path | None:
    """The directory holding initdb/pg_ctl: PATH first, then Debian's layout."""
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(found[0]).parent if found else None


class LocalPostgres:
    """A throwaway cluster in a temp dir on a free port, that a test can stop and start again.

    As root, the server runs as the ``postgres`` user (initdb refuses root).
    ``stop()`` shuts it down like an operator would (``pg_ctl stop -m fast``);
    ``start()`` brings it back on the same data directory and port, so the URL
    stays valid: what a database restart looks like to a client.
    """

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise FileNotFoundError("PostgreSQL binaries (initdb, pg_ctl) not found")
        self._bindir = bindir
        self._as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self._root = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        self._data = self._root / "data"
        if self._as_user:
            shutil.chown(self._root, "postgres")
        self.port = free_port()
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self._root),
            "max_connections": "200",
            **(settings or {}),
        }
        self._options = " ".join(f"-c {k}={v}" for k, v in options.items())
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        try:
            _run([*self._as_user, str(bindir / "initdb"), "-D", str(self._data), "-U", "postgres",
                  "-A", "trust", "-E", "UTF8", "--no-sync"])
            self.start()
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise

    def start(self) -> None:
        _run([*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self._data), "-l",
              str(self._root / "log"), "-o", self._options, "-w", "-t", "60", "start"])

    def stop(self, mode: str = "fast") -> None:
        _run([*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self._data), "-m", mode,
              "-w", "stop"])

    def freeze(self) -> None:
        """SIGSTOP the server and every process of it: connections stay open and nothing answers,
        as with a hung host or a network partition. ``thaw()`` lets it go on."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):  # a backend that ended meanwhile
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _pids(self) -> list[int]:
        """The postmaster, then its children (read from /proc)."""
        master = int((self._data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            if int(fields[1]) == master:
                children.append(int(stat.parent.name))
        return [master, *children]

    def remove(self) -> None:
        """Stop the server if it runs and delete its directory."""
        _run([*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self._data), "-m", "immediate",
              "-w", "stop"], check=False)
        shutil.rmtree(self._root, ignore_errors=True)


@contextmanager
def local_postgres(settings: Mapping[str, str] | None = None) -> Iterator[str]:
    """Run a new cluster in a temp dir on a free port; yield its SQLAlchemy URL.

    The cluster is stopped and its directory removed when the context exits.
    """
    with local_postgres_server(settings) as server:
        yield server.url


@contextmanager
def local_postgres_server(settings: Mapping[str, str] | None = None) -> Iterator[LocalPostgres]:
    """``local_postgres``, yielding the server itself, to stop and start it mid-test."""
    server = LocalPostgres(settings)
    try:
        yield server
    finally:
        server.remove()


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
