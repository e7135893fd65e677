"""Waking the relay: PostgreSQL notifications, timers and polling all end in one Event.

On PostgreSQL ``publish()`` runs ``pg_notify(channel, payload)`` which the server
delivers at commit (the payload names the shard and the schema, ``outbox.core._notify``:
a ``TenantRelay`` wakes that schema's tenant alone); a dedicated connection
here LISTENs and sets the event, so the relay reacts in milliseconds instead
of a poll interval. If that connection breaks, it is reopened every second
(one log line when it breaks, one when it is back); polling covers the gap.

A LISTEN that succeeds may still hear nothing: through a connection pooler in
transaction mode (PgBouncer) it is registered on a server connection that goes
back to the pool at once, and no notification reaches the client. So each
connection proves it hears before it counts as connected: it sends a probe on
the channel from another connection of the engine and waits for its echo
(``PROBE_WAIT``). A deaf one is counted as lost (polling every poll interval)
and tried again every ``DEAF_RETRY`` seconds, with one log line.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text

from transports._logsafe import safe_logger

log = safe_logger("outbox.relay")

PROBE_PREFIX = "outbox-probe:"
"""A probe's payload begins so; no listener takes it for a commit (``outbox.core._notify`` payloads
begin with a shard number)."""

PROBE_WAIT = 5.0
"""Seconds a new LISTEN connection waits for its probe's echo before it counts as deaf."""

DEAF_RETRY = 60.0
"""Seconds between two tries of a LISTEN found deaf (the pooler in front does not change by itself)."""


class Wakeup:
    """An event any thread may ``set``; ``listen`` feeds it from NOTIFY on PostgreSQL."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self) -> None:
        self.event.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s; True if woken. Clears the event."""
        woken = self.event.wait(timeout)
        self.event.clear()
        return woken

    def listen(self, engine: Engine, channel: str) -> None:
        """Start the LISTEN thread (PostgreSQL with psycopg only; a no-op elsewhere)."""
        self._thread = start_listening(engine, [channel], on_notify=lambda _payload: self.event.set(),
                                       on_connect=self.event.set, stop=self._stop)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def can_listen(engine: Engine) -> bool:
    """Whether ``engine`` delivers notifications: PostgreSQL through psycopg."""
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"


def start_listening(engine: Engine, channels: list[str], *, on_notify: Callable[[str], None],
                    on_connect: Callable[[], None], stop: threading.Event,
                    on_lost: Callable[[], None] | None = None) -> threading.Thread | None:
    """One daemon thread LISTENing on ``channels`` over one connection until ``stop``; None if it cannot.

    ``on_notify`` gets each notification's payload; ``on_connect`` runs after
    every (re)connection, since anything committed before it was not notified.
    ``on_lost`` runs when the connection breaks (or cannot be made), once until
    it is back: from then on nothing is notified until ``on_connect``.
    """
    if not can_listen(engine):
        return None
    thread = threading.Thread(target=_listen, args=(engine, channels, on_notify, on_connect, stop,
                                                    on_lost or _nothing),
                              name="outbox-relay-listen", daemon=True)
    thread.start()
    return thread


def _nothing() -> None:
    return None


def _listen(engine: Engine, channels: list[str], on_notify: Callable[[str], None],
            on_connect: Callable[[], None], stop: threading.Event, on_lost: Callable[[], None]) -> None:
    broken = False
    shown = ", ".join(channels)
    while not stop.is_set():
        fairy: Any = None
        retry = 1.0
        try:
            fairy = engine.raw_connection()
            fairy.detach()
            conn = fairy.dbapi_connection
            conn.autocommit = True
            for channel in channels:
                conn.execute(f'LISTEN "{channel}"')  # channel is a validated identifier
            if not _hears(engine, conn, channels[0], on_notify, stop):
                if stop.is_set():
                    return
                retry = DEAF_RETRY
                raise DeafListener(f"no notification came back within {PROBE_WAIT:g} s (a connection "
                                   "pooler in transaction mode between the relay and PostgreSQL?)")
            if broken:
                log.warning("LISTEN %s is back", shown)
                broken = False
            on_connect()
            while not stop.is_set():
                for note in conn.notifies(timeout=0.5):
                    if not note.payload.startswith(PROBE_PREFIX):
                        on_notify(note.payload)
        except Exception as exc:
            if not broken:
                reason = str(exc) if isinstance(exc, DeafListener) else repr(exc)
                log.warning("LISTEN %s failed (%s); polling, and retrying every %g s", shown, reason,
                            retry)
                broken = True
                on_lost()
            stop.wait(retry)
        finally:
            if fairy is not None:
                with contextlib.suppress(Exception):
                    fairy.close()


class DeafListener(Exception):
    """A LISTEN connection that did not hear its own probe."""


def _hears(engine: Engine, conn: Any, channel: str, on_notify: Callable[[str], None],
           stop: threading.Event) -> bool:
    """Whether ``conn``, LISTENing on ``channel``, hears a notification sent from another connection.

    Notifications of commits that arrive meanwhile are passed on. Raises what the probe's
    own connection raised (the database is unreachable: the caller retries).
    """
    probe = PROBE_PREFIX + uuid.uuid4().hex
    with engine.connect() as sender:
        sender.execute(text("SELECT pg_notify(:channel, :probe)"), {"channel": channel, "probe": probe})
        sender.commit()
    deadline = time.monotonic() + PROBE_WAIT
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        for note in conn.notifies(timeout=min(0.5, left)):
            if note.payload == probe:
                return True
            if not note.payload.startswith(PROBE_PREFIX):
                on_notify(note.payload)
    return False
