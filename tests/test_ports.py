"""``outbox.testing``'s port proofs: a server started on a picked port must be the one holding it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from conftest import unavailable

from outbox.testing import LocalMariaDB, LocalPostgres, PortNotBound, free_port, wait_until_bound

LISTEN = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(60)
"""

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="the proofs read Linux's /proc")


def listener(port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "listening"
    return process


def test_the_holder_of_a_port_and_its_parent_pass() -> None:
    port = free_port()
    holder = listener(port)
    try:
        wait_until_bound(holder.pid, port, "the listener", timeout=5)
        # A launcher (runuser, setpriv, pg_ctl's postmaster) holds what its child holds.
        wait_until_bound(os.getpid(), port, "the listener's parent", timeout=5)
    finally:
        holder.kill()
        holder.wait()


def test_a_server_whose_port_someone_else_took_is_refused_at_once_naming_the_holder() -> None:
    port = free_port()
    taker = listener(port)
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        with pytest.raises(PortNotBound, match=rf"given port {port}, which pid {taker.pid} \("):
            wait_until_bound(ours.pid, port, "our server", timeout=30)
        assert time.monotonic() - started < 5, "another holder is an answer, not a reason to wait"
    finally:
        for process in (taker, ours):
            process.kill()
            process.wait()


def test_a_server_that_ends_or_never_listens_is_refused() -> None:
    port = free_port()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    with pytest.raises(PortNotBound, match="ended without listening"):
        wait_until_bound(ended.pid, port, "our server", timeout=30, alive=lambda: ended.poll() is None)
    with pytest.raises(PortNotBound, match="did not listen on port"):
        wait_until_bound(os.getpid(), port, "our server", timeout=0.3)


def taken_first(monkeypatch: pytest.MonkeyPatch, module: str) -> socket.socket:
    """Make ``module``'s first ``free_port()`` a port another process (this one) listens on."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    picks = iter([held.getsockname()[1]])
    monkeypatch.setattr(f"{module}.free_port", lambda: next(picks, None) or free_port())
    return held


SERVERS = {"postgres": ("outbox.testing._postgres", LocalPostgres, "SHOW port"),
           "mariadb": ("outbox.testing._mariadb", LocalMariaDB, "SELECT @@port")}


@pytest.mark.parametrize("kind", [pytest.param("postgres", marks=pytest.mark.postgres),
                                  pytest.param("mariadb", marks=pytest.mark.mysql)])
def test_a_database_whose_picked_port_was_taken_starts_on_another(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """PostgreSQL and MariaDB fail rather than move when their port is taken (and MariaDB's
    readiness probe was answered by whoever held it): the first start tries a new port."""
    module, server_class, port_query = SERVERS[kind]
    held = taken_first(monkeypatch, module)
    try:
        try:
            server = server_class()
        except FileNotFoundError as exc:
            unavailable(str(exc))
        try:
            assert server.port != held.getsockname()[1]
            engine = sa.create_engine(server.url, poolclass=sa.NullPool)
            with engine.connect() as conn:
                assert str(conn.execute(sa.text(port_query)).scalar()) == str(server.port)
            engine.dispose()
        finally:
            server.remove()
    finally:
        held.close()
