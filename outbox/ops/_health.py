"""``/healthz`` and ``/readyz`` beside ``/metrics``: the two questions a container platform asks.

``/healthz`` answers 200 while the process serves HTTP: liveness, "restart me
if I stop answering". It deliberately checks nothing else: a database or
broker outage is waited out by the worker (DESIGN §9), and a liveness probe
that failed on it would restart every worker in the middle of an outage.

``/readyz`` answers 200 when the worker does its job right now and 503 with
the reason otherwise: the database answers ``SELECT 1`` within
``DATABASE_TIMEOUT``, and the worker holds its work — a relay its fair share
of the shard leases (a standby relay, with more relays than shards, has a
share of 0 and is ready), a consumer at least one assigned partition. It is
what a dashboard or a rollout should watch; it is not a restart signal.

Everything else on the port is Prometheus's exposition (``/metrics``). The
server bounds what any client can hold (threads, time, bytes): ``_http``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from sqlalchemy import Engine, text

from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError
from ..core._secrets import database_secrets, scrub
from ..relay import Relay
from ..tenants import TenantRelay
from ._http import MAX_CONNECTIONS, MAX_REQUEST, TIMEOUT, BoundedServer

log = safe_logger("outbox.health")

DEFAULT_HOST = "0.0.0.0"
"""Every IPv4 interface: a Kubernetes probe connects to the pod's IP, not to its loopback."""

DATABASE_TIMEOUT = 2.0
"""Seconds ``/readyz`` waits for the database's answer before it reports it unreachable."""

Readiness = Callable[[], str | None]
"""Returns None when ready, else the reason it is not (one line, shown in the 503's body)."""


class DatabaseCheck:
    """``SELECT 1`` on ``engine``, answered within ``timeout`` or reported as not answering.

    One ping at a time: probes that arrive while a ping hangs (a database that
    is down can keep a connect waiting for minutes) share it instead of piling
    up threads and connections. The ping runs on a daemon thread, so a hung
    connect never delays the worker's exit after SIGTERM.
    """

    def __init__(self, engine: Engine, timeout: float = DATABASE_TIMEOUT,
                 run: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._engine = engine
        # The reason is served to whoever asks: never with a piece of the password in it.
        self._secrets = database_secrets(engine.url.render_as_string(hide_password=False))
        self._run = run
        self._timeout = timeout
        self._pinging: Future[None] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> str | None:
        with self._lock:
            if self._pinging is None or self._pinging.done():
                self._pinging = Future()
                threading.Thread(target=self._ping, args=(self._pinging,), name="outbox-readyz",
                                 daemon=True).start()
            pinging = self._pinging
        try:
            pinging.result(self._timeout)
        except FutureTimeout:
            return f"database did not answer within {self._timeout:g} s"
        except Exception as exc:
            first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
            return scrub(f"database unreachable: {first[0] if first else type(exc).__name__}",
                         self._secrets)
        return None

    def _ping(self, answer: Future[None]) -> None:
        try:
            if self._run is not None:  # an async engine's sync side works only where ``run`` calls it
                self._run(self._select_1)
            else:
                self._select_1()
        except BaseException as exc:
            answer.set_exception(exc)
        else:
            answer.set_result(None)

    def _select_1(self) -> None:
        with self._engine.connect() as conn:
            conn.execute(text("SELECT 1"))


def relay_readiness(relay: Relay) -> Readiness:
    """Ready: the database answers and ``relay`` holds its fair share of the shard leases."""
    database = DatabaseCheck(relay.engine)

    def ready() -> str | None:
        share = relay.leases.share
        if share is None:
            return "has not taken its shard leases yet"
        problem = database()
        if problem is not None:
            return problem
        held = len(relay.leases.owned())
        if held < share:
            return f"holds {held} of its {share} shard lease(s)"
        return None
    return ready


def tenant_relay_readiness(fleet: TenantRelay) -> Readiness:
    """Ready: ``fleet`` has read its tenants and none of their databases is known to be down."""
    return fleet.problem


def inbox_readiness(engine: Engine, source: object,
                    run: Callable[[Callable[[], None]], None] | None = None) -> Readiness:
    """Ready: the database answers and ``source`` holds at least one partition (if it can say).

    ``run`` is how the ping must be called when ``engine`` is an async engine's sync side
    (an async inbox's ``Sessions.run``).
    """
    database = DatabaseCheck(engine, run=run)
    assigned: Callable[[], frozenset[tuple[str, int]]] | None = getattr(source, "assigned", None)

    def ready() -> str | None:
        problem = database()
        if problem is not None:
            return problem
        if assigned is not None and not assigned():
            # A source that watches its group (KafkaSource) says why it has none for long.
            why = getattr(source, "group_problem", lambda: None)()
            return f"no partitions assigned: {why}" if why else "no partitions assigned"
        return None
    return ready


def serve_health(port: int, readiness: Readiness, *, registry: CollectorRegistry = REGISTRY,
                 host: str = DEFAULT_HOST, timeout: float = TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_request: int = MAX_REQUEST) -> BoundedServer:
    """Serve ``/healthz``, ``/readyz`` and the metrics of ``registry`` on ``host:port``, in a daemon thread.

    ``readiness`` is called for each ``/readyz``, on the request's thread; it
    returns None when ready, else the reason (see ``Readiness``). ``timeout``,
    ``max_connections`` and ``max_request`` bound what one client can hold
    (``_http``). An address that cannot be listened on raises
    ``ConfigurationError`` naming it.
    """
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _plain(start_response, "200 OK", "alive")
        if path == "/readyz":
            try:
                problem = readiness()
            except Exception as exc:  # a probe must answer, whatever the check ran into
                problem = f"readiness check failed: {type(exc).__name__}: {exc}"
            if problem is None:
                return _plain(start_response, "200 OK", "ready")
            return _plain(start_response, "503 Service Unavailable", f"not ready: {problem}")
        body: Iterable[bytes] = metrics(environ, start_response)
        return body

    try:
        server = BoundedServer(host, port, timeout=timeout, max_connections=max_connections,
                               max_request=max_request)
    except OSError as exc:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ConfigurationError(f"cannot serve /healthz, /readyz and /metrics on {where}: "
                                 f"{exc.strerror or exc} (check --metrics-host and --metrics-port)") from None
    server.set_app(app)
    threading.Thread(target=server.serve_forever, name="outbox-http", daemon=True).start()
    return server


def _plain(start_response: Callable[..., Any], status: str, body: str) -> list[bytes]:
    data = (body + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(data)))])
    return [data]
