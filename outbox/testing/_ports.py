"""Free ports, and the proof that a server we started holds the port we gave it.

A port picked free is only free until someone binds it: another xdist worker
can take it between our pick and the server's bind. Most servers then fail
(PostgreSQL, MariaDB, Kafka, uvicorn), some silently move to the next port
(Spark's web UI), and in both cases a readiness probe on the picked port may
be answered by the *other* worker's server. So a server started on a picked
port is not ready until the listening socket on that port is shown to belong
to its process: Linux's ``/proc/net/tcp`` names the socket, ``/proc/PID/fd``
who holds it. Where ``/proc`` cannot tell (another OS), the check is skipped
and the caller's identity check (the server's own answer) has to do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


class PortNotBound(RuntimeError):
    """The server we started does not hold the port it was given (someone else does, or nobody).

    ``taken_by`` holds the processes that hold it instead (empty when nobody does or we may not
    see who): a first start may then try again on another port.
    """

    def __init__(self, message: str, taken_by: set[int] | frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.taken_by = frozenset(taken_by)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see the module doc for what that is worth)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago: each is held until all
    are picked. ``free_port`` twice can give the same port twice (the kernel hands out a port just
    closed again), and a Kafka node then got its broker and controller listeners on one port
    (refused at its format: "two listeners on the same port")."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def _listening_inodes(port: int) -> set[int] | None:
    """Inodes of the sockets listening on ``port`` (any local address), or None without ``/proc``."""
    inodes: set[int] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes if readable else None


def _sockets_of(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (empty if it ended or is not ours to read)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (a launcher such as ``runuser`` and the server it started)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in tree:
            tree.add(current)
            todo.extend(children.get(current, ()))
    return tree


def listeners(port: int) -> set[int] | None:
    """The processes (that we may look at) holding a listening socket on ``port``; None without ``/proc``."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    holders = set()
    if inodes:
        for entry in Path("/proc").glob("[0-9]*"):
            if _sockets_of(int(entry.name)) & inodes:
                holders.add(int(entry.name))
    return holders


def _describe(pids: set[int]) -> str:
    if not pids:
        return "nobody (or a process we may not look at)"
    names = []
    for pid in sorted(pids):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            command = "?"
        names.append(f"pid {pid} ({command[:120].strip()})")
    return ", ".join(names)


def holds_port(pid: int, port: int) -> bool | None:
    """Whether ``pid`` (or a descendant) holds the listening socket on ``port``; None without ``/proc``."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    return any(_sockets_of(p) & inodes for p in process_tree(pid))


def check_bound(pid: int, port: int, what: str) -> None:
    """Raise ``PortNotBound`` unless process ``pid`` (or a child) listens on ``port`` now."""
    if holds_port(pid, port) is False:
        others = (listeners(port) or set()) - process_tree(pid)
        raise PortNotBound(f"{what} (pid {pid}) does not hold port {port}: it is held by "
                           f"{_describe(others)}", taken_by=others)


def wait_until_bound(pid: int, port: int, what: str, *, timeout: float = 60.0,
                     alive: Callable[[], bool] | None = None) -> None:
    """Wait until process ``pid`` (or a child) listens on ``port``; raise ``PortNotBound`` when another
    process holds it, the process ended (``alive()`` false) or ``timeout`` seconds passed.

    For a server started on a picked port before anything talks to it: a probe of the port
    would otherwise be answered by whoever took the port first.
    """
    deadline = time.monotonic() + timeout
    while True:
        mine = holds_port(pid, port)
        if mine is None or mine:
            return
        others = (listeners(port) or set()) - process_tree(pid)
        if others:
            raise PortNotBound(f"{what} (pid {pid}) was given port {port}, which {_describe(others)} holds",
                               taken_by=others)
        if alive is not None and not alive():
            raise PortNotBound(f"{what} (pid {pid}) ended without listening on port {port}")
        if time.monotonic() > deadline:
            raise PortNotBound(f"{what} (pid {pid}) did not listen on port {port} within {timeout:.0f} s")
        time.sleep(0.1)
