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

from ._ports import check_bound, free_port

PORT_ATTEMPTS = 3

# Durability off: tests want speed, and a crash of a throwaway cluster loses nothing.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}

LOGICAL_SETTINGS = {**FAST_SETTINGS, "wal_level": "logical", "max_replication_slots": "20",
                    "max_wal_senders": "20"}
"""A server Debezium can read: logical decoding on (``wal_level=logical``), room for a slot per
connector. The local server's ``postgres`` superuser may create slots and publications."""


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
        self._settings = dict(settings or {})
        try:
            _run([*self._as_user, str(bindir / "initdb"), "-D", str(self._data), "-U", "postgres",
                  "-A", "trust", "-E", "UTF8", "--no-sync"])
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self._use_port(free_port())
                try:
                    self.start()
                    break
                except RuntimeError:
                    # PostgreSQL fails (it never moves) when another process took the port after
                    # our pick: then again on a new one; any other failure is raised.
                    if attempt == PORT_ATTEMPTS or not self._lost_port_race():
                        raise
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise

    def _use_port(self, port: int) -> None:
        self.port = port
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(port),
            "unix_socket_directories": str(self._root),
            "max_connections": "200",
            **self._settings,
        }
        self._options = " ".join(f"-c {k}={v}" for k, v in options.items())
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    def _lost_port_race(self) -> bool:
        try:
            return "Address already in use" in (self._root / "log").read_text(errors="replace")
        except OSError:
            return False

    def start(self) -> None:
        """Start the server on its data directory and port; return once it holds the port.

        A port another process holds makes it fail, with the server's log in the error.
        """
        log = self._root / "log"
        start = log.stat().st_size if log.exists() else 0
        try:
            _run([*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self._data), "-l",
                  str(log), "-o", self._options, "-w", "-t", "60", "start"])
        except RuntimeError as exc:
            with open(log, "rb") as text:
                text.seek(start)
                tail = text.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{exc}\nits log:\n{tail}") from None
        check_bound(self._pids()[0], self.port, "PostgreSQL")

    def stop(self, mode: str = "fast") -> None:
        _run([*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self._data), "-m", mode,
              "-w", "stop"])

    def add_login(self, name: str, password: str) -> str:
        """A superuser ``name`` who must give ``password`` over TCP (everyone else is trusted);
        returns its URL. For tests of a password the server refuses."""
        admin = sa.create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with admin.connect() as conn:
            role = conn.dialect.identifier_preparer.quote(name)
            literal = "'" + password.replace("'", "''") + "'"  # DDL takes no bound parameters
            conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD {literal}")
        admin.dispose()
        hba = self._data / "pg_hba.conf"
        hba.write_text(f"host all {name} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        _run([*self._as_user, str(self._bindir / "pg_ctl"), "-D", str(self._data), "reload"])
        url = sa.make_url(self.url).set(username=name, password=password)
        return url.render_as_string(hide_password=False)

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
