"""A worker that dies of a signal (a segfault, an abort in a C library) says where, at the run's end.

A crash in a C extension kills a pytest-xdist worker: its faulthandler dump goes to the
worker's stderr, in the middle of the run's output, and names Python frames only; CI keeps
the end of the output. Twice (2026-11-30 and 2026-12-02) all that reached us was the tail of
one thread's stack. So each worker writes its faulthandler dump to a file of its own and may
leave a core (its soft core limit raised to the hard one), and the controller prints, last
before the short summary: the whole dump, then the fatal error, the crashing thread's native
stack when ``gdb`` and the core are there (which library), and the top of its Python stack.
``tests/conftest.py`` registers it; a module of its own so that a test can load it alone
(``-p _crash_report``, ``tests/test_xdist_groups.py``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import pytest

DIRECTORY_VARIABLE = "OUTBOX_CRASH_DIR"
"""Where the workers of this run write their dumps; set by the controller before they start."""

CORE_LIMIT = 8 << 30
"""Bytes of a worker's core at most: its own memory is under a gigabyte or two; the servers it
starts inherit the limit, and a crashed JVM is not to fill the disk."""

_dump: IO[str] | None = None


def worker_id(config: pytest.Config) -> str | None:
    """The xdist worker's id ("gw0"), None in a controller or a run without xdist; by what xdist gave
    the worker (``workerinput``), not by ``PYTEST_XDIST_WORKER``: a run started by a test inside a
    worker inherits that variable and is a controller all the same."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


def pytest_configure(config: pytest.Config) -> None:
    """The controller of an xdist run: a directory for its workers' dumps (its own, even when
    it runs inside a worker of another run)."""
    if worker_id(config) is None and getattr(config.option, "numprocesses", None):
        os.environ[DIRECTORY_VARIABLE] = tempfile.mkdtemp(prefix="outbox-crash-")


def pytest_sessionstart(session: pytest.Session) -> None:
    """A worker: faulthandler to its file (after pytest's own plugin pointed it at stderr), and a
    core when it dies (up to ``CORE_LIMIT``)."""
    global _dump
    directory = os.environ.get(DIRECTORY_VARIABLE)
    worker = worker_id(session.config)
    if worker is None or directory is None:
        return
    _dump = open(Path(directory, f"{worker}.txt"), "w")  # noqa: SIM115 (open while the worker lives)
    Path(directory, f"{worker}.where").write_text(f"{os.getpid()}\n{os.getcwd()}\n")
    faulthandler.enable(file=_dump, all_threads=True)
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    soft = CORE_LIMIT if hard == resource.RLIM_INFINITY else min(hard, CORE_LIMIT)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = os.environ.get(DIRECTORY_VARIABLE)
    if worker_id(config) is None and directory and Path(directory).is_dir():
        shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after the durations; the short summary still comes after
def pytest_terminal_summary(terminalreporter: Any) -> None:
    directory = os.environ.get(DIRECTORY_VARIABLE)
    if worker_id(terminalreporter.config) is not None or directory is None or not Path(directory).is_dir():
        return
    for dump in sorted(Path(directory).glob("*.txt")):
        text = dump.read_text(errors="replace")
        if "Fatal Python error" not in text:
            continue
        worker = dump.stem
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", f"worker {worker} died: its faulthandler dump")
        write(text.rstrip())
        terminalreporter.write_sep("=", f"worker {worker} died: where")
        fatal, *python = crashing_thread(text)
        for line in [fatal, *native_stack(Path(directory, f"{worker}.where")), *python[:13]]:
            write(line)


def crashing_thread(dump: str) -> list[str]:
    """The fatal error's line and the Python stack of the thread that received the signal."""
    lines = dump.splitlines()
    fatal = next((line for line in lines if line.startswith("Fatal Python error")), "Fatal Python error")
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    if start is None:
        return [fatal]
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return [fatal, *lines[start:end]]


def native_stack(where: Path) -> list[str]:
    """The crashing thread's C stack from the worker's core, read with gdb; why not, if it cannot."""
    try:
        pid, cwd = where.read_text().split("\n")[:2]
    except (OSError, ValueError):
        return ["no native stack: the worker did not say where it ran"]
    gdb = shutil.which("gdb")
    cores = [path for name in (f"core.{pid}", "core") if (path := Path(cwd, name)).is_file()]
    if not cores:
        return [f"no native stack: no core file in {cwd} (its core_pattern or limit kept it)"]
    if gdb is None:
        return [f"no native stack: no gdb to read {cores[0]}"]
    core = cores[0]
    try:
        run = subprocess.run([gdb, "-batch", "-nx", "-ex", "info inferiors", "-ex", "bt 16", sys.executable,
                              str(core)], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return ["no native stack: gdb took over 180 s"]
    if not re.search(rf"\bprocess {pid}\b", run.stdout):  # a core left by another process (a child)
        return [f"no native stack: {core} is not the worker's (pid {pid})"]
    core.unlink(missing_ok=True)  # a worker's core is as large as its memory
    frames = [line[:240] for line in run.stdout.splitlines() if re.match(r"#\d+ ", line)]
    if not frames:
        return ["no native stack: gdb read nothing from the core", *run.stderr.splitlines()[-5:]]
    return ["native stack of the crashing thread (gdb):", *frames]
