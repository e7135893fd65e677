"""Kafka Connect for tests: a worker's REST API (``ConnectRest``) and a worker of our own.

``LocalKafkaConnect`` runs Kafka Connect in standalone mode
(``org.apache.kafka.connect.cli.ConnectStandalone``) from the jars
``scripts/setup`` fetches (``scripts/jvm/debezium``: Kafka Connect 4.3.0 and
Debezium 3.6.1.Final's PostgreSQL connector, with its outbox ``EventRouter``,
on one classpath), with the machine's Java, in a temp dir, against a broker
the caller names. Its source offsets live in a file of that dir; its REST API
listens on a free port of 127.0.0.1.

Ready means: the JVM runs; its log says the REST server listens on its port
and Connect has started; ``/proc`` shows that port's listening socket belongs
to this JVM (a JVM that lost the port to another process would otherwise be
answered for by that process); and the REST API answers with the *broker's*
cluster id. A first start that loses its port to another process starts again
on a new one (three times at most). Keys and values are written by
``StringConverter``: a record's key is the aggregate id's text and its value
the payload column's text (docs/testing.md, "Debezium in the test bed").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from . import _jvm as jvm
from ._jvm import HOST, LOG4J2, jvm_options, kill, launcher, started, terminate
from ._kafka_libs import bundle_libs, java
from ._ports import PortNotBound, check_bound, free_port

LIBS_VARIABLE = "OUTBOX_TEST_DEBEZIUM_LIBS"
FETCH_HINT = "run scripts/setup (it fetches Kafka Connect and Debezium from Maven Central into .jvm/debezium)"
START_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0
PORT_ATTEMPTS = 3
RUNNING_TIMEOUT = 120.0

WORKER_SETTINGS: Mapping[str, str] = {
    "key.converter": "org.apache.kafka.connect.storage.StringConverter",
    "value.converter": "org.apache.kafka.connect.storage.StringConverter",
    # Plugins come from the jars' ServiceLoader manifests (Debezium's have them): scanning the
    # classpath instead cost 18 s of every start.
    "plugin.discovery": "service_load",
    "offset.flush.interval.ms": "1000",
}
"""Settings every local worker gets (``settings=`` overrides any of them)."""


class ConnectStartError(RuntimeError):
    """A local Kafka Connect worker did not become ready; the message ends with its log's tail."""


class ConnectorFailed(RuntimeError):
    """A connector or one of its tasks is FAILED (or it did not run in time); the message holds its trace."""


class _PortRace(Exception):
    """The first start found its REST port taken: try again on a new one."""


def debezium_libs() -> Path | None:
    """The folder of Kafka Connect's and Debezium's jars, or None (``missing()`` says why)."""
    return bundle_libs("debezium", LIBS_VARIABLE, "debezium-connector-postgres-*.jar")


def missing() -> str | None:
    """Why no local Kafka Connect with Debezium can start here (one line), or None when it can."""
    if java() is None:
        return "no Java runtime for Kafka Connect (Kafka 4 needs 17+: openjdk-17-jre-headless)"
    if debezium_libs() is None:
        return f"no Kafka Connect and Debezium jars: {FETCH_HINT}, or set {LIBS_VARIABLE} to a folder of them"
    return None


class ConnectRest:
    """The REST API of a Kafka Connect worker at ``url``: what a test asks of any worker, ours or not."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"

    def _call(self, method: str, path: str, body: object = None, timeout: float = 10.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json",
                                                  "Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read()
        return json.loads(text) if text else None

    def info(self) -> dict[str, Any]:
        """``GET /``: the worker's version, commit and the id of the Kafka cluster it works for."""
        answer: dict[str, Any] = self._call("GET", "/")
        return answer

    def put_connector(self, name: str, config: Mapping[str, str]) -> None:
        """Create connector ``name`` with ``config``, or change it (``PUT /connectors/NAME/config``)."""
        self._call("PUT", f"/connectors/{_name(name)}/config", dict(config), timeout=60.0)

    def delete_connector(self, name: str) -> None:
        """Stop and remove connector ``name`` (its offsets stay in the worker's store)."""
        try:
            self._call("DELETE", f"/connectors/{_name(name)}", timeout=60.0)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise

    def status(self, name: str) -> dict[str, Any] | None:
        """``GET /connectors/NAME/status``, or None when the worker has no such connector."""
        try:
            answer: dict[str, Any] = self._call("GET", f"/connectors/{_name(name)}/status")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return answer

    def wait_running(self, name: str, timeout: float = RUNNING_TIMEOUT) -> None:
        """Wait until connector ``name`` and every one of its tasks (one at least) say RUNNING.

        A FAILED connector or task raises ``ConnectorFailed`` with the worker's trace at once.
        """
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            try:
                last = self.status(name)
            except (urllib.error.URLError, OSError):
                last = None  # the worker is busy starting the connector: ask again
            if last is not None:
                states = [last["connector"], *last.get("tasks", [])]
                failed = [s for s in states if s.get("state") == "FAILED"]
                if failed:
                    raise ConnectorFailed(f"connector {name!r} failed: {failed[0].get('trace', '')[:4000]}")
                if last.get("tasks") and all(s.get("state") == "RUNNING" for s in states):
                    return
            if time.monotonic() > deadline:
                raise ConnectorFailed(f"connector {name!r} not RUNNING within {timeout:.0f} s: {last}")
            time.sleep(0.25)


def _name(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class LocalKafkaConnect(ConnectRest):
    """A throwaway Kafka Connect worker in standalone mode, with Debezium on its classpath; a context manager.

    ``bootstrap`` is the broker it works against, ``cluster_id`` that broker's id (asked of
    the broker when not given): the REST API must answer with it. ``settings`` are worker
    properties on top of ``WORKER_SETTINGS`` (``offset.flush.interval.ms`` is how often the
    source offsets reach the offsets file). ``stop()`` (SIGTERM: a clean shutdown, offsets
    flushed), ``kill()`` (SIGKILL: what was not flushed is sent again on the next start)
    and ``start()`` (the same port, offsets file and connectors) are the faults a test
    plays. Raises ``FileNotFoundError`` (one line: how to get the jars) when Java or the
    jars are missing.
    """

    def __init__(self, bootstrap: str, *, cluster_id: str | None = None,
                 settings: Mapping[str, str] | None = None, heap: str = "384m",
                 libs: Path | None = None, start_timeout: float = START_TIMEOUT) -> None:
        jars, runtime = libs or debezium_libs(), java()
        if jars is None or runtime is None:
            raise FileNotFoundError(missing() or "no Kafka Connect jars or no Java runtime")
        super().__init__(f"http://{HOST}:0")
        self.bootstrap = bootstrap
        self.cluster_id = cluster_id or _cluster_id(bootstrap)
        self.start_timeout = start_timeout
        self.directory = Path(tempfile.mkdtemp(prefix="outbox-connect-"))
        self.log_path = self.directory / "connect.log"
        self.offsets_path = self.directory / "offsets"
        self.port = 0
        self._libs, self._java, self._heap = jars, runtime, heap
        self._settings = {**WORKER_SETTINGS, **{k: str(v) for k, v in (settings or {}).items()}}
        self._connectors: dict[str, dict[str, str]] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        (self.directory / "log4j2.properties").write_text(LOG4J2.format(log=self.log_path))
        try:
            self._first_start()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LocalKafkaConnect({self.url}, {state})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The worker JVM's process id while it runs."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- start ----------------------------------------------------------------------------------

    def _first_start(self) -> None:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._configure(free_port())
            self._launch()
            try:
                self._wait_ready(first=True)
                return
            except _PortRace as race:
                self.kill()
                if attempt == PORT_ATTEMPTS:
                    raise ConnectStartError(
                        f"{race}, in each of {PORT_ATTEMPTS} starts on new ports") from None

    def _configure(self, port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        properties = {
            "bootstrap.servers": self.bootstrap,
            "offset.storage.file.filename": str(self.offsets_path),
            "listeners": f"http://{HOST}:{port}",
            "rest.advertised.host.name": HOST,
            "rest.advertised.port": str(port),
            **self._settings,
        }
        text = "".join(f"{key}={value}\n" for key, value in properties.items())
        (self.directory / "worker.properties").write_text(text)

    def _launch(self) -> None:
        if self.running:
            raise RuntimeError("this Kafka Connect worker is already running")
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        command = [*launcher(), self._java, f"-Xmx{self._heap}", "-Xms64m", *jvm_options(),
                   f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}",
                   "-cp", f"{self._libs}/*", "org.apache.kafka.connect.cli.ConnectStandalone",
                   str(self.directory / "worker.properties")]
        with open(self.directory / "stdout.log", "ab") as out:
            self._process = started(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, cwd=self.directory,
                                                     start_new_session=True))

    def _wait_ready(self, *, first: bool = False) -> None:
        """Wait until the worker is ready (module doc); ``ConnectStartError`` with its log otherwise."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self.running:
                if first and "Address already in use" in self.log_since_launch():
                    raise _PortRace(f"Kafka Connect found its REST port {self.port} taken")
                raise ConnectStartError(f"Kafka Connect exited ({self._exit_code()}) while starting: "
                                        f"{self.first_error()}\n{self.tail()}")
            if self._says_started():
                assert self._process is not None
                try:
                    check_bound(self._process.pid, self.port, "Kafka Connect")
                except PortNotBound as lost:
                    if first and lost.taken_by:
                        raise _PortRace(str(lost)) from None
                    raise
                if self._answers_for_our_broker():
                    return
            if time.monotonic() > deadline:
                raise ConnectStartError(f"Kafka Connect not ready within {self.start_timeout:.0f} s:\n"
                                        f"{self.tail()}")
            time.sleep(0.2)

    def _says_started(self) -> bool:
        text = self.log_since_launch()
        listening = f"REST server listening at http://{HOST}:{self.port}/"
        return listening in text and "Kafka Connect started" in text

    def _answers_for_our_broker(self) -> bool:
        """Whether the REST API answers, for the broker we gave it; another's answer is an error."""
        try:
            info = self.info()
        except (urllib.error.URLError, OSError, ValueError):
            return False
        if info.get("kafka_cluster_id") != self.cluster_id:
            raise ConnectStartError(f"the REST API on port {self.port} answers for Kafka cluster "
                                    f"{info.get('kafka_cluster_id')!r}, not ours ({self.cluster_id!r})")
        return True

    # -- connectors ---------------------------------------------------------------------------

    def put_connector(self, name: str, config: Mapping[str, str]) -> None:
        """As ``ConnectRest.put_connector``; remembered, so ``start()`` after a stop or kill brings it back.

        A standalone worker keeps connectors created through its REST API in memory only.
        """
        super().put_connector(name, config)
        self._connectors[name] = dict(config)

    def delete_connector(self, name: str) -> None:
        super().delete_connector(name)
        self._connectors.pop(name, None)

    # -- faults ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker again after ``stop()`` or ``kill()`` (same port, same offsets file),
        with its connectors; return once it is ready and they run."""
        self._launch()
        self._wait_ready()
        for name, config in self._connectors.items():
            super().put_connector(name, config)
        for name in self._connectors:
            self.wait_running(name)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM: connectors stop and their offsets are flushed; SIGKILL after ``timeout`` s."""
        if not self.running:
            return
        assert self._process is not None
        terminate(self._process, timeout)

    def kill(self) -> None:
        """SIGKILL: gone at once; the source offsets not flushed yet are lost, so their records come again."""
        if self._process is None:
            return
        kill(self._process)

    def close(self) -> None:
        """Kill the worker and delete its directory (offsets and logs): it was a throwaway."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- what a test or an error message reads --------------------------------------------------

    def log_since_launch(self) -> str:
        return jvm.log_since(self.log_path, self._log_start)

    def first_error(self) -> str:
        return jvm.first_error(self.log_since_launch())

    def tail(self, lines: int = 30) -> str:
        return jvm.tail((self.log_path, self.directory / "stdout.log"), lines)

    def _exit_code(self) -> int | None:
        return None if self._process is None else self._process.poll()


def _cluster_id(bootstrap: str) -> str:
    """The id of the Kafka cluster at ``bootstrap``, asked of the broker."""
    from confluent_kafka import KafkaException

    from ._kafka_admin import admin_client

    deadline = time.monotonic() + 60
    while True:
        try:
            cluster = admin_client(bootstrap).list_topics(timeout=10).cluster_id
        except KafkaException:
            cluster = None
        if cluster:
            return str(cluster)
        if time.monotonic() > deadline:
            raise ConnectStartError(f"the broker at {bootstrap} did not say its cluster id within 60 s")
        time.sleep(0.5)
