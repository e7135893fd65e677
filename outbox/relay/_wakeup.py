"""Waking the relay: PostgreSQL notifications, timers and polling all end in one Event.

On PostgreSQL ``publish()`` runs ``pg_notify(channel, shard)`` which the server
delivers at commit; a dedicated connection here LISTENs and sets the event, so
the relay reacts in milliseconds instead of a poll interval. If that connection
breaks, it is reopened every second (one log line when it breaks, one when it
is back); polling covers the gap.
"""

from __future__ import annotations

import contextlib
import threading
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
        if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
            return
        self._thread = threading.Thread(
            target=self._listen, args=(engine, channel), name="outbox-relay-listen", daemon=True
        )
        self._thread.start()

    def _listen(self, engine: Engine, channel: str) -> None:
        broken = False
        while not self._stop.is_set():
            fairy: Any = None
            try:
                fairy = engine.raw_connection()
                fairy.detach()
                conn = fairy.dbapi_connection
                conn.autocommit = True
                conn.execute(f'LISTEN "{channel}"')  # channel is a validated identifier
                if broken:
                    log.warning("LISTEN %s is back", channel)
                    broken = False
                self.event.set()  # anything committed before LISTEN is found by this poll
                while not self._stop.is_set():
                    for _ in conn.notifies(timeout=0.5):
                        self.event.set()
            except Exception as exc:
                if not broken:
                    log.warning("LISTEN %s failed (%r); polling, and retrying every second",
                                channel, exc)
                    broken = True
                self._stop.wait(1.0)
            finally:
                if fairy is not None:
                    with contextlib.suppress(Exception):
                        fairy.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
