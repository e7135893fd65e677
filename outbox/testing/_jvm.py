"""What every JVM the test helpers start shares: its options, its launcher, and its end.

A broker node (``_kafka_node``) and a Kafka Connect worker (``_connect``) are
this process's children, started in a session of their own (a Ctrl-C in the
terminal reaches the tests, which stop them, not the JVMs directly). Every
running JVM is killed at interpreter exit (``atexit``); started from the main
thread it is also killed by the kernel when this process dies (``setpriv
--pdeathsig``), so a test process that is killed leaks no JVM.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Iterable
from pathlib import Path

HOST = "127.0.0.1"

# Kafka's own launcher (kafka-run-class.sh) uses G1 with these; the heap is the caller's.
JVM_OPTIONS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
               "-XX:+ExplicitGCInvokesConcurrent", "-XX:+ExitOnOutOfMemoryError", "-XX:-UsePerfData",
               "-Djava.awt.headless=true")
JVM_OPTIONS_ENV = "OUTBOX_TEST_JVM_OPTIONS"
"""More options for every JVM these helpers start (a broker node, a Connect worker), e.g.
``-XX:TieredStopAtLevel=1``: the test suite sets that one (tests/conftest.py), since its
brokers live seconds to minutes and the optimising compiler's warm-up is most of their CPU;
benchmarks leave it unset and race JVMs as they run in production."""


def jvm_options() -> tuple[str, ...]:
    """``JVM_OPTIONS`` and then those of ``OUTBOX_TEST_JVM_OPTIONS`` (split as a shell would)."""
    return (*JVM_OPTIONS, *shlex.split(os.environ.get(JVM_OPTIONS_ENV, "")))

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
"""
"""A log4j2 configuration writing everything of INFO and above to one file (``{log}``)."""

_running: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_running):
        with contextlib.suppress(OSError):
            process.kill()


def launcher() -> list[str]:
    """``setpriv --pdeathsig KILL`` where it works: the kernel kills the JVM when its parent *thread*
    ends, so only from the main thread (a JVM started by a worker thread must outlive that thread)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "KILL"]


def started(process: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Remember ``process`` to kill at interpreter exit; returns it."""
    _running.add(process)
    return process


def ended(process: subprocess.Popen[bytes]) -> None:
    """``process`` was stopped or killed: nothing to kill at exit."""
    _running.discard(process)


def terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM (the JVM's controlled shutdown), SIGKILL if it has not ended after ``timeout`` s."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    ended(process)


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL unless it has ended already; waited for, so no zombie is left."""
    if process.poll() is None:
        process.kill()
    process.wait()
    ended(process)


# -- what a JVM's logs say, for its owner and for error messages ----------------------------------

def log_since(path: Path, start: int) -> str:
    """The log at ``path`` from byte ``start`` on (what the JVM wrote since its last launch)."""
    try:
        with open(path, "rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def first_error(text: str) -> str:
    """A log4j log's first ERROR line and the line after it (the exception), or ""."""
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if "] ERROR " in line:
            return "\n".join(lines[n:n + 2])
    return ""


def tail(paths: Iterable[Path], lines: int) -> str:
    """The last ``lines`` of each of ``paths`` that exists, each under its name; "(no output)" if none."""
    parts = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            if text:
                parts.append(f"--- {path} ---\n" + "\n".join(text))
    return "\n".join(parts) or "(no output)"
