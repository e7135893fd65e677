"""A throwaway PgBouncer in transaction mode in front of a test's PostgreSQL database.

The relay must not leave its session settings on a server connection that a
transaction-mode pooler hands to the next client (``outbox.relay._session``):
only a real pooler shows what that next client gets. ``OUTBOX_TEST_PGBOUNCER_URL``
may name one (in transaction mode, one server connection per pool, in front of
the test's PostgreSQL server: the test's database name replaces the URL's);
else one is started from Debian's ``pgbouncer`` (``OUTBOX_TEST_PGBOUNCER``: another
binary), as the ``postgres`` user when root (PgBouncer refuses root). No
container: the Debian binary is what ``scripts/setup`` installs. One server connection for all clients
(``default_pool_size = 1``), so that the client after the relay gets the
relay's server connection. No prepared statements across transactions
(PgBouncer before 1.21 has none): clients connect with ``prepare_threshold=None``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa

from outbox.testing import PortNotBound, Unavailable, free_port, wait_until_bound

ATTEMPTS = 3


def pgbouncer_binary() -> str | None:
    return os.environ.get("OUTBOX_TEST_PGBOUNCER") or shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)


@contextmanager
def transaction_pooler(database_url: str) -> Iterator[str]:
    """The URL of ``database_url``'s database through a PgBouncer in transaction mode."""
    url = sa.make_url(database_url)
    given = os.environ.get("OUTBOX_TEST_PGBOUNCER_URL")
    if given:
        yield sa.make_url(given).set(database=url.database).render_as_string(hide_password=False)
        return
    binary = pgbouncer_binary()
    if binary is None:
        raise Unavailable("pgbouncer not found (Debian's pgbouncer package; scripts/setup installs it)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
    if as_user:
        shutil.chown(root, "postgres")
    process: subprocess.Popen[bytes] | None = None
    try:
        (root / "users.txt").write_text(f'"{url.username}" ""\n')
        for attempt in range(1, ATTEMPTS + 1):
            port = free_port()
            (root / "pgbouncer.ini").write_text(
                "[databases]\n"
                f"* = host={url.host} port={url.port}\n"
                "[pgbouncer]\n"
                f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
                f"auth_type = trust\nauth_file = {root / 'users.txt'}\n"
                "pool_mode = transaction\ndefault_pool_size = 1\nmax_client_conn = 50\n"
                f"logfile = {root / 'log'}\n")
            started = subprocess.Popen([*as_user, binary, str(root / "pgbouncer.ini")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            process = started
            try:
                wait_until_bound(started.pid, port, "PgBouncer", timeout=20,
                                 alive=_running(started))
                break
            except PortNotBound as exc:
                _stop(process)
                process = None
                if attempt == ATTEMPTS or not exc.taken_by:
                    log = (root / "log").read_text(errors="replace")[-2000:] if (root / "log").exists() \
                        else ""
                    raise RuntimeError(f"pgbouncer did not listen on {port}: {exc}\n{log}") from None
        yield url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(root, ignore_errors=True)


def _running(process: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: process.poll() is None


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
