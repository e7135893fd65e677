"""Shared by the console tests: an inbox whose handler fails on demand, and parking through it."""

from __future__ import annotations

import importlib
import re

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox import Inbox
from tests.inbox_support import TOPIC, apply_effect, business, record

TOKEN = "a-console-token-for-tests"


def broken_inbox(engine: sa.Engine, group: str = "billing") -> tuple[Inbox, dict[str, bool]]:
    """An inbox on ``engine`` whose handler raises while ``broken["on"]``; business tables made."""
    inbox = Inbox(engine, group=group, retry_backoff=0.001, concurrency=2)
    broken = {"on": True}

    @inbox.handler(TOPIC)
    def handle(session, message):  # type: ignore[no-untyped-def]
        if broken["on"] and message.key is not None and message.key.startswith("bad"):
            raise RuntimeError(f"bug 42 in <b>{message.key}</b>")
        apply_effect(session, message)

    business.create_all(engine)
    return inbox, broken


def park(inbox: Inbox, key: str, seqs: range = range(1, 3), payload: bytes = b'{"n":1}') -> None:
    """Deliver ``seqs`` of ``key`` through the real inbox (a ``bad…`` key parks at its first)."""
    for seq in seqs:
        inbox.handle(record(TOPIC, key, seq, payload=payload))


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


def form_page(client: TestClient, path: str, **kwargs) -> str:  # type: ignore[no-untyped-def]
    page = client.get(path, **kwargs)
    assert page.status_code == 200, page.text
    return csrf_of(page.text)


class Clock:
    """``time.monotonic`` (and ``time.time``) for the throttle, the sessions and the device
    cookies, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@pytest.fixture(name="clock")
def moved_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    for name in ("outbox.console._sessions", "outbox.console._throttle", "outbox.console._devices"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # a console before issue 24: its tests must fail in their bodies
            continue
        monkeypatch.setattr(module, "time", fake)
    return fake
