"""``outbox.testing``'s port proofs: a server started on a picked port must be the one holding it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from outbox.testing import PortNotBound, free_port, wait_until_bound

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
