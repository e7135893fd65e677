"""Server-side sign-in sessions: the cookie is a random key, the name stays on the server.

A ``/login`` with the token starts a session: a random 256-bit value goes to
the browser as its cookie, and this process keeps, under the value's SHA-256
digest (never the value itself), who signed in, when, and when they were last
seen. A session ends at ``/logout`` (a copy of the cookie taken before is
worthless after), after ``idle`` seconds without a request, or ``lifetime``
seconds after sign-in, whichever comes first; a restart of the process ends
them all. At most ``max_sessions`` are kept (the least recently used ended first).

Sessions live in this process: behind several console processes, route a
browser to the same one (sticky sessions), or use basic-auth users or a guard.
Safe to call from several threads.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass


@dataclass
class _Session:
    name: str
    started: float
    seen: float


def _key(cookie: str) -> bytes:
    return hashlib.sha256(cookie.encode("utf-8", "surrogatepass")).digest()


class Sessions:
    def __init__(self, *, idle: float, lifetime: float = 12 * 3600.0, max_sessions: int = 10_000) -> None:
        self.idle, self.lifetime, self.max_sessions = idle, lifetime, max_sessions
        self._sessions: dict[bytes, _Session] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Sessions({len(self._sessions)} open, idle={self.idle:g} s, lifetime={self.lifetime:g} s)"

    def start(self, name: str) -> str:
        """A new session for ``name``; returns the cookie value naming it."""
        cookie = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            self._sessions[_key(cookie)] = _Session(name, now, now)
            while len(self._sessions) > self.max_sessions:
                del self._sessions[next(iter(self._sessions))]
        return cookie

    def operator(self, cookie: str | None) -> str | None:
        """Who the session of ``cookie`` belongs to, or ``None`` (unknown, ended, idle or too old)."""
        if not cookie:
            return None
        key, now = _key(cookie), time.monotonic()
        with self._lock:
            session = self._sessions.pop(key, None)
            if session is None or now - session.seen > self.idle or now - session.started > self.lifetime:
                return None
            session.seen = now
            self._sessions[key] = session  # re-inserted: the dict's order is recency
            return session.name

    def end(self, cookie: str | None) -> None:
        if cookie:
            with self._lock:
                self._sessions.pop(_key(cookie), None)
