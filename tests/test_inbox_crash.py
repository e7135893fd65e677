"""Consumer processes that die or leave mid-stream: every effect still lands exactly once, in order.

The consumers are real processes (``tests/inbox_worker.py``) on the session's
Apache Kafka and a PostgreSQL or MariaDB/MySQL database; the handler inserts one business row per
message under a unique (topic, key, seq) constraint and fails on any seq that
is not the key's previous + 1, so both a doubled effect and a reordering
would show up as an error, a parked message or a missing row.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Inbox, create_engine
from tests.inbox_support import business, effects, order_violations, record
from tests.test_inbox_kafka import produce

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORKER = Path(__file__).with_name("inbox_worker.py")


@pytest.fixture
def pg(server_db_url: str) -> Iterator[sa.Engine]:
    """The database of the test, on each server (``server_db_url``): PostgreSQL, MySQL/MariaDB."""
    engine = create_engine(server_db_url)
    Inbox(engine, group="unused").create_tables()
    business.create_all(engine)
    yield engine
    engine.dispose()


def start_worker(db: str, kafka: str, topic: str, group: str, log: Path | None = None,
                 *, batch_handler: bool = False, kind: str = "sync",
                 group_protocol: str = "classic", session_timeout_ms: int | None = None
                 ) -> subprocess.Popen[bytes]:
    session = [] if session_timeout_ms is None else ["--session-timeout-ms", str(session_timeout_ms)]
    return subprocess.Popen(
        [sys.executable, str(WORKER), db, kafka, topic, group, "--concurrency", "4",
         "--batch-size", "20", *(["--batch-handler"] if batch_handler else []),
         *(["--async"] if kind == "async" else []), "--group-protocol", group_protocol, *session],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stderr=None if log is None else log.open("wb"),
    )


def produce_keys(kafka: str, topic: str, keys: int, per_key: int) -> None:
    """Seq 1 of every key, then seq 2 of every key …; small payloads."""
    produce(kafka, [record(topic, f"key-{k}", seq, payload=b"{}")
                    for seq in range(1, per_key + 1) for k in range(keys)])


def effect_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).select_from(effects)) or 0


def wait_for_count(engine: sa.Engine, above: int, timeout: float, workers: list) -> int:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while (n := effect_count(engine)) <= above:
        for w in workers:
            assert w.poll() is None, f"worker exited with {w.returncode}"
        if time.monotonic() > deadline:
            pytest.fail(f"no progress past {above} effects in {timeout}s")
        time.sleep(0.05)
    return n


def assert_exactly_once_in_order(engine: sa.Engine, inbox_group: str, keys: int, per_key: int) -> None:
    tables = Inbox(engine, group=inbox_group).tables
    with engine.connect() as conn:
        rows = conn.execute(sa.select(effects.c.key, effects.c.seq).order_by(effects.c.id)).all()
        violations = conn.execute(sa.select(order_violations)).all()
        parked = conn.scalar(sa.select(sa.func.count()).select_from(tables.inbox_parked))
        held = conn.scalar(sa.select(sa.func.count()).select_from(tables.inbox_held))
        processed = conn.scalar(sa.select(sa.func.count()).select_from(tables.inbox_messages))
    assert violations == [], f"order violations: {violations[:5]}"
    assert (parked, held) == (0, 0)
    assert len(rows) == keys * per_key == processed
    by_key: dict[str, list[int]] = {}
    for key, seq in rows:
        by_key.setdefault(key, []).append(seq)
    assert len(by_key) == keys
    assert all(seqs == list(range(1, per_key + 1)) for seqs in by_key.values())


def campaign(server: str, kind: str, batch_handler: bool, keys: int, per_key: int, name: str):  # type: ignore[no-untyped-def]
    mark = pytest.mark.mysql if server == "mysql" else pytest.mark.postgres
    return pytest.param(server, kind, batch_handler, keys, per_key, marks=mark, id=f"{name}-{kind}-{server}")


# What differs in the code under a kill: per-message or batch handlers, sync (Engine) or async
# (AsyncEngine on asyncpg, async def handlers) sessions, many keys or two hot ones (every batch
# is then a run of one key, so a kill lands inside runs), and the database. The first three
# are paired so that every pair of their choices is killed at least once (four campaigns
# instead of eight: one campaign is about a minute); MySQL/MariaDB adds its store.
# The stream only has to outlast the kills (KILLS): each kill comes within 0.8 s of the restarted
# consumer's first effect and before 15 % of what is left is applied, so every kill lands
# mid-stream whatever its length; what follows the last kill is a plain drain. At 20,000 messages
# (5,000 on hot keys) the fifth kill came at about 3,000: most of the campaign was that drain, so
# the streams were halved (at least 44 % of each is still to come at its last kill). At 10,000
# (1,000 keys of 10) the fifth kill came at 880 and 1,489 on a loaded host (2026-12-04): every kill
# fell in the first two of a key's ten seqs, and nine tenths of the campaign was the drain. So the
# many-key streams are 500 keys of 10 seqs: the same chains per key, half the drain, and the kills
# reach further into each key's chain (the cap on what a kill may wait for keeps them mid-stream).
KILLS = 5
"""Kills per campaign: five campaigns, twenty-five kills in all, each at a random point of its stream."""
KILLED_SESSION_MS = 2000
"""The campaign's consumers' session: the restarted consumer gets its partitions only once the
killed one's session ran out (the classic protocol's join waits for every member it knows), so each
kill cost the 4 s of ``inbox_worker``'s default, most of a kill's cycle. What a kill proves does not
depend on it: the killed consumer is dead and its uncommitted work comes again to the next one
whatever the session's length, and each kill still waits for that one's first effect. 2 s is four
of its 0.5 s heartbeats, sent by librdkafka's own thread (not held by the handlers' GIL), and a
heartbeat missed under load only makes one more rebalance, which the campaign must survive anyway."""
CAMPAIGNS = [
    campaign("postgres", "sync", False, 500, 10, "handler"),
    campaign("postgres", "async", True, 500, 10, "batch_handler"),
    campaign("postgres", "async", False, 2, 1250, "hot_keys_handler"),
    campaign("postgres", "sync", True, 2, 1250, "hot_keys_batch_handler"),
    campaign("mysql", "sync", False, 500, 10, "handler"),
]


@pytest.mark.parametrize(("server_db_url", "kind", "batch_handler", "keys", "per_key"), CAMPAIGNS,
                         indirect=["server_db_url"])
def test_exactly_once_effects_when_the_consumer_is_killed_again_and_again(
    pg: sa.Engine, server_db_url: str, kafka: str, topic: str, batch_handler: bool, keys: int,
    per_key: int, kind: str
) -> None:
    group = f"crash-{topic}"
    produce_keys(kafka, topic, keys, per_key)
    rng = random.Random(int(time.time()))
    worker = start_worker(server_db_url, kafka, topic, group, batch_handler=batch_handler, kind=kind,
                          session_timeout_ms=KILLED_SESSION_MS)
    killed_at: list[int] = []
    try:
        for _ in range(KILLS):
            resumed = wait_for_count(pg, effect_count(pg), 90, [worker])  # it consumes again
            # Kill after a random time, but before a fast consumer (an async batch handler on
            # asyncpg) runs out of stream: never past a random share of what is left.
            kill_by = resumed + int((keys * per_key - resumed) * rng.uniform(0.02, 0.15))
            deadline = time.monotonic() + rng.uniform(0.05, 0.8)
            while time.monotonic() < deadline and effect_count(pg) < kill_by:
                time.sleep(0.01)
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            killed_at.append(effect_count(pg))
            worker = start_worker(server_db_url, kafka, topic, group, batch_handler=batch_handler,
                                  kind=kind, session_timeout_ms=KILLED_SESSION_MS)
        deadline = time.monotonic() + 240
        while effect_count(pg) < keys * per_key and time.monotonic() < deadline:
            assert worker.poll() is None, f"worker exited with {worker.returncode}"
            time.sleep(0.2)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
    assert len(killed_at) == KILLS and max(killed_at) < keys * per_key, killed_at  # all mid-stream
    assert_exactly_once_in_order(pg, group, keys, per_key)
    m = Inbox(pg, group=group).tables.inbox_messages
    with pg.connect() as conn:
        redelivered = conn.scalar(sa.select(sa.func.sum(m.c.deliveries))) - keys * per_key
    print(f"killed after {killed_at} effects; {redelivered} redeliveries dropped")
    assert redelivered > 0, "no crash caused a redelivery: the test did not exercise replay"


def drain(pg: sa.Engine, total: int, worker: subprocess.Popen[bytes], timeout: float,
          stalled_after: float | None = None) -> None:
    """Wait up to ``timeout`` s for ``total`` effects while ``worker``, the one left, keeps running
    (the callers assert the count afterwards, with what else they know). ``stalled_after``: fail as
    soon as no effect was added for that long (a stall, told apart from a slow, loaded host)."""
    deadline = time.monotonic() + timeout
    count, moved = effect_count(pg), time.monotonic()
    while count < total and time.monotonic() < deadline:
        assert worker.poll() is None, f"worker exited with {worker.returncode}"
        time.sleep(0.2)
        now, before, count = time.monotonic(), count, effect_count(pg)
        if count > before:
            moved = now
        assert stalled_after is None or now - moved < stalled_after, (
            f"no effect for {now - moved:.0f}s at {count} of {total}: the consumer stalled")


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_rebalance_when_one_of_two_consumers_leaves_mid_stream(
    pg: sa.Engine, server_db_url: str, kafka: str, topic: str, tmp_path: Path, group_protocol: str
) -> None:
    """Two consumers share the stream; one leaves (SIGTERM) mid-stream: the other takes its
    partitions and every effect lands once, in key order. Under both of Apache Kafka's group
    protocols: classic (the consumers assign, eagerly) and KIP-848's ``consumer`` (the broker
    assigns, incrementally)."""
    # The second leaves 500 effects after it got partitions (at 540 of 20,000 in a loaded run, at
    # 1,020 of 10,000 in another): a stream of 5,000 still leaves the first most of it to take over.
    keys, per_key, group = 500, 10, f"rebalance-{topic}"
    produce_keys(kafka, topic, keys, per_key)
    first = start_worker(server_db_url, kafka, topic, group, group_protocol=group_protocol)
    second_log = tmp_path / "second.log"
    second = start_worker(server_db_url, kafka, topic, group, log=second_log,
                          group_protocol=group_protocol)
    try:
        deadline = time.monotonic() + 60
        while f"assigned [({topic!r}, " not in second_log.read_text():
            assert time.monotonic() < deadline, "the second consumer never got partitions"
            assert second.poll() is None, f"worker exited with {second.returncode}"
            time.sleep(0.1)
        stopped_at = wait_for_count(pg, effect_count(pg) + 500, 90, [first, second])
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        drain(pg, keys * per_key, first, 120)
    finally:
        for w in (first, second):
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
                w.wait(60)
    print(f"the second consumer left at {stopped_at} of {keys * per_key} effects")
    assert stopped_at < keys * per_key
    assert first.returncode == 0
    # Its last revoke (on leaving) names the partitions it owned mid-stream.
    revokes = [line for line in second_log.read_text().splitlines() if "revoked [" in line]
    assert revokes and f"({topic!r}, " in revokes[-1], revokes
    assert_exactly_once_in_order(pg, group, keys, per_key)


@pytest.mark.parametrize("server_db_url", ["postgres"], indirect=True)  # the database plays no part
def test_a_revocation_under_kip_848_never_waits_on_its_own_commit(
    pg: sa.Engine, server_db_url: str, kafka: str, topic: str, tmp_path: Path
) -> None:
    """KIP-848's protocol: a consumer frozen past the broker's session (6 s) is fenced and its
    partitions go to the other; thawed, it rejoins and the broker takes partitions back from the
    other. librdkafka serves no synchronous commit made inside a revoke callback until the
    callback returns: the inbox's commit of the revoked partitions' work waited its 45 s timeout
    and stalled the consumer ("offset commit failed: no answer within 45s"), and a SIGTERM in one
    never finished. Both workers' logs must show neither; the other drains the stream after the
    second leaves. (Without the fix, 3 of 4 runs of this scenario showed one or the other.)"""
    keys, per_key, group = 1000, 20, f"kip848-{topic}"
    produce_keys(kafka, topic, keys, per_key)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = start_worker(server_db_url, kafka, topic, group, log=logs[0], group_protocol="consumer")
    second = start_worker(server_db_url, kafka, topic, group, log=logs[1], group_protocol="consumer")
    try:
        deadline = time.monotonic() + 60
        while f"assigned [({topic!r}, " not in logs[1].read_text():
            assert time.monotonic() < deadline, "the second consumer never got partitions"
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)
        time.sleep(9)  # past the broker's 6 s session (outbox.testing's TEST_SETTINGS): fenced
        first.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while logs[0].read_text().count("assigned [") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        second.send_signal(signal.SIGTERM)  # while the broker moves partitions back
        assert second.wait(60) == 0
        # A stalled commit waited 45 s: no effect for 30 s is that stall, however slow the host.
        drain(pg, keys * per_key, first, 180, stalled_after=30)
    finally:
        for w in (first, second):
            if w.poll() is None:
                w.send_signal(signal.SIGCONT)
                w.send_signal(signal.SIGTERM)
                w.wait(60)
    text = "\n".join(log.read_text() for log in logs)
    assert "no answer within" not in text and "did not finish" not in text, text[-6000:]
    assert_exactly_once_in_order(pg, group, keys, per_key)
