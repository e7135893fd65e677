"""A proxy between a Kafka client and one broker that misdirects one produce request.

What a test needs to play the broker refusing one request, for a passing reason,
and taking the requests behind it: once ``arm()`` is called, the next produce
request is sent to a partition that does not exist (its first partition's index
rewritten), so the broker writes none of it and answers UNKNOWN_TOPIC_OR_PARTITION,
a refusal every client retries; the answer is given back the partition's real
index and held, with everything after it on that connection, until
``release_answers()``. The requests behind it go on to the broker meanwhile, as
they do when a real refusal (a leader moving, a topic being created) is on its
way back. Otherwise the bytes are the client's and the broker's: only a frame's
size, API key, version and correlation id are read, and in the misdirected
request and its answer, the first partition's index.

The broker must name the proxy's port in its metadata, or the client would go
round it after bootstrap: ``LocalKafka(relayed_at=proxy.port)``, then
``proxy.forward_to(kafka.nodes[0].relayed[0])``.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import suppress

PRODUCE = 0
NOWHERE = 99_999
"""The partition index a misdirected request names: no test topic has that many."""


class HoldingProxy:
    """Listens on 127.0.0.1:``port``; each connection is piped to the broker's port, once known
    (``forward_to``: the broker starts after the proxy, whose port it names)."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._upstream: int | None = None
        self._upstream_known = threading.Event()
        self._lock = threading.Condition()
        self._armed = False
        self._armed_for: bytes | None = None  # only a request whose first topic is this one
        self._skip = 0  # requests (of that topic) to let pass first
        self._misdirected: dict[int, int] = {}  # correlation id -> the partition it named
        self._holding = False
        self._release_at: int | None = None
        self._hold_for: float | None = None
        self._held: list[tuple[socket.socket, bytes]] = []
        self.produce_requests = 0
        self.answers_held = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="kafka-proxy", daemon=True).start()

    # -- what the test does ---------------------------------------------------------------------

    def forward_to(self, port: int) -> None:
        """Pipe the connections, those waiting included, to the broker on 127.0.0.1:``port``."""
        self._upstream = port
        self._upstream_known.set()

    def arm(self, *, release_at: int | None = None, hold_for: float | None = None,
            topic: str | None = None, skip: int = 0) -> None:
        """Misdirect the next produce request (the next whose first topic is ``topic``, past ``skip``
        of them); hold its answer and every answer after it, until ``release_answers()``, or once
        ``release_at`` answers are held, or ``hold_for`` seconds after its answer came."""
        with self._lock:
            self._armed, self._release_at, self._hold_for, self.answers_held = True, release_at, hold_for, 0
            self._armed_for, self._skip = None if topic is None else topic.encode(), skip

    def disarm(self) -> None:
        """Misdirect nothing (an ``arm`` whose request never came)."""
        with self._lock:
            self._armed = False

    def wait(self, what: Callable[[], bool], timeout: float, name: str) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not what():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the proxy never saw {name}")
                self._lock.wait(left)

    def release_answers(self) -> None:
        """Send the held answers back, in order, and stop holding."""
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        held, self._held, self._holding = self._held, [], False
        for sock, frame in held:
            sock.sendall(frame)
        self._lock.notify_all()

    def close(self) -> None:
        self._closed = True
        self._upstream_known.set()  # a connection waiting for the broker gives up
        for sock in [self._server, *self._sockets]:
            _shut(sock)
            sock.close()

    # -- the pipes ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                if not self._upstream_known.wait(30) or self._closed or self._upstream is None:
                    raise OSError("no broker to forward to")
                broker = socket.create_connection(("127.0.0.1", self._upstream))
            except OSError:
                client.close()
                continue
            self._sockets += [client, broker]
            threading.Thread(target=self._pipe, args=(client, broker, self._request), daemon=True).start()
            threading.Thread(target=self._pipe, args=(broker, client, self._answer), daemon=True).start()

    def _pipe(self, source: socket.socket, to: socket.socket,
              passing: Callable[[bytes, socket.socket], None]) -> None:
        """Frames from ``source`` through ``passing`` to ``to``, until either side closes."""
        try:
            while (frame := _next_frame(source)) is not None:
                with self._lock:
                    passing(frame, to)
                    self._lock.notify_all()
        except OSError:
            pass
        finally:
            for sock in (source, to):
                _shut(sock)

    def _request(self, frame: bytes, broker: socket.socket) -> None:
        api_key, version, correlation = struct.unpack_from(">hhi", frame, 4)
        if api_key == PRODUCE:
            self.produce_requests += 1
            at, topic = _request_partition_at(frame, version)
            if self._armed and self._armed_for in (None, topic):
                if self._skip:
                    self._skip -= 1
                else:
                    self._armed = False
                    frame, self._misdirected[correlation] = _with_partition(frame, at, NOWHERE)
        broker.sendall(frame)

    def _answer(self, frame: bytes, client: socket.socket) -> None:
        correlation = struct.unpack_from(">i", frame, 4)[0]
        partition = self._misdirected.pop(correlation, None)
        if partition is not None:
            frame, _named = _with_partition(frame, _answer_partition_at(frame), partition)
            self._holding = True
            if self._hold_for is not None:
                timer = threading.Timer(self._hold_for, self.release_answers)
                timer.daemon = True
                timer.start()
        if self._holding:
            self._held.append((client, frame))
            self.answers_held += 1
            if self.answers_held == self._release_at:
                self._release_locked()
        else:
            client.sendall(frame)


# -- the protocol, as far as the proxy reads it (flexible versions: Produce v9 and later) ----------

def _next_frame(sock: socket.socket) -> bytes | None:
    head = _exactly(sock, 4)
    if head is None:
        return None
    body = _exactly(sock, struct.unpack(">i", head)[0])
    return None if body is None else head + body


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(n - got)
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _uvarint(frame: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = frame[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _request_partition_at(frame: bytes, version: int) -> tuple[int, bytes]:
    """Where a produce request's first partition index is (request header v2, ProduceRequest v9+),
    and its first topic's name."""
    if version < 9 or version > 12:
        raise AssertionError(f"the proxy reads ProduceRequest v9 to v12, not v{version}")
    at = 4 + 8
    client_id = struct.unpack_from(">h", frame, at)[0]
    at += 2 + max(client_id, 0)
    tags, at = _uvarint(frame, at)
    assert tags == 0, "tagged fields in the request header"
    transactional, at = _uvarint(frame, at)  # compact nullable string: length + 1, 0 for null
    at += max(transactional - 1, 0)
    at += 2 + 4  # acks, timeout
    topics, at = _uvarint(frame, at)
    assert topics >= 2, "a produce request without a topic"
    name, at = _uvarint(frame, at)
    topic = frame[at:at + name - 1]
    at += name - 1
    partitions, at = _uvarint(frame, at)
    assert partitions >= 2, "a produce request without a partition"
    return at, topic


def _answer_partition_at(frame: bytes) -> int:
    """Where a produce answer's first partition index is (response header v1, ProduceResponse v9+)."""
    at = 4 + 4
    tags, at = _uvarint(frame, at)
    assert tags == 0, "tagged fields in the response header"
    topics, at = _uvarint(frame, at)
    assert topics >= 2, "a produce answer without a topic"
    name, at = _uvarint(frame, at)
    at += name - 1
    partitions, at = _uvarint(frame, at)
    assert partitions >= 2, "a produce answer without a partition"
    return at


def _with_partition(frame: bytes, at: int, partition: int) -> tuple[bytes, int]:
    """``frame`` naming ``partition`` at ``at``, and the partition it named there."""
    was = struct.unpack_from(">i", frame, at)[0]
    return frame[:at] + struct.pack(">i", partition) + frame[at + 4:], was


def _shut(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
