"""``--dist loadgroup`` keeps a group's tests on one worker (``tests/_xdist_groups.py``).

Under pytest 9 pytest-xdist's own rename of a grouped test (``ID@GROUP``) is lost and every
test of a group goes to whichever worker is free: this runs a small grouped module on two
workers with that hook as a plugin and reads from ``-v`` where each test ran.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GROUPED = '''
import time

import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("n", range(6))
def test_grouped(n):
    time.sleep(0.2)


@pytest.mark.parametrize("n", range(6))
def test_free(n):
    time.sleep(0.2)
'''


@pytest.mark.slow
def test_the_tests_of_a_group_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_xdist_groups", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "-v", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        # Only this plugin: PYTEST_ADDOPTS may name plugins of the outer run's own (its -p ...).
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
             "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED \S+::test_(grouped|free)\[\d\](@together)?", run.stdout)
    grouped = [(worker, suffix) for worker, name, suffix in ran if name == "grouped"]
    assert len(grouped) == 6 and len(ran) == 12, run.stdout[-3000:]
    assert {suffix for _, suffix in grouped} == {"@together"}, grouped
    assert len({worker for worker, _ in grouped}) == 1, f"the group ran on several workers: {grouped}"


CRASHING = '''
import os
import shutil


def test_first():
    pass


def test_crash():
    os.abort()  # what a segfault in a C extension does to a worker


def test_after():
    pass
'''


def no_core_files() -> None:
    """A child's abort leaves no core in the repository (the suite's workers may; _crash_report)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def suite_options() -> list[str]:
    """The options ``scripts/test`` gives pytest after ``-n WORKERS`` (the README's test command)."""
    line = next(line for line in (ROOT / "scripts" / "test").read_text().splitlines()
                if line.startswith("exec ") and " pytest " in line)
    options = re.fullmatch(r'exec \S+ -m pytest -n "\$workers" (.*) "\$@"', line)
    assert options, line
    return options.group(1).split()


@pytest.mark.slow
def test_a_worker_that_dies_ends_the_run_as_a_failure_instead_of_hanging_it(tmp_path: Path) -> None:
    """pytest-xdist 3.8 replaces a crashed worker, and under ``--dist loadgroup`` the run then hung
    with every worker idle (a segfault in the whole suite on 2026-11-30, until CI's limit): run with
    the suite's own options, a worker's death ends the run, failed, at once."""
    (tmp_path / "test_crashing.py").write_text(CRASHING)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_xdist_groups", "-p", "no:cacheprovider", "-n", "1",
         *suite_options(), "-p", "no:faulthandler", "--rootdir", str(tmp_path), "-c", os.devnull,
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=no_core_files,
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
             "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))})
    assert run.returncode != 0, run.stdout[-3000:]
    assert "test_crash" in run.stdout and "node down" in run.stdout, run.stdout[-3000:]


SEGFAULTING = '''
import ctypes
import threading


def read_address_zero():
    ctypes.string_at(0)  # what a C extension's bad pointer does to a worker


def test_crash():
    thread = threading.Thread(target=read_address_zero, name="crasher")
    thread.start()
    thread.join()
'''


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_says_which_thread_where_at_the_end_of_the_run(tmp_path: Path) -> None:
    """CI keeps the end of a run's output; twice a segfault reached us as the tail of one thread's
    stack, none of them the crashing one (tests/_crash_report.py). With the suite's options, the
    run ends with the fatal error, the crashing thread's Python stack and, with gdb and a core
    file, its native stack."""
    (tmp_path / "test_segfaulting.py").write_text(SEGFAULTING)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_crash_report", "-p", "no:cacheprovider", "-n", "1",
         *suite_options(), "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
             "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))})
    assert run.returncode != 0, run.stdout[-3000:]
    end = run.stdout[run.stdout.rindex("worker gw0 died: where"):]
    assert "Fatal Python error: Segmentation fault" in end, end
    assert re.search(r"Current thread [^\n]*\n(  File [^\n]*\n)*  File [^\n]*test_segfaulting.py\", line \d+ "
                     r"in read_address_zero\n", end), end
    pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    if shutil.which("gdb") and not pattern.startswith("|"):
        assert re.search(r"native stack of the crashing thread \(gdb\):\n#0 ", end), end
    else:
        assert "no native stack: " in end, end
    assert not list(tmp_path.glob("core*")), "the core was left behind"
