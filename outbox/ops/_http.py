"""The worker's HTTP server: bounded in threads, time and bytes, whoever connects.

The health and metrics port of a relay or a consumer is reachable by whatever
shares its network (in Kubernetes, every pod of the cluster unless a
NetworkPolicy says otherwise), so what a client can hold is bounded:

- **Time.** A connection has ``timeout`` seconds, in all, to send its
  request line and headers (a client that sends one byte a second is cut off
  when they run out, not when it pauses), and the same again to take the
  answer. There is no keep-alive: one request per connection, answered in
  HTTP/1.0 and closed, so an idle kept-alive connection cannot exist.
- **Threads.** At most ``max_connections`` connections are open at once, each
  on its own thread. One more arriving closes the *oldest connection still
  sending its request* to make room: a prober that sends its request as soon
  as it connects (kubelet, Prometheus) gets a slot even while the others are
  held by idle or slow clients. Only when every slot is answering a request
  (each answer takes at most the database check's 2 s plus ``timeout`` to
  write) is the newcomer closed at once, unanswered.
- **Bytes.** The request line and headers together may take ``max_request``
  bytes; more is answered ``431`` and closed. A body is never read.
"""

from __future__ import annotations

import contextlib
import io
import re
import socket
import threading
import time
from typing import IO, Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError

log = safe_logger("outbox.health")

TIMEOUT = 5.0
"""Seconds a client has to send its request (and again to read the answer)."""
MAX_CONNECTIONS = 32
"""Connections (so threads) open at once on the port."""
MAX_REQUEST = 8192
"""Bytes of request line and headers, together."""

_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")


class BoundedServer(WSGIServer):
    """A thread per connection, at most ``max_connections`` of them; see the module doc."""

    daemon_threads = True  # a worker's exit never waits on a client
    request_queue_size = 1024  # connections the kernel holds until accepted: a burst must not stall a probe

    def __init__(self, host: str, port: int, *, timeout: float = TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_request: int = MAX_REQUEST) -> None:
        if not timeout > 0 or max_connections < 1 or max_request < 64:
            raise ConfigurationError("timeout must be positive, max_connections at least 1 and "
                                     "max_request at least 64 bytes")
        if ":" in host:  # an IPv6 address, e.g. "::" for every interface of both families
            self.address_family = socket.AF_INET6
        self.request_timeout = timeout
        self.max_connections = max_connections
        self.max_request = max_request
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._sending: dict[socket.socket, None] = {}  # still sending their request, oldest first
        super().__init__((host, port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._open) >= self.max_connections
            oldest = next(iter(self._sending), None) if full else None
            if oldest is not None:
                self._forget(oldest)
                _hang_up(oldest)  # its thread's recv returns, and the thread ends
            if not full or oldest is not None:
                self._open.add(request)
                self._sending[request] = None
        if full and oldest is None:  # every slot is answering: close the newcomer, unanswered
            super().shutdown_request(request)
            return
        try:
            threading.Thread(target=self._serve, args=(request, client_address),
                             name="outbox-http-request", daemon=True).start()
        except RuntimeError:  # no thread to be had: the slot must not stay taken
            self.shutdown_request(request)

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def request_received(self, connection: socket.socket) -> bool:
        """Mark ``connection`` as answering (no longer evictable); False if it was evicted meanwhile."""
        with self._lock:
            if connection not in self._open:
                return False
            self._sending.pop(connection, None)
            return True

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._forget(request)
        super().shutdown_request(request)

    def _forget(self, connection: socket.socket) -> None:
        self._open.discard(connection)
        self._sending.pop(connection, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away or stalled is its own business, not a traceback on stderr.
        log.debug("health connection from %s ended with an error", client_address, exc_info=True)


def _hang_up(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already gone
        connection.shutdown(socket.SHUT_RDWR)


class _Answer(ServerHandler):
    request_handler: WSGIRequestHandler  # wsgiref's back-pointer, for its access log

    def log_exception(self, exc_info: Any) -> None:
        if isinstance(exc_info[1], OSError):  # the client stalled or hung up while we wrote
            log.debug("health client did not take its answer: %s", exc_info[1])
        else:
            log.error("health endpoint failed", exc_info=exc_info)


class _Handler(WSGIRequestHandler):
    server: BoundedServer

    def handle(self) -> None:
        head = self._read_request()
        if head is None or not self.server.request_received(self.connection):
            return
        self.connection.settimeout(self.server.request_timeout)  # to take the answer
        self.rfile = io.BytesIO(head)
        self.raw_requestline = self.rfile.readline()
        if not self.parse_request():  # it sent the error answer
            return
        answer = _Answer(self.rfile, cast(IO[bytes], self.wfile), self.get_stderr(), self.get_environ(),
                         multithread=True)
        answer.request_handler = self
        app = self.server.get_app()
        assert app is not None  # serve_health sets it before serving
        answer.run(app)

    def _read_request(self) -> bytes | None:
        """The request line and headers, read within the deadline and the size bound, or None."""
        deadline = time.monotonic() + self.server.request_timeout
        limit = self.server.max_request
        received = bytearray()
        while True:
            end = _END_OF_HEAD.search(received)
            if end is not None and end.end() <= limit:
                return bytes(received[:end.end()])
            if len(received) > limit or end is not None:
                self._refuse("431 Request Header Fields Too Large")
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._refuse("408 Request Timeout")
                return None
            self.connection.settimeout(remaining)
            try:
                chunk = self.connection.recv(4096)
            except TimeoutError:
                self._refuse("408 Request Timeout")
                return None
            except OSError:
                return None
            if not chunk:  # the client hung up, or was evicted to make room
                return None
            received += chunk

    def _refuse(self, status: str) -> None:
        try:
            self.connection.settimeout(1.0)
            self.connection.sendall(f"HTTP/1.0 {status}\r\nContent-Length: 0\r\n"
                                    "Connection: close\r\n\r\n".encode())
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
        pass
