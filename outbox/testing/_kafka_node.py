"""One process of a local Apache Kafka: a combined KRaft broker and controller (``kafka.Kafka``).

A node owns its directory (``server.properties``, the log4j2 configuration,
``server.log``, ``stdout.log``, the data under ``data/``), its two ports on
127.0.0.1 (clients and controllers) and its JVM. ``_kafka`` composes one or
three of them into ``LocalKafka`` and ``LocalKafkaCluster``.

The JVM's launcher, options and clean-up are ``_jvm``'s.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from . import _jvm as jvm
from ._jvm import HOST, LOG4J2, jvm_options, kill, launcher, started, terminate
from ._ports import check_bound

STOP_TIMEOUT = 30.0
"""How long ``stop()`` waits for a clean shutdown (SIGTERM) before it kills the JVM."""


class KafkaNode:
    """One KRaft node (``process.roles=broker,controller``) in ``directory``; not started yet.

    ``configure()`` writes its properties, ``format_command()`` formats its data
    directory, ``launch()`` starts the JVM without waiting; the owner waits for
    readiness (``_kafka``). ``stop()``, ``kill()``, ``freeze()`` and ``thaw()``
    are what fault tests do to it; ``launch()`` again restarts it on the same
    ports and data.
    """

    def __init__(self, node_id: int, directory: Path, *, libs: Path, java: str, heap: str) -> None:
        self.node_id = node_id
        self.directory = directory
        self.data_dir = directory / "data"
        self.log_path = directory / "server.log"
        self.port = 0
        self.controller_port = 0
        # A second client listener whose metadata names another port (a proxy's), or None.
        self.relayed: tuple[int, int] | None = None  # (the port it binds, the port it names)
        self._libs = libs
        self._java = java
        self._heap = heap
        self._process: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        self.frozen = False
        directory.mkdir(parents=True)
        (directory / "log4j2.properties").write_text(LOG4J2.format(log=self.log_path))

    def __repr__(self) -> str:
        state = "frozen" if self.frozen else "running" if self.running else "stopped"
        return f"KafkaNode({self.node_id}, {HOST}:{self.port}, {state})"

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The JVM's process id while it runs (frozen included)."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def configure(self, port: int, controller_port: int, properties: Mapping[str, str],
                  relayed: tuple[int, int] | None = None) -> None:
        """Write ``server.properties``: this node's listeners and id, then ``properties``.

        ``relayed`` (bound port, named port): a second client listener, RELAYED, bound on the
        first port, whose metadata names the second. A client that bootstraps through a proxy on
        the second port then reaches this broker only through that proxy (``tests/_kafka_proxy``),
        while the tests' own clients keep the direct listener.
        """
        self.port, self.controller_port, self.relayed = port, controller_port, relayed
        listeners = [f"PLAINTEXT://{HOST}:{port}", f"CONTROLLER://{HOST}:{controller_port}"]
        advertised = [f"PLAINTEXT://{HOST}:{port}"]
        protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
        if relayed is not None:
            listeners.append(f"RELAYED://{HOST}:{relayed[0]}")
            advertised.append(f"RELAYED://{HOST}:{relayed[1]}")
            protocols.append("RELAYED:PLAINTEXT")
        mine = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": ",".join(protocols),
            "log.dirs": str(self.data_dir),
            **properties,
        }
        text = "".join(f"{key}={value}\n" for key, value in mine.items())
        (self.directory / "server.properties").write_text(text)

    def _java_command(self, main: str, *args: str) -> list[str]:
        return [self._java, f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}",
                "-cp", f"{self._libs}/*", main, *args]

    def format_command(self, cluster_id: str) -> list[str]:
        """``kafka-storage format``: the data directory of a new node of cluster ``cluster_id``."""
        return self._java_command("kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
                                  "--config", str(self.directory / "server.properties"))

    def launch(self) -> None:
        """Start the JVM on the configured ports and data (a restart keeps both); do not wait."""
        if self.running:
            raise RuntimeError(f"Kafka node {self.node_id} is already running")
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        command = [*launcher(), self._java, f"-Xmx{self._heap}", "-Xms64m", *jvm_options(),
                   *self._java_command("kafka.Kafka", str(self.directory / "server.properties"))[1:]]
        with open(self.directory / "stdout.log", "ab") as out:
            self._process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.directory,
                                             start_new_session=True)
        started(self._process)
        self.frozen = False

    # -- what the owner reads while it waits -----------------------------------------------------

    def log_since_launch(self) -> str:
        """The broker's log lines written since the last ``launch()``."""
        return jvm.log_since(self.log_path, self._log_start)

    def says_bound(self) -> bool:
        """Whether the broker's own log (since launch) says it listens on each of its ports."""
        text = self.log_since_launch()
        return all(f"Awaiting socket connections on {HOST}:{port}." in text for port in self.bound_ports())

    def lost_a_port_race(self) -> bool:
        """Whether this launch ended because a port was taken (another process bound it first)."""
        return not self.running and "Address already in use" in self.log_since_launch()

    def prove_bound(self) -> None:
        """Raise ``PortNotBound`` unless this JVM holds the listening socket of each of its ports."""
        assert self._process is not None
        for port in self.bound_ports():
            check_bound(self._process.pid, port, f"Kafka node {self.node_id}")

    def bound_ports(self) -> list[int]:
        """The ports this node binds: clients, controllers, and the relayed listener's if any."""
        return [self.port, self.controller_port, *([self.relayed[0]] if self.relayed else [])]

    def first_error(self) -> str:
        """The broker's first ERROR line since launch and the line after it (the exception), or ""."""
        return jvm.first_error(self.log_since_launch())

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` of the broker's log and of the JVM's own output, for an error message."""
        return jvm.tail((self.log_path, self.directory / "stdout.log"), lines)

    def exit_code(self) -> int | None:
        return None if self._process is None else self._process.poll()

    # -- faults ---------------------------------------------------------------------------------

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Shut down as an operator does (SIGTERM: a controlled shutdown); kill after ``timeout`` s."""
        if not self.running:
            return
        assert self._process is not None
        self.thaw()
        terminate(self._process, timeout)

    def kill(self) -> None:
        """SIGKILL: the process is gone at once, nothing flushed, nobody told (a crashed host)."""
        if self._process is None:
            return
        kill(self._process)
        self.frozen = False

    def freeze(self) -> None:
        """SIGSTOP the JVM: its sockets stay open and nothing answers (a hung host, a partition)."""
        if not self.running:
            raise RuntimeError(f"Kafka node {self.node_id} is not running")
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT: a frozen JVM goes on where it stopped."""
        if self.frozen and self._process is not None:
            self._process.send_signal(signal.SIGCONT)
        self.frozen = False
