"""Serving the console with uvicorn until Ctrl-C or SIGTERM, then exiting 0 without a traceback.

uvicorn handles SIGINT/SIGTERM itself while it serves, then restores the
previous handlers and raises the signal again so the caller hears of it. Left
as they are, that second delivery ends the process with a KeyboardInterrupt
traceback (status 130), or, after PySpark ran in the same process (the demo's
audit), in PySpark's own SIGINT handler mid-shutdown. A stop asked for is
not an error: the re-raised signal is swallowed here. A signal that arrives
before uvicorn took its handlers (start-up) asks the server to stop, too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core._stopping import stop_signals

REQUEST_TIMEOUT = 10.0
"""Seconds a client has to send a whole request (line, headers and body) once it may send one."""


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request to arrive.

    uvicorn times out only an idle kept-alive connection, and only until its
    first byte: a client that connects and sends nothing, or a header line and
    then nothing, or a ``Content-Length: 100`` body's first two bytes, holds
    its connection (a file descriptor) for good, so a few hundred anonymous
    sockets would stop the console. Here each request must have arrived whole
    within ``REQUEST_TIMEOUT`` of the moment the connection opened or the last
    answer was sent, or the connection is closed. The time the console takes
    to answer is not counted.
    """

    _request_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)  # a stream server's, as uvicorn's own annotation says
        super().connection_made(transport)
        self._await_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.SEND_BODY and self.conn.their_state is not h11.IDLE:
            self._stop_waiting()  # the request is all here (or the connection is over)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_request(self) -> None:
        self._stop_waiting()
        self._request_deadline = self.loop.call_later(REQUEST_TIMEOUT, self._too_slow)

    def _stop_waiting(self) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
            self._request_deadline = None

    def _too_slow(self) -> None:
        self._request_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def serve_until_stopped(server: Any) -> None:
    """``server.run()`` (a ``uvicorn.Server``) with SIGINT and SIGTERM ending it quietly."""
    def stop() -> None:
        server.should_exit = True

    with stop_signals(stop):
        server.run()
