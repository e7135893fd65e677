"""A throwaway MariaDB server from the local binaries (Debian's ``mariadb-server``), for tests.

The same shape as ``_postgres``: a temp directory, a free port, the server run
as the ``mysql`` user when we are root (mariadbd refuses root), its unix socket
inside the temp directory, stopped and removed after.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

from ._ports import PortNotBound, free_port, wait_until_bound

PORT_ATTEMPTS = 3

# Durability off: tests want speed, and a crash of a throwaway server loses nothing.
# The isolation level (InnoDB's REPEATABLE READ) and the collation (case-insensitive)
# are left at the server's defaults on purpose: the library must be correct there, as
# on the servers users have (docs/producer.md, "MySQL and MariaDB").
FAST_OPTIONS = ("--innodb-flush-log-at-trx-commit=0", "--sync-binlog=0", "--innodb-doublewrite=0")
_OPTIONS = ("--skip-log-bin", "--innodb-buffer-pool-size=256M", "--max-connections=300",
            "--skip-name-resolve", "--character-set-server=utf8mb4")


DRIVER_VARIABLE = "OUTBOX_TEST_MYSQL_DRIVER"


def sync_driver() -> str:
    """The sync driver the test bed uses: mysqlclient (C) when installed, else PyMySQL.

    mysqlclient decodes rows in C, several times faster than pure-Python PyMySQL
    (the relay's fetch of 5,000 rows: 0.12 s against 0.42 s); docs/producer.md.
    ``OUTBOX_TEST_MYSQL_DRIVER=pymysql`` (or ``mysqldb``) chooses one.
    """
    if chosen := os.environ.get(DRIVER_VARIABLE):
        return chosen
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        return "pymysql"
    return "mysqldb"


def mariadb_binaries() -> tuple[Path, Path] | None:
    """(mariadbd, mariadb-install-db) from PATH or Debian's layout, or None."""
    server = shutil.which("mariadbd") or next(
        (p for p in ("/usr/sbin/mariadbd", "/usr/sbin/mysqld") if os.path.exists(p)), None)
    install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
    if server is None or install is None:
        return None
    return Path(server), Path(install)


class LocalMariaDB:
    """A throwaway MariaDB in a temp dir on a free port, that a test can stop and start again.

    ``url`` names its empty database ``outbox`` and logs in as ``root`` over
    TCP without a password, allowed to create more (the datadir was
    made with ``--auth-root-authentication-method=normal`` and an empty
    password): only processes on this machine reach 127.0.0.1. ``durable``
    keeps InnoDB's flush at every commit (benchmarks); tests turn it off.
    ``options`` are more server options (``--lower-case-table-names=1``).
    """

    def __init__(self, *, durable: bool = False, options: Sequence[str] = ()) -> None:
        found = mariadb_binaries()
        self._options = (*(_OPTIONS if durable else (*_OPTIONS, *FAST_OPTIONS)), *options)
        if found is None:
            raise FileNotFoundError("MariaDB binaries (mariadbd, mariadb-install-db) not found")
        self._server, install = found
        self._as_user = ["runuser", "-u", "mysql", "--"] if os.geteuid() == 0 else []
        self._root = Path(tempfile.mkdtemp(prefix="outbox-mariadb-"))
        self._data = self._root / "data"
        self._socket = self._root / "mysqld.sock"
        # A temp dir of its own: servers bootstrapped at once (one per xdist worker) share no /tmp.
        self._tmp = self._root / "tmp"
        self._tmp.mkdir()
        if self._as_user:
            shutil.chown(self._root, "mysql")
            shutil.chown(self._tmp, "mysql")
        self._process: subprocess.Popen[bytes] | None = None
        try:
            self._install(install)
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self._use_port(free_port())
                try:
                    self.start()
                    break
                except PortNotBound as exc:
                    # Another process took the port after our pick (mariadbd fails, never moves):
                    # again on a new one; any other failure is raised.
                    self.stop()
                    if attempt == PORT_ATTEMPTS or not (exc.taken_by or self._lost_port_race()):
                        raise
            admin = sa.create_engine(self._admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
            with admin.connect() as conn:
                conn.execute(sa.text("CREATE DATABASE outbox CHARACTER SET utf8mb4"))
            admin.dispose()
        except BaseException:
            self.remove()
            raise

    def _use_port(self, port: int) -> None:
        self.port = port
        driver = sync_driver()
        self._admin_url = f"mysql+{driver}://root@127.0.0.1:{port}/mysql?charset=utf8mb4"
        self.url = f"mysql+{driver}://root@127.0.0.1:{port}/outbox?charset=utf8mb4"

    def _lost_port_race(self) -> bool:
        try:
            log = (self._root / "log").read_text(errors="replace")
        except OSError:
            return False
        return "Address already in use" in log or "Bind on TCP/IP port" in log

    def _install(self, install: Path) -> None:
        """Make the datadir; once more from scratch if the bootstrap fails.

        Three bootstraps started in the same second (one per xdist worker) once
        failed on ``Unknown table 'mysql.tmp_proxies_priv'``: one worker then had
        no MariaDB for the whole session, 149 tests in error. A second bootstrap
        on a clean datadir is the server's set-up, not a test's subject; a
        second failure is raised.
        """
        command = [*self._as_user, str(install), "--no-defaults", f"--datadir={self._data}",
                   f"--tmpdir={self._tmp}", "--auth-root-authentication-method=normal", "--skip-test-db",
                   "--skip-name-resolve"]
        try:
            _run(command)
        except RuntimeError:
            shutil.rmtree(self._data, ignore_errors=True)
            _run(command)

    def start(self) -> None:
        """Start the server on the same datadir and port; return once it accepts connections.

        Not before it holds the port: a probe of a port that another worker's MariaDB took
        after our pick would be answered by that server (same root, no password) while ours
        failed to bind; ``PortNotBound`` (with the log) says so instead.
        """
        log = open(self._root / "log", "ab")  # noqa: SIM115 - the server writes it while it runs
        self._process = subprocess.Popen(
            [*self._as_user, str(self._server), "--no-defaults", f"--datadir={self._data}",
             f"--port={self.port}", "--bind-address=127.0.0.1", f"--socket={self._socket}",
             f"--pid-file={self._root / 'mariadbd.pid'}", f"--tmpdir={self._tmp}", *self._options],
            stdout=log, stderr=log, cwd="/",
        )
        log.close()
        deadline = time.monotonic() + 60
        process = self._process
        try:
            wait_until_bound(process.pid, self.port, "mariadbd", timeout=60,
                             alive=lambda: process.poll() is None)
        except PortNotBound as exc:
            tail = (self._root / "log").read_text(errors="replace")[-2000:]
            raise PortNotBound(f"{exc}:\n{tail}", taken_by=exc.taken_by) from None
        engine = sa.create_engine(self._admin_url, poolclass=sa.NullPool)
        try:
            while True:
                try:
                    with engine.connect():
                        return
                except sa.exc.OperationalError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"mariadbd did not start:\n{(self._root / 'log').read_text()}") from None
                    time.sleep(0.1)
        finally:
            engine.dispose()

    def add_login(self, name: str, password: str) -> str:
        """A user ``name`` with every privilege and ``password``; returns its URL (``url``'s database)."""
        admin = sa.create_engine(self._admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text("CREATE USER :name@'127.0.0.1' IDENTIFIED BY :pw"),
                         {"name": name, "pw": password})
            conn.execute(sa.text("GRANT ALL ON *.* TO :name@'127.0.0.1'"), {"name": name})
        admin.dispose()
        url = sa.make_url(self.url).set(username=name, password=password)
        return url.render_as_string(hide_password=False)

    def freeze(self) -> None:
        """SIGSTOP the server: connections stay open and nothing answers, as with a hung host or a
        network partition. ``thaw()`` lets it go on."""
        os.kill(self._pid(), signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self._pid(), signal.SIGCONT)
        if self._process is not None:  # runuser stops itself when its child stops: it must go on too,
            os.kill(self._process.pid, signal.SIGCONT)  # or it never passes on stop()'s SIGTERM

    def _pid(self) -> int:
        return int((self._root / "mariadbd.pid").read_text().split()[0])

    def stop(self) -> None:
        """Shut the server down as an operator would (SIGTERM: a clean shutdown) and wait."""
        if self._process is not None and self._process.poll() is None:
            try:  # to the server itself: runuser, just continued after a freeze, may miss it
                os.kill(self._pid(), signal.SIGTERM)
            except (OSError, ValueError):
                self._process.terminate()  # runuser forwards it to mariadbd
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def remove(self) -> None:
        """Stop the server if it runs and delete its directory."""
        self.stop()
        shutil.rmtree(self._root, ignore_errors=True)


@contextmanager
def local_mariadb(*, durable: bool = False) -> Iterator[str]:
    """Run a new MariaDB in a temp dir on a free port; yield its SQLAlchemy URL; remove it after."""
    server = LocalMariaDB(durable=durable)
    try:
        yield server.url
    finally:
        server.remove()


@contextmanager
def fresh_mysql_database(server_url: str) -> Iterator[str]:
    """Create an empty database on the MySQL/MariaDB server at ``server_url``; yield its URL; drop it."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    try:
        yield sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
