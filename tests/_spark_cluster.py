"""A real Spark standalone cluster for the tests: one master and one worker on 127.0.0.1.

Both are started from PySpark's own ``spark-class`` (nothing is downloaded),
on free ports, with a temporary work directory, and stopped afterwards.

The worker runs in its own mount namespace, where ``private_dir`` is covered
by an empty tmpfs: a directory that exists for the driver but is a different,
executor-only disk for the tasks — what a local path is on a real cluster
whose executors run on other machines. Everywhere else the worker sees the
same files as the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
START_TIMEOUT = 120.0


@dataclass(frozen=True)
class Cluster:
    master: str          # spark://127.0.0.1:PORT
    private_dir: Path    # the driver's directory; the executors see an empty tmpfs instead
    work_dir: Path       # the worker's scratch space (executors' working directories)
    python: str          # the interpreter executors run (this test run's)
    private: bool        # whether private_dir really differs for the executors

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a CLI or spark-submit process that drives this cluster."""
        return {**os.environ, "PYSPARK_PYTHON": self.python, "SPARK_LOCAL_IP": "127.0.0.1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def private_mounts_work() -> bool:
    """Whether this host lets us give the worker its own mount namespace (root, or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*_unshare(), "sh", "-c", "mount -t tmpfs tmpfs /mnt && umount /mnt"],
                           capture_output=True)
    return probe.returncode == 0


def _unshare() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private"]


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as answer:
            state = json.load(answer)
    except OSError:
        return 0
    return sum(w["state"] == "ALIVE" for w in state.get("workers", []))


@contextmanager
def standalone_cluster(base: Path, *, private: bool) -> Iterator[Cluster]:
    """Start a master and one 2-core worker; yield the cluster; stop both (their process groups)."""
    base.mkdir(parents=True, exist_ok=True)
    port, ui, worker_ui = free_port(), free_port(), free_port()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable}
    class_ = [str(BIN / "spark-class")]
    private_dir, work_dir = base / "driver-only", base / "work"
    private_dir.mkdir()
    worker_cmd = [*class_, "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                  "--host", "127.0.0.1", "--webui-port", str(worker_ui), "--cores", "2",
                  "--memory", "2g", "--work-dir", str(work_dir)]
    if private:
        quoted = " ".join(f"'{a}'" for a in worker_cmd)
        worker_cmd = [*_unshare(), "sh", "-c", f"mount -t tmpfs tmpfs '{private_dir}' && exec {quoted}"]
    with open(base / "master.log", "wb") as master_log, open(base / "worker.log", "wb") as worker_log:
        master = subprocess.Popen(
            [*class_, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(port), "--webui-port", str(ui)],
            env=env, stdout=master_log, stderr=subprocess.STDOUT, start_new_session=True)
        worker = subprocess.Popen(worker_cmd, env=env, stdout=worker_log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while _alive_workers(ui) < 1:
            for name, process in (("master", master), ("worker", worker)):
                if process.poll() is not None:
                    log = (base / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"Spark {name} exited ({process.returncode}):\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker registered with the master within {START_TIMEOUT:.0f} s")
            time.sleep(0.5)
        yield Cluster(master=f"spark://127.0.0.1:{port}", private_dir=private_dir, work_dir=work_dir,
                      python=sys.executable, private=private)
    finally:
        for process in (worker, master):
            if process.poll() is None:
                os.killpg(process.pid, 15)
        for process in (worker, master):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
