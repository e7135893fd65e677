"""The suite fails a test that leaves a worker's loop running after it (tests/_loops_left.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import threading
import time


def loop(name, seconds):
    thread = threading.Thread(target=time.sleep, args=(seconds,), name=name, daemon=True)
    thread.start()


def test_a_relay_loop_left_running():
    loop("outbox-relay-loop", 60)


def test_a_fleet_worker_left_running():
    loop("outbox-relay-worker-3", 60)


def test_a_loop_that_ends_within_the_grace():
    loop("outbox-inbox-consumer", 0.3)


def test_another_thread_left_running():
    loop("outbox-inbox-loop", 60)  # an engine's event loop, not a worker's: it calls no broker
'''


def test_a_worker_loop_left_running_after_its_test_fails_that_test_naming_the_thread(tmp_path: Path) -> None:
    (tmp_path / "test_leaving.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text("import _loops_left\n_loops_left.GRACE = 1.0\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_loops_left", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-rA", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
             "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))})
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    errors = sorted(line for line in out.splitlines() if line.startswith("ERROR test_leaving.py"))
    assert [e.split(" - ")[0] for e in errors] == [
        "ERROR test_leaving.py::test_a_fleet_worker_left_running",
        "ERROR test_leaving.py::test_a_relay_loop_left_running"], out[-3000:]
    assert "outbox-relay-loop:\n" in out and "outbox-relay-worker-3:\n" in out, out[-3000:]
    assert "still run 1 s after its teardown" in out, out[-3000:]
    assert "4 passed, 2 errors" in out, out[-3000:]
