"""A real Spark standalone cluster for the tests: one master and one worker on 127.0.0.1.

Both are started from PySpark's own ``spark-class`` (nothing is downloaded),
with a temporary work directory, and stopped afterwards. They choose their own
ports (``--port 0 --webui-port 0``) and the test reads back what they chose
from their logs, then checks that the chosen ports are theirs (``/proc``) and
that the web UI it asks is its own master's (the JSON names the master's URL):
a port picked free beforehand was once taken by another xdist worker's
console before the master bound it, Spark moved to the next port without a
word, and a test read the console's HTML as the master's JSON. The master's
REST submission server (port 6066, moving on when taken) is off: nothing uses it.

The worker runs in its own mount namespace, where ``private_dir`` is covered
by an empty tmpfs: a directory that exists for the driver but is a different,
executor-only disk for the tasks — what a local path is on a real cluster
whose executors run on other machines. Everywhere else the worker sees the
same files as the tests.

Every JVM of the cluster runs with the suite's JVM options (``OUTBOX_TEST_JVM_OPTIONS``, C1
only: docs/testing.md): the master and the worker through ``SPARK_DAEMON_JAVA_OPTS``, and each
application's executors, and a ``spark-submit`` driver, through the ``spark-defaults.conf`` of
a ``SPARK_CONF_DIR`` of the cluster's own that the jobs' environment names. A job lives seconds,
too short for the optimising compiler to pay back its compile threads' CPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from outbox.testing import JVM_OPTIONS_ENV, wait_until_bound

BIN = Path(sys.executable).parent
START_TIMEOUT = 120.0


@dataclass(frozen=True)
class Cluster:
    master: str          # spark://127.0.0.1:PORT
    private_dir: Path    # the driver's directory; the executors see an empty tmpfs instead
    work_dir: Path       # the worker's scratch space (executors' working directories)
    python: str          # the interpreter executors run (this test run's)
    private: bool        # whether private_dir really differs for the executors
    conf_dir: Path       # SPARK_CONF_DIR: spark-defaults.conf with the suite's JVM options

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a CLI or spark-submit process that drives this cluster."""
        return {**os.environ, "PYSPARK_PYTHON": self.python, "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_CONF_DIR": str(self.conf_dir), **extra}


def _conf_dir(base: Path) -> Path:
    """A SPARK_CONF_DIR whose defaults give executors and spark-submit's driver the suite's JVM
    options. A driver the outbox CLI starts passes its own (``FAST_START``), which win."""
    conf = base / "conf"
    conf.mkdir()
    options = os.environ.get(JVM_OPTIONS_ENV, "").strip()
    settings = [f"spark.{role}.extraJavaOptions {options}\n" for role in ("executor", "driver") if options]
    (conf / "spark-defaults.conf").write_text("".join(settings))
    return conf


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


def _alive_workers(ui_port: int, master: str) -> int:
    """How many workers the master whose web UI is on ``ui_port`` counts alive; it must be ``master``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as answer:
            state = json.load(answer)
    except OSError:
        return 0
    if state.get("url") != master:
        raise RuntimeError(f"port {ui_port} answers for {state.get('url')!r}, not our master {master}")
    return sum(w["state"] == "ALIVE" for w in state.get("workers", []))


def _bound_port(log: Path, service: str, process: subprocess.Popen[bytes], deadline: float) -> int:
    """The port Spark's log says ``service`` bound ("Successfully started service 'X' on port N.")."""
    pattern = re.compile(rf"Successfully started service '{service}' on port (\d+)\.")
    while True:
        found = pattern.search(log.read_text(errors="replace"))
        if found:
            port = int(found.group(1))
            left = max(1.0, deadline - time.monotonic())
            wait_until_bound(process.pid, port, f"Spark's {service}", timeout=left)
            return port
        if process.poll() is not None:
            raise RuntimeError(f"Spark's {service} exited ({process.returncode}):\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"Spark's {service} did not start within {START_TIMEOUT:.0f} s")
        time.sleep(0.2)


@contextmanager
def standalone_cluster(base: Path, *, private: bool) -> Iterator[Cluster]:
    """Start a master and one 2-core worker; yield the cluster; stop both (their process groups)."""
    base.mkdir(parents=True, exist_ok=True)
    conf_dir = _conf_dir(base)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
           "SPARK_DAEMON_JAVA_OPTS": os.environ.get(JVM_OPTIONS_ENV, ""), "SPARK_CONF_DIR": str(conf_dir)}
    class_ = [str(BIN / "spark-class")]
    private_dir, work_dir = base / "driver-only", base / "work"
    private_dir.mkdir()
    deadline = time.monotonic() + START_TIMEOUT
    with open(base / "master.log", "wb") as master_log:
        master = subprocess.Popen(
            [*class_, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", "0", "--webui-port", "0"],
            env=env, stdout=master_log, stderr=subprocess.STDOUT, start_new_session=True)
    worker: subprocess.Popen[bytes] | None = None
    try:
        port = _bound_port(base / "master.log", "sparkMaster", master, deadline)
        ui = _bound_port(base / "master.log", "MasterUI", master, deadline)
        url = f"spark://127.0.0.1:{port}"
        worker_cmd = [*class_, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                      "--webui-port", "0", "--cores", "2", "--memory", "2g", "--work-dir", str(work_dir)]
        if private:
            quoted = " ".join(f"'{a}'" for a in worker_cmd)
            worker_cmd = [*_unshare(), "sh", "-c", f"mount -t tmpfs tmpfs '{private_dir}' && exec {quoted}"]
        with open(base / "worker.log", "wb") as worker_log:
            worker = subprocess.Popen(worker_cmd, env=env, stdout=worker_log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        while _alive_workers(ui, url) < 1:
            for name, process in (("master", master), ("worker", worker)):
                if process.poll() is not None:
                    log = (base / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"Spark {name} exited ({process.returncode}):\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker registered with the master within {START_TIMEOUT:.0f} s")
            time.sleep(0.5)
        yield Cluster(master=url, private_dir=private_dir, work_dir=work_dir, python=sys.executable,
                      private=private, conf_dir=conf_dir)
    finally:
        running = [p for p in (worker, master) if p is not None]
        for process in running:
            if process.poll() is None:
                os.killpg(process.pid, 15)
        for process in running:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
