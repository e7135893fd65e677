"""A consumer whose group join was cut short by a broker freeze rejoins by itself (``KafkaSource``).

The broker is frozen with SIGSTOP (``FREEZE`` seconds, ``MOCK_FREEZE`` the mock) under a running
consumer process, in rounds: right after the consumer subscribed, so its
JoinGroup request is in flight when the broker stops, and during steady
consumption. Every round, consumption must resume within ``RESUME`` seconds of
SIGCONT (a record applied that was not at SIGCONT), the rest must follow
(``DRAIN``), and every message must be applied exactly once, in key order.

Two brokers. Apache Kafka (a ``LocalKafka`` of the test's own, its JVM frozen):
the promise as users meet it; Kafka answers the pending JoinGroup once thawed,
so the consumer resumes without the rejoin watch too (checked: it passes with
the watch off). librdkafka's mock cluster in a process of its own: the thawed
mock never answers that JoinGroup, and librdkafka would wait
``max.poll.interval.ms`` + 3 s for it, consuming nothing — a lost answer, as a
half-open connection gives. That is the rejoin watch's proof: without it the
join rounds stall for five minutes (checked: they fail at ``RESUME``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox import Inbox, create_engine
from tests.inbox_support import business
from tests.test_inbox_crash import assert_exactly_once_in_order, effect_count, produce_keys
from transports.testing import BrokerProcess

pytestmark = pytest.mark.xdist_group("timing")  # wall-clock bounds: one at a time (docs/testing.md)

WORKER = Path(__file__).with_name("inbox_worker.py")
FREEZE = float(os.environ.get("REJOIN_FREEZE_SECONDS", "15"))
"""Seconds Apache Kafka is frozen: the shortest freeze that left the join unanswered in trials.
``REJOIN_FREEZE_SECONDS=60`` runs the issue's own 60 s freeze on both brokers (docs/testing.md)."""
MOCK_FREEZE = float(os.environ.get("REJOIN_FREEZE_SECONDS", "6"))
"""Seconds the mock is frozen: past the consumer's 4 s session (``inbox_worker.py``), after which
the thawed mock leaves the pending JoinGroup unanswered. With the watch's rejoin disabled, a 6 s
freeze stalled round 0 in 3 runs of 3 (0 of 1,000 applied 28 s after SIGCONT); a 2 s freeze, inside
the session, stalled none (the join answered after the thaw: nothing for the watch to do)."""
REJOIN_AFTER = 8.0
RESUME = REJOIN_AFTER + 20.0
"""Seconds after SIGCONT by which consumption must have resumed (a record applied that was not
at SIGCONT): the watch's next probe (5 s), its 2 s metadata timeout and a join, with room for a
slow machine. Measured under load (two cores, load average 12-31): back in its group at most
8.7 s after SIGCONT, mostly under 2 s (docs/testing.md)."""
DRAIN = 90.0
"""Seconds after resuming for the rest of the 1,000 records: throughput, which the promise is not
about. On the loaded machine that took up to 29 s (back in the group 2.4 s after SIGCONT, all
applied 31.8 s after it); with every record inside ``RESUME`` the round failed although
nothing stalled."""
KEYS, PER_KEY = 100, 10


def consumer(db: str, bootstrap: str, topic: str, group: str, log: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, str(WORKER), db, bootstrap, topic, group, "--rejoin-after", str(REJOIN_AFTER),
         "--concurrency", "4", "--batch-size", "10"],
        stdout=subprocess.PIPE, stderr=log.open("wb"))
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"ready", log.read_text()
    return process


class BrokerLog:
    """What the broker logged since the freeze, for a failure's message: whether the thawed broker
    was fenced, reloaded the group's coordinator, or logged nothing at all. (The mock has no log.)"""

    def __init__(self, broker: Any) -> None:
        self.path: Path | None = getattr(broker, "log_path", None)
        self.start = self.path.stat().st_size if self.path is not None and self.path.exists() else 0

    def since_freeze(self, lines: int = 40) -> str:
        if self.path is None or not self.path.exists():
            return ""
        with self.path.open("rb") as f:
            f.seek(self.start)
            logged = [line for line in f.read().decode(errors="replace").splitlines()
                      if line.startswith("[")]  # not the indented config dumps and stack frames
        return f"\nthe broker's log since the freeze (last {lines} of {len(logged)} lines):\n" + "\n".join(
            logged[-lines:])


ROUNDS = {"kafka": ["join", "steady"], "mock": ["join", "join", "join"]}
"""Apache Kafka answers the pending JoinGroup once thawed: one round of each kind shows the
promise as users meet it. The mock leaves it unanswered, the race the watch exists for: its
rounds are all joins, repeated because the freeze may land before or after the request."""


@pytest.fixture(params=[pytest.param("kafka", marks=pytest.mark.kafka),
                        pytest.param("mock", marks=pytest.mark.any_kafka)])
def freezable(request: pytest.FixtureRequest) -> Iterator[tuple[Any, list[str], float]]:
    """A broker to freeze, its rounds and each freeze's seconds: Apache Kafka (``own_kafka``),
    then the mock in a process of its own."""
    if request.param == "kafka":
        yield request.getfixturevalue("own_kafka"), ROUNDS["kafka"], FREEZE
        return
    with BrokerProcess() as broker:
        yield broker, ROUNDS["mock"], MOCK_FREEZE


@pytest.mark.slow
def test_a_broker_freeze_during_the_join_or_consumption_never_stalls_the_consumer(
    tmp_path: Path, freezable: tuple[Any, list[str], float]
) -> None:
    broker, rounds, freeze = freezable
    for n, when in enumerate(rounds):
        db = f"sqlite:///{tmp_path / f'round-{n}.db'}"
        engine = create_engine(db)
        group = f"rejoin-{uuid.uuid4().hex[:8]}"
        Inbox(engine, group=group).create_tables()
        business.create_all(engine)
        topic = f"t-{uuid.uuid4().hex[:10]}"
        produce_keys(broker.bootstrap, topic, KEYS, PER_KEY)
        log = tmp_path / f"round-{n}.log"
        process = consumer(db, broker.bootstrap, topic, group, log)
        try:
            if when == "join":
                time.sleep(0.3)  # subscribed, first poll: the JoinGroup goes out now
            else:
                deadline = time.monotonic() + 60
                while effect_count(engine) < KEYS:
                    assert time.monotonic() < deadline, f"round {n}: never consumed\n{log.read_text()}"
                    time.sleep(0.02)
            before = effect_count(engine)
            broker_log = BrokerLog(broker)
            broker.freeze()
            time.sleep(freeze)
            broker.thaw()
            thawed = time.monotonic()
            at_thaw, resumed = effect_count(engine), None
            while (applied := effect_count(engine)) < KEYS * PER_KEY:
                assert process.poll() is None, f"round {n}: the consumer exited\n{log.read_text()}"
                now = time.monotonic()
                if resumed is None and applied > at_thaw:
                    resumed = now
                assert resumed is not None or now - thawed < RESUME, (
                    f"round {n} ({when}): {applied} of {KEYS * PER_KEY} applied {RESUME}s after SIGCONT, "
                    f"none since ({before} before the freeze)\n{log.read_text()}{broker_log.since_freeze()}")
                assert resumed is None or now - resumed < DRAIN, (
                    f"round {n} ({when}): resumed {resumed - thawed:.1f}s after SIGCONT, but only {applied} "
                    f"of {KEYS * PER_KEY} applied {DRAIN}s later\n{log.read_text()}")
                time.sleep(0.1)
        finally:
            if broker.frozen:
                broker.thaw()
            process.terminate()
            process.wait(30)
        assert_exactly_once_in_order(engine, group, KEYS, PER_KEY)
        engine.dispose()
        if when == "join":
            assert before < KEYS * PER_KEY, f"round {n}: all consumed before the freeze"


def test_readyz_says_why_a_consumer_has_no_partitions(sqlite_db: str) -> None:
    """The join state comes from librdkafka's statistics; ``/readyz`` names it once it lasts."""
    from outbox.ops import inbox_readiness
    from transports.kafka import KafkaSource

    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], rejoin_after=30)
    ready = inbox_readiness(create_engine(sqlite_db), source)
    try:
        source._statistics('{"cgrp": {"state": "up", "join_state": "steady"}}')
        assert source.group_problem() is None
        assert ready() == "no partitions assigned"  # steady: more consumers than partitions
        source._statistics('{"cgrp": {"state": "up", "join_state": "wait-join"}}')
        assert source.group_problem() is None, "a rebalance in progress is no problem yet"
        source._unjoined_since = time.monotonic() - 12  # as if it had waited that long
        problem = ready()
        assert problem is not None and problem.startswith("no partitions assigned: not joined")
        assert "wait-join" in problem and "30s" in problem, problem
        source._statistics('{"cgrp": {"state": "wait-coord"}}')
        assert "coordinator wait-coord" in (source.group_problem() or "")
        source._statistics('{"cgrp": {"state": "up", "join_state": "steady"}}')
        assert source.group_problem() is None
    finally:
        source.close()


def test_the_watch_starts_at_the_first_poll_and_not_without_statistics() -> None:
    """A consumer built long before its first poll is not "out of its group" since construction."""
    from transports.kafka import KafkaSource

    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], rejoin_after=30)
    quiet = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                        settings={"statistics.interval.ms": 0}, rejoin_after=30)
    try:
        assert source._unjoined_since is None
        source.poll(1, 0.01)
        assert source._unjoined_since is not None
        quiet.poll(1, 0.01)
        quiet._statistics('{"cgrp": {"state": "up", "join_state": "wait-join"}}')
        assert quiet._unjoined_since is None and quiet.group_problem() is None
    finally:
        source.close()
        quiet.close()


def test_a_consumer_whose_statistics_come_rarely_is_not_replaced_for_their_silence(kafka: str) -> None:
    """A user's ``statistics.interval.ms`` longer than ``rejoin_after``: no report yet is no evidence.

    Joined and consuming, it got no statistics within ``rejoin_after`` because none were due;
    replacing it then (and its successor, for the same silence) would churn the group forever.
    """
    from transports.kafka import KafkaSource

    topic = f"t-{uuid.uuid4().hex[:10]}"
    produce_keys(kafka, topic, 1, 1)
    source = KafkaSource(bootstrap_servers=kafka, group_id=f"g-{uuid.uuid4().hex[:8]}", topics=[topic],
                         settings={"statistics.interval.ms": 3_600_000}, rejoin_after=0.5)
    try:
        got: list[object] = []
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline, "never consumed"
            got += source.poll(10, 0.2)
        end = time.monotonic() + 1.5  # three times rejoin_after, the broker answering throughout
        while time.monotonic() < end:
            source.poll(10, 0.1)
        assert source.rejoins == 0
        assert source.group_problem() is None
    finally:
        source.close()


def test_a_watch_whose_probe_goes_unanswered_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """Out of its group past ``rejoin_after`` with no broker answering: one line says the probe went
    unanswered (the worker log of a stalled consumer then tells a silent broker from a watch that
    never ran); the probes after it say nothing, and no consumer is replaced."""
    import logging

    from transports.kafka import KafkaSource, _source

    caplog.set_level(logging.INFO, logger="transports.kafka")
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], rejoin_after=30)
    try:
        source.poll(1, 0.01)
        source._statistics('{"cgrp": {"state": "query-coord"}}')
        source._unjoined_since = time.monotonic() - 40  # as if out of the group that long
        for _ in range(2):
            source._next_probe = 0.0  # the next probe is due at once
            source.poll(1, 0.01)
        said = [m for r in caplog.records if "does not answer a metadata request" in (m := r.getMessage())]
        assert len(said) == 1, said
        assert "not joined for 40s (join state coordinator query-coord)" in said[0], said[0]
        assert f"asked every {_source._PROBE_EVERY:g}s" in said[0], said[0]
        assert source.rejoins == 0
    finally:
        source.close()


class _Brokerless:
    """A consumer whose client has no broker left to ask (``KafkaSource._bootstrap_answers``): its
    metadata requests fail at once, as librdkafka's do once a fenced broker's metadata response
    (listing no broker) made it drop its only one; everything else is the real consumer's."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        from confluent_kafka import KafkaError, KafkaException

        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "no broker left"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.consumer, name)


def test_a_consumer_whose_client_lost_every_broker_is_replaced_once_the_bootstrap_servers_answer(
    kafka: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of its group past ``rejoin_after``, its own probe unanswered, the broker answering: replaced.

    The 12:19 stall (docs/testing.md): a broker thawed after 15 s was fenced by its own controller
    for ~0.2 s, its metadata response in that window listed no broker, and librdkafka dropped the
    only one it had; the consumer sat in ``query-coord`` with every probe of its own client
    unanswered, so the watch called the broker silent for as long as librdkafka's 5-minute
    re-bootstrap. A new consumer, started from ``bootstrap.servers``, joins and consumes.
    """
    from transports.kafka import KafkaSource

    topic = f"t-{uuid.uuid4().hex[:10]}"
    produce_keys(kafka, topic, 1, 1)
    source = KafkaSource(bootstrap_servers=kafka, group_id=f"g-{uuid.uuid4().hex[:8]}", topics=[topic],
                         rejoin_after=0.5)
    try:
        monkeypatch.setattr(source, "_consumer", _Brokerless(source._consumer))
        source.poll(1, 0.01)
        source._statistics('{"cgrp": {"state": "query-coord"}}')
        source._unjoined_since = time.monotonic() - 1  # out of the group past rejoin_after
        source.poll(1, 0.01)
        assert source.rejoins == 1, "the watch took the client's silence for the broker's"
        got: list[object] = []
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline, "the new consumer never consumed"
            got += source.poll(10, 0.2)
    finally:
        source.close()
