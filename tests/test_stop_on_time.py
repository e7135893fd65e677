"""Workers stop on time whatever is down: SIGTERM with the broker and the database both gone.

Real processes (``outbox inbox run``, ``outbox relay``, a FastStream app),
busy, then the broker (librdkafka's mock cluster in a process of its own) is
killed or frozen and the PostgreSQL server (the test's own) is stopped or
frozen, and the worker gets SIGTERM. It must exit within ``BOUND`` every
time. The FastStream app's broker stays up: its subscriber's worker threads
are ours (``Inbox.handle`` waiting out the database, the sweep), its Kafka
consumer is FastStream's, which waits ``graceful_timeout`` (15 s) for a
running handler first. Before the worker loops ran on a thread of their own,
the main thread sat in librdkafka's synchronous offset commit (or a query, or
a flush) and the signal handler never ran: it is a race, hence several
rounds, each with a different pair of faults; all rounds run before the verdict.
Each kind of worker plays its rounds on a database server of its own, the
three kinds side by side, one round at a time from its worker's start to its
SIGTERM (each round's start, work and faults as if alone): only the waits
after the signals (10-20 s each) overlap, instead of adding up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from pathlib import Path

import pytest
import sqlalchemy as sa
from _relay_helpers import publish

from outbox import Inbox, Outbox, create_engine
from outbox.core._stopping import STOP_TIMEOUT
from outbox.testing import LocalPostgres
from tests.conftest import postgres_of_its_own
from tests.inbox_support import business, effects, order_violations
from tests.test_inbox_crash import effect_count, produce_keys
from transports.testing import BrokerProcess

pytestmark = [pytest.mark.any_kafka, pytest.mark.postgres, pytest.mark.slow,
              pytest.mark.xdist_group("timing")]  # wall-clock bounds: one at a time (docs/testing.md)

ROOT = Path(__file__).resolve().parents[1]
BOUND = STOP_TIMEOUT + 5.0
"""The documented bound (``STOP_TIMEOUT`` after the signal) and the interpreter's exit, on a busy machine."""
FASTSTREAM_BOUND = 15.0 + 5.0
"""FastStream's ``graceful_timeout`` (15 s: it waits that long for a running handler, then cancels it)."""

APP = '''
import time

from outbox import Inbox, create_engine
from tests.inbox_support import apply_effect

inbox = Inbox(create_engine({db!r}, pool_size=6), group={group!r}, concurrency=4, batch_size=10,
              retry_backoff=0.01)


@inbox.handler({topic!r})
def handle(session, message):
    time.sleep(0.004)  # some I/O: the stream lasts while the faults come
    apply_effect(session, message)
'''

ROUNDS = [  # (worker, broker fault, database fault)
    ("inbox", "kill", "stop"),
    ("inbox", "freeze", "freeze"),
    ("relay", "kill", "stop"),
    ("relay", "freeze", "freeze"),
    ("faststream", "up", "stop"),
    ("faststream", "up", "freeze"),
]


RELAY_ROWS = 10_000
"""Rows each relay round starts with: it meets its faults at work, with thousands of rows to send."""


def count(outbox: Outbox, engine: sa.Engine, status: str) -> int:
    m = outbox.tables.messages
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).where(m.c.status == status)) or 0)


def until(condition: Callable[[], bool], timeout: float, what: str, process: subprocess.Popen[bytes],
          log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"{what}: the worker exited\n{log.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{log.read_text()}"
        time.sleep(0.05)


def start_busy_worker(kind: str, server: LocalPostgres, broker: BrokerProcess, tmp: Path,
                      log: Path) -> subprocess.Popen[bytes]:
    """A worker of ``kind`` started against ``broker`` and ``server``, and seen at work."""
    engine = create_engine(server.url)
    topic, group = f"t-{uuid.uuid4().hex[:10]}", f"stop-{uuid.uuid4().hex[:8]}"
    # PYTHONFAULTHANDLER: a worker found late gets SIGABRT, which writes every thread's stack to its log
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    try:
        if kind == "relay":
            outbox = Outbox(engine)
            outbox.create_tables()
            # 10,000 rows (8 s of the stage for 30,000): the relay is stopped with thousands left
            for _ in range(RELAY_ROWS // 1000):
                publish(outbox, topic, [f"k{i % 50}" for i in range(1000)])
            already = count(outbox, engine, "published")
            process = subprocess.Popen(
                [sys.executable, "-m", "outbox", "relay", "--db", server.url, "--bootstrap-servers",
                 broker.bootstrap, "--batch-size", "200", "--log-level", "INFO"],
                cwd=tmp, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            until(lambda: count(outbox, engine, "published") > already + 400, 60, "the relay at work",
                  process, log)
            left = count(outbox, engine, "pending")
            assert left >= 1000, f"the relay had {left} rows left when its faults came: not at work"
            return process
        Inbox(engine, group=group).create_tables()
        business.create_all(engine)
        with engine.begin() as conn:  # each round counts its own effects
            conn.execute(effects.delete())
            conn.execute(order_violations.delete())
        produce_keys(broker.bootstrap, topic, 300, 20)
        if kind == "inbox":
            (tmp / "service.py").write_text(APP.format(db=server.url, group=group, topic=topic))
            command = [sys.executable, "-m", "outbox", "inbox", "run", "service:inbox",
                       "--bootstrap-servers", broker.bootstrap, "-X", "fetch_max_wait_ms=10",
                       "-X", "session_timeout_ms=6000"]
        else:
            command = [sys.executable, str(ROOT / "tests" / "faststream_worker.py"), server.url,
                       broker.bootstrap, topic, group]
        process = subprocess.Popen(command, cwd=tmp, env=env, stdout=log.open("wb"),
                                   stderr=subprocess.STDOUT)
        until(lambda: effect_count(engine) >= 200, 90, f"the {kind} consumer at work", process, log)
        return process
    finally:
        engine.dispose()  # nothing of this process's may wait on the frozen server


def play(kind: str, server: LocalPostgres, stage: threading.Lock, tmp: Path,
         took: list[tuple[str, str, str, float | None]], logs: list[Path]) -> None:
    """The rounds of workers of ``kind``, one after another, on ``server``; ``stage`` is held from
    a worker's start to its SIGTERM, and while a server starts again, so that nothing but other
    rounds' waits for their workers' exits runs while a worker starts, works and meets its
    faults."""
    tmp.mkdir()
    for n, (worker, broker_fault, database_fault) in enumerate(ROUNDS):
        if worker != kind:
            continue
        log = tmp / f"round-{n}-{kind}.log"
        logs.append(log)
        with BrokerProcess() as broker:
            stage.acquire()
            try:
                process = start_busy_worker(kind, server, broker, tmp, log)
            except BaseException:
                stage.release()
                raise
            try:
                try:
                    if broker_fault == "kill":
                        os.kill(broker.pid, signal.SIGKILL)
                    elif broker_fault == "freeze":
                        broker.freeze()
                    if database_fault == "stop":
                        server.stop("immediate")
                    else:
                        server.freeze()
                    time.sleep(1.0)  # the worker meets both faults: commits, queries and sends hang now
                    assert process.poll() is None, \
                        f"round {n}: the worker died of the faults\n{log.read_text()}"
                    process.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
                finally:
                    stage.release()
                try:
                    process.wait(FASTSTREAM_BOUND if kind == "faststream" else BOUND)
                    took.append((kind, broker_fault, database_fault, time.monotonic() - signalled))
                except subprocess.TimeoutExpired:
                    took.append((kind, broker_fault, database_fault, None))
                    process.send_signal(signal.SIGABRT)  # where it hangs, into the log (see env above)
                    with suppress(subprocess.TimeoutExpired):
                        process.wait(10)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                with stage:  # between two rounds' faults, not while one meets them
                    if database_fault == "stop":
                        server.start()
                    else:
                        server.thaw()


def test_every_worker_stops_within_its_bound_with_broker_and_database_gone(
    own_postgres: LocalPostgres, tmp_path: Path
) -> None:
    took: list[tuple[str, str, str, float | None]] = []
    logs: list[Path] = []
    kinds = list(dict.fromkeys(kind for kind, _, _ in ROUNDS))
    stage = threading.Lock()
    with ExitStack() as servers, ThreadPoolExecutor(len(kinds)) as pool:
        # A database server per kind of worker: while a worker's stop is timed on its server (10-20
        # s), the next round, of another kind, starts on another (module doc).
        others = [servers.enter_context(postgres_of_its_own()) for _ in kinds[1:]]
        playing = [pool.submit(play, kind, server, stage, tmp_path / kind, took, logs)
                   for kind, server in zip(kinds, [own_postgres, *others], strict=True)]
        for done in playing:
            done.result()
    late = [t for t in took if t[3] is None]
    assert not late, f"still running after SIGTERM: {late} (all rounds: {took})\n" + "\n".join(
        f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    print("\nseconds from SIGTERM to exit:", [(k, b, d, round(s or 0, 1)) for k, b, d, s in took])
