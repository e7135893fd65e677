"""docs/getting-started.md followed as a newcomer would: its code, its commands, only the project's own.

Step 2's code publishes invoice 1; ``outbox dev-broker``, the relay command and
the ``inbox run`` command are taken from the page's console blocks and run as
real processes, in a scratch directory, until the consumer prints the invoice.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "getting-started.md").read_text()


def _shown(prefix: str) -> list[str]:
    """The first ``$ outbox …`` line of the page that starts with ``prefix``, as argv after ``outbox``."""
    for line in re.findall(r"^\$ (outbox .*)$", PAGE, re.M):
        if line.startswith(prefix):
            return shlex.split(line, comments=True)[1:]
    raise AssertionError(f"getting-started.md shows no `{prefix}` command")


class Process:
    """A command of the page, its stdout lines read by a thread (a silent one cannot block the test)."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "outbox", *args], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        stdout = self.popen.stdout
        assert stdout is not None
        threading.Thread(target=lambda: [self.lines.put(x) for x in iter(stdout.readline, "")],
                         daemon=True).start()

    def wait_for(self, pattern: str, seconds: float) -> re.Match[str]:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"no {pattern!r} within {seconds} s: {''.join(self.seen)[-3000:]}")

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise


@pytest.mark.slow
@pytest.mark.any_kafka
def test_a_newcomer_reaches_a_working_relay_and_consumer(tmp_path):
    step2, step4 = re.findall(r"^```python\n(.*?)^```", PAGE, re.S | re.M)[:2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    env.pop("OUTBOX_BOOTSTRAP_SERVERS", None)
    subprocess.run([sys.executable, "-c", step2], cwd=tmp_path, env=env, check=True, timeout=60)
    (tmp_path / "getting_started_billing.py").write_text(step4)

    started: list[Process] = []
    try:
        broker = Process(_shown("outbox dev-broker"), tmp_path, env)
        started.append(broker)
        servers = broker.wait_for(r"export OUTBOX_BOOTSTRAP_SERVERS=(\S+)", 30).group(1)
        env["OUTBOX_BOOTSTRAP_SERVERS"] = servers  # the page's `export` line
        started.append(Process(_shown("outbox relay --db sqlite:"), tmp_path, env))
        consumer = Process(_shown("outbox inbox run"), tmp_path, env)
        started.append(consumer)
        consumer.wait_for(r"^invoice 1$", 60)
    finally:
        codes = [p.stop() for p in reversed(started)]  # consumer, relay, then the broker
    assert codes == [0, 0, 0], [p.seen for p in started]
