"""Fault campaign: PostgreSQL stops for 10 s under a running ``outbox inbox run``, mid-stream.

An outage is not a failure: the consumer process stays up, nothing is
parked, no alert fires, and once the database is back every message takes
effect exactly once, in key order. The database is a cluster of its own
(``outbox.testing.local_postgres_server``), stopped with ``pg_ctl stop -m
fast`` and started again on the same data directory and port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _failover import SEQ, read_committed

from outbox import Inbox, create_engine
from outbox.testing import FAST_SETTINGS, local_postgres_server, postgres_bindir
from tests.conftest import unavailable
from tests.inbox_support import INBOX_KINDS, async_url, business
from tests.test_inbox_crash import assert_exactly_once_in_order, effect_count, produce_keys

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]

APP = '''
import time

from outbox import Inbox, create_engine
from tests.inbox_support import apply_effect

inbox = Inbox(create_engine({db!r}, pool_size=6), group={group!r}, concurrency=4, batch_size=10,
              retry_backoff=0.01)


@inbox.handler({topic!r})
def handle(session, message):
    time.sleep(0.004)  # a handler with some I/O: the stream lasts long enough to stop the database in it
    apply_effect(session, message)
'''

ASYNC_APP = '''
import asyncio
from outbox import Inbox, create_async_engine
from tests.inbox_support import apply_effect

inbox = Inbox(create_async_engine({db!r}, pool_size=6), group={group!r}, concurrency=4,
              batch_size=10, retry_backoff=0.01)


@inbox.handler({topic!r})
async def handle(session, message):
    await asyncio.sleep(0.004)
    await session.run_sync(apply_effect, message)
'''

DOWNTIME = 10.0


def keys_out_of_order_on(kafka: str, topic: str) -> dict[bytes, list[int]]:
    """Each key whose records the topic holds out of seq order (offset order), with its seqs."""
    seqs: dict[bytes, list[int]] = {}
    for r in read_committed(kafka, topic):
        seqs.setdefault(r["key"], []).append(int(dict(r["headers"])[SEQ]))
    return {key: s for key, s in seqs.items() if s != sorted(s)}


@pytest.mark.parametrize("kind", INBOX_KINDS)  # async: asyncpg's errors are outages too
def test_postgres_stopped_for_ten_seconds_under_a_running_consumer(
    kafka: str, topic: str, tmp_path: Path, kind: str
) -> None:
    if postgres_bindir() is None:
        unavailable("the fault campaign stops its own PostgreSQL: it needs the local server binaries")
    # The stop comes at 600 effects (about the first two seqs of each key): each key has about six
    # more after the outage, each to apply once and in order behind what it interrupted. Twenty seqs a
    # key only made the drain after the outage longer (5,400 messages instead of 1,800).
    keys, per_key, group = 300, 8, f"outage-{topic}"
    with local_postgres_server(FAST_SETTINGS) as server:
        engine = create_engine(server.url)
        Inbox(engine, group=group).create_tables()
        business.create_all(engine)
        app, db = (APP, server.url) if kind == "sync" else (ASYNC_APP, async_url(server.url))
        (tmp_path / "service.py").write_text(app.format(db=db, group=group, topic=topic))
        produce_keys(kafka, topic, keys, per_key)
        log = tmp_path / "consumer.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "outbox", "inbox", "run", "service:inbox", "--bootstrap-servers",
             kafka, "-X", "fetch_max_wait_ms=10", "-X", "session_timeout_ms=6000"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log.open("wb"),
        )
        try:
            deadline = time.monotonic() + 90
            while effect_count(engine) < 600:
                assert process.poll() is None, f"the consumer exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, "the consumer never got going"
                time.sleep(0.05)
            at_stop = effect_count(engine)
            engine.dispose()
            server.stop()
            stopped_at = time.monotonic()
            while time.monotonic() - stopped_at < DOWNTIME:
                assert process.poll() is None, f"the consumer died in the outage:\n{log.read_text()}"
                time.sleep(0.2)
            server.start()
            deadline = time.monotonic() + 180
            while (done := effect_count(engine)) < keys * per_key:
                assert process.poll() is None, f"the consumer exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"stuck at {done} effects after the outage"
                time.sleep(0.2)
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(60)
        output = log.read_text()
        assert code == 0, output
        # A premise, not the inbox's promise: the test's producer wrote each key in seq order.
        # Out of order on the topic, a gap alert is right (a loaded CI run saw one, 2026-11-28).
        assert keys_out_of_order_on(kafka, topic) == {}, "premise broken: the topic's own order"
        assert "ALERT" not in output, output  # the default alert sink logs "ALERT …"
        assert "unavailable" in output and "available again" in output, output
        assert at_stop < keys * per_key / 2, f"stopped at {at_stop}: not mid-stream"
        assert_exactly_once_in_order(engine, group, keys, per_key)
        engine.dispose()
