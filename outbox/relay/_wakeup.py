"""Waking the relay: PostgreSQL notifications, timers and polling all end in one Event.

On PostgreSQL ``publish()`` runs ``pg_notify(channel, payload)`` which the server
delivers at commit (the payload names the shard and the schema, ``outbox.core._notify``:
a ``TenantRelay`` wakes that schema's tenant alone); a dedicated connection
here LISTENs and sets the event, so the relay reacts in milliseconds instead
of a poll interval. If that connection breaks, it is reopened every second
(one log line when it breaks, one when it is back); polling covers the gap.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from transports._logsafe import safe_logger

log = safe_logger("outbox.relay")


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
        try:
            fairy = engine.raw_connection()
            fairy.detach()
            conn = fairy.dbapi_connection
            conn.autocommit = True
            for channel in channels:
                conn.execute(f'LISTEN "{channel}"')  # channel is a validated identifier
            if broken:
                log.warning("LISTEN %s is back", shown)
                broken = False
            on_connect()
            while not stop.is_set():
                for note in conn.notifies(timeout=0.5):
                    on_notify(note.payload)
        except Exception as exc:
            if not broken:
                log.warning("LISTEN %s failed (%r); polling, and retrying every second", shown, exc)
                broken = True
                on_lost()
            stop.wait(1.0)
        finally:
            if fairy is not None:
                with contextlib.suppress(Exception):
                    fairy.close()
