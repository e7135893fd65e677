"""The inbox and a broker that is gone: found by the failover campaign on three Apache Kafka nodes.

With two of three nodes killed (``tests/test_failover_campaign.py``) the group
coordinator was gone, the inbox's synchronous offset commit waited for it for
a session timeout and failed with librdkafka's ``_WAIT_COORD``, a bare error
code whose ``retriable()`` is False: ``KafkaSource`` raised a plain
``TransportError``, the consumer loop ended, its clean-up then hung in a close
the dead broker never answered, and ``outbox inbox run`` exited 0 without a
word of why. Each of the three is proved here on its own: the commit error is
an outage (on a real broker, and for every code librdkafka gives for one), a
loop that fails is never a clean stop even when its clean-up hangs, and a
commit outage is logged once each way (empty polls between failing commits
said "available again" every half second).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from outbox import (
    CommitRefusedError,
    CommitUnansweredError,
    CommitUnconfirmedError,
    Inbox,
    RetriableTransportError,
    TransportError,
    create_engine,
)
from outbox.testing import LocalKafka
from tests.inbox_support import TOPIC, AlertLog, apply_effect, business, record
from tests.test_inbox_runner import ScriptedSource, at
from transports import Record
from transports.kafka import KafkaSource


class _FailingCommits:
    """A stand-in for a confluent-kafka consumer whose ``commit`` raises ``error`` (as librdkafka
    raises a synchronous commit's error: a bare code, ``retriable()`` False)."""

    def __init__(self, error: KafkaError) -> None:
        self.error = error

    def commit(self, **kwargs: object) -> None:
        raise KafkaException(self.error)


def _source_failing_with(code: int) -> KafkaSource:
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"])
    source._consumer.close()
    source._consumer = _FailingCommits(KafkaError(code))  # type: ignore[assignment]
    return source


@pytest.mark.parametrize("code", [
    KafkaError._WAIT_COORD, KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
    KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION,
    KafkaError.NOT_ENOUGH_REPLICAS,
], ids=lambda code: KafkaError(code).name())
def test_a_commit_without_a_coordinator_is_an_outage(code: int) -> None:
    assert not KafkaError(code).retriable()  # what made them end the inbox
    with pytest.raises(RetriableTransportError, match="offset commit failed"):
        _source_failing_with(code).commit({("t", 0): 1})


class _UnansweredCommits:
    """A consumer whose commit waits until ``answer`` is set, as librdkafka's does for a coordinator
    it knows but cannot reach (librdkafka #3740)."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.calls = 0

    def commit(self, **kwargs: object) -> None:
        self.calls += 1
        self.answer.wait()


def _raised_within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """What ``call`` raised (None if it returned), failing the test if it is still running."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds:g} s"
    return outcome[0]


def test_a_commit_without_an_answer_is_an_outage_after_the_commit_timeout() -> None:
    """No wall-clock bound a loaded host can miss: "refused at once" is "without waiting out a
    commit timeout" (a minute by then), and the first commit has landed when its thread has ended,
    not 0.1 s after its answer (on a host that slow it would still be pending, and the next refused)."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], session_timeout_ms=1000)
    source._consumer.close()
    unanswered = _UnansweredCommits()
    source._consumer = unanswered  # type: ignore[assignment]
    assert source.commit_timeout == 1.0  # the session timeout
    source.commit_timeout = 0.2
    raised = _raised_within(5, lambda: source.commit({("t", 0): 1}))
    assert isinstance(raised, RetriableTransportError) and "no answer within 0.2s" in str(raised), raised
    # One commit in flight at a time: the next is refused at once while the first still waits.
    source.commit_timeout = 60
    raised = _raised_within(30, lambda: source.commit({("t", 0): 2}))
    assert isinstance(raised, RetriableTransportError) and "earlier commit still waits" in str(raised)
    assert unanswered.calls == 1
    unanswered.answer.set()  # the coordinator is back: the first commit lands, the next goes through
    first = source._commits._pending
    assert first is not None
    first.join(10)
    assert _raised_within(5, lambda: source.commit({("t", 0): 2})) is None
    assert unanswered.calls == 2


def test_a_poll_is_not_held_by_a_commit_given_up_on_that_still_waits() -> None:
    """confluent-kafka lets one thread at a time into a consumer: a ``consume`` waits, inside the C
    call, for a commit still pending on its helper thread. A commit that never ends (its
    coordinator known but dead) held the inbox's poll forever: it polled nothing and never said the
    broker was gone (the failover campaign). Here a real consumer's commit waits for a coordinator
    of a broker that is not there (until its session timeout, 30 s); given up on after 0.3 s, the
    next poll must come back while the commit still waits, well before it ends.

    The session was 3 s and the poll had 1.5 s: a host that stalled the test for a second or two
    would fail it, or let the commit end first ("nothing was proved"). The commit now outlasts any
    stall, and the poll has half of it."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                         session_timeout_ms=30_000)
    source.commit_timeout = 0.3
    try:
        raised = _raised_within(5, lambda: source.commit({("t", 0): 1}))
        assert isinstance(raised, RetriableTransportError) and "no answer within 0.3s" in str(raised), raised
        started = time.monotonic()
        polled = _raised_within(20, lambda: source.poll(10, 0.1))
        took = time.monotonic() - started
        assert polled is None and took < 15, f"the poll came back after {took:.1f} s"
        assert not source._commits.wait_pending(0), "the commit ended first: nothing was proved"
    finally:
        threading.Thread(target=source.close, daemon=True).start()  # after its commit: up to 30 s


def test_a_commit_the_broker_can_never_take_is_still_an_error() -> None:
    with pytest.raises(TransportError) as raised:
        _source_failing_with(KafkaError.GROUP_AUTHORIZATION_FAILED).commit({("t", 0): 1})
    assert not isinstance(raised.value, RetriableTransportError)


@pytest.mark.kafka
def test_a_commit_to_a_killed_broker_is_an_outage_on_apache_kafka(own_kafka: LocalKafka) -> None:
    """The real thing: the coordinator killed, a commit waits out the session and says _WAIT_COORD."""
    producer = Producer({"bootstrap.servers": own_kafka.bootstrap, "log_level": 0})
    for n in range(3):
        producer.produce("t", b"%d" % n, b"k")
    assert producer.flush(30) == 0
    source = KafkaSource(bootstrap_servers=own_kafka.bootstrap, group_id="g", topics=["t"],
                         session_timeout_ms=2000, heartbeat_interval_ms=500)
    try:
        got = []
        deadline = time.monotonic() + 60
        while len(got) < 3:
            assert time.monotonic() < deadline, "the records never came"
            got += source.poll(10, 0.5)
        source.commit({("t", got[0].partition): 1})
        own_kafka.kill()
        with pytest.raises(RetriableTransportError, match=r"coordinator|Waiting|transport|timed out"):
            source.commit({("t", got[0].partition): 3})
    finally:
        threading.Thread(target=source.close, daemon=True).start()  # its close waits for the dead broker


def test_a_coordinator_out_of_reach_past_a_session_timeout_makes_the_source_unavailable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's clock is the test's: on the loaded CI host 0.4 s between the report 0.6 s in
    and the look after it would have made "still within the session timeout" an outage."""
    from transports.kafka import _source

    clock = {"now": 1000.0}
    monkeypatch.setattr(_source, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], session_timeout_ms=1000)
    source._consumer.close()
    assert source.session_timeout == 1.0
    source._statistics('{"cgrp": {"state": "up", "join_state": "steady"}}')
    assert source.unavailable() is None
    source._statistics('{"cgrp": {"state": "query-coord", "join_state": "init"}}')
    assert source.unavailable() is None  # a coordinator moving: a failover, not yet an outage
    clock["now"] += 0.6
    source._statistics('{"cgrp": {"state": "wait-broker-transport", "join_state": "init"}}')
    assert source.unavailable() is None  # still within the session timeout, from the first report
    clock["now"] += 0.39
    assert source.unavailable() is None
    clock["now"] += 0.11
    assert source.unavailable() == "group coordinator out of reach for 1s, state wait-broker-transport"
    source._statistics('{"cgrp": {"state": "up", "join_state": "wait-join"}}')
    assert source.unavailable() is None


class Unavailable(ScriptedSource):
    """A source that says why the broker cannot serve it while ``why`` is set, as ``KafkaSource`` does;
    ``asked`` counts the inbox's questions."""

    why: str | None = None
    asked = 0

    def unavailable(self) -> str | None:
        self.asked += 1
        return self.why


def test_an_idle_consumer_whose_coordinator_is_gone_logs_the_outage_once_each_way(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Waited for by what the inbox says and asks, not by the clock: a loaded CI host took more than
    the second this test slept before the inbox first asked."""
    inbox = _inbox(sqlite_db)
    source = Unavailable([])
    caplog.set_level(logging.WARNING, logger="outbox.inbox")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "the broker" in r.getMessage()]

    with _running(inbox, source) as until:
        source.why = "group coordinator out of reach for 45s, state query-coord"
        until(lambda: len(lines()) >= 1)
        asked = source.asked
        until(lambda: source.asked >= asked + 10)  # many polls more, nothing to commit: no new line
        source.why = None
        until(lambda: len(lines()) >= 2)
        asked = source.asked
        until(lambda: source.asked >= asked + 10)
    assert len(lines()) == 2, lines()
    assert lines()[0].startswith("the broker unavailable (group coordinator out of reach for 45s"), lines()
    assert lines()[1].startswith("the broker available again after"), lines()


def _inbox(sqlite_db: str) -> Inbox:
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="outage", retry_backoff=0.001, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler(TOPIC)(apply_effect)
    return inbox


class CommitsFailing(ScriptedSource):
    """Commits fail (``error``) while ``down``; polls return nothing meanwhile, as librdkafka's do."""

    def __init__(self, records: list, error: Exception) -> None:  # type: ignore[type-arg]
        super().__init__(records)
        self.down = False
        self.error = error
        self.failed = 0
        self.close_forever = threading.Event()
        self.hang_on_close = False

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        if self.down:
            self.failed += 1
            time.sleep(0.05)
            raise self.error
        super().commit(offsets)

    def close(self) -> None:
        if self.hang_on_close:
            self.close_forever.wait()  # a close the dead broker never answers
        super().close()


@contextmanager
def _running(inbox: Inbox, source: object) -> Iterator[Callable[[Callable[[], object]], None]]:
    """``inbox.run(source)`` on a thread, stopped and joined at the end; yields ``until(condition)``,
    which waits for ``condition`` while the inbox runs and fails 30 s after the start."""
    thread = threading.Thread(target=inbox.run, args=(source,), kwargs={"install_signal_handlers": False},
                              daemon=True)
    deadline = time.monotonic() + 30

    def until(condition: Callable[[], object]) -> None:
        while not condition():
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)

    thread.start()
    try:
        yield until
    finally:
        inbox.stop()
        thread.join(30)
    assert not thread.is_alive(), "run() did not return after stop()"



def run_script(inbox: Any, source: Any, librdkafka: Any, monkeypatch: pytest.MonkeyPatch,
               caplog: pytest.LogCaptureFixture) -> None:
    """``inbox.run`` on ``source`` whose consumer is ``librdkafka`` (a script) until the script ends;
    then stopped, and one outage logged each way."""
    monkeypatch.setattr(source, "_consumer", librdkafka)
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    thread = threading.Thread(target=inbox.run, args=(source,), kwargs={"install_signal_handlers": False},
                              daemon=True)
    thread.start()
    try:
        assert librdkafka.done.wait(60), f"the script stopped at {librdkafka.steps[0].__name__}"
    finally:
        inbox.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert_one_outage_logged(caplog)

def assert_one_outage_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The inbox logged one broker outage: one line when it began, one when it ended."""
    lines = [r.getMessage() for r in caplog.records if "the broker" in r.getMessage()]
    assert [line.split(" (")[0].split(" after")[0] for line in lines] == [
        "the broker unavailable", "the broker available again"], lines


@pytest.mark.parametrize("error", [
    RetriableTransportError("offset commit failed: Local: Waiting for coordinator"),
    # No poll after it serves a revocation: the broker is gone, as told at the poll after each.
    CommitUnansweredError("offset commit failed: no answer within 10s (the group coordinator out of reach)"),
], ids=["refused", "unanswered"])
def test_a_commit_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    sqlite_db: str, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    inbox = _inbox(sqlite_db)
    source = CommitsFailing([at(record(TOPIC, "a", 1), 0, 0)], error)
    source.down = True
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with _running(inbox, source) as until:
        until(lambda: source.failed >= 5)  # a few commit intervals, many empty polls
        source.down = False
        until(lambda: source.commits)
    assert_one_outage_logged(caplog)
    assert source.commits == [{(TOPIC, 0): 1}]


class RebalanceBehindThePoll(ScriptedSource):
    """librdkafka under the classic protocol, as the failover campaign's logs show it: a rebalance
    begun while ``rebalancing`` holds each commit until the consumer's next poll serves its revoke,
    so the commit's bounded wait gives up first (``CommitUnansweredError``); a commit inside that
    revoke meets the first one still waiting. Once the revoke is served, commits are answered."""

    def __init__(self, records: list[Record]) -> None:
        super().__init__(records)
        self.rebalancing = False
        self.unanswered = 0
        self.serving = False

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        self.serving = self.revoke is not None
        try:
            return super().poll(max_records, timeout)
        finally:
            if self.serving:
                self.serving = self.rebalancing = False  # the rebalance went on once its revoke was served

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        if not self.rebalancing:
            return super().commit(offsets)
        self.unanswered += 1
        if self.serving:
            raise CommitUnansweredError("offset commit failed: an earlier commit still waits for the group "
                                        "coordinator")
        self.revoke = [(TOPIC, 0), (TOPIC, 1)]  # what the rebalance waits for this consumer to serve
        time.sleep(0.05)
        raise CommitUnansweredError("offset commit failed: no answer within 10s (the group coordinator out "
                                    "of reach)")


def test_a_commit_held_by_a_rebalance_behind_the_next_poll_is_no_outage(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The failover campaign's inboxes logged "the broker unavailable (... no answer within 10s ...)"
    and "available again after 0.0s" at each rebalance that began while work was in flight: the
    commit waited for the revoke that only the next poll serves. The broker never stopped
    answering: nothing is logged, and the next commit goes through."""
    inbox = _inbox(sqlite_db)
    source = RebalanceBehindThePoll([at(record(TOPIC, "a", 1), 0, 0), at(record(TOPIC, "b", 1), 1, 0)])
    source.rebalancing = True
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with _running(inbox, source) as until:
        until(lambda: source.unanswered >= 2 and not source.rebalancing)
        source.pending = [at(record(TOPIC, "c", 1), 0, 1)]  # reassigned: the consumer goes on
        until(lambda: any(c.get((TOPIC, 0)) == 2 for c in source.commits))  # c applied, committed
    assert [r.getMessage() for r in caplog.records if "the broker" in r.getMessage()] == []
    # Nothing of the revoked positions (b's partition 1 above all). A commit tick while c's
    # transaction still runs commits c's own offset, where the consumer was reassigned (a loaded
    # host's transaction can outlast the 0.5 s between ticks): nothing new, and nothing lost.
    assert source.commits in ([{(TOPIC, 0): 2}], [{(TOPIC, 0): 1}, {(TOPIC, 0): 2}]), source.commits


class LostInAnOutage(RebalanceBehindThePoll):
    """A frozen coordinator as librdkafka meets it: the commit gets no answer, and meanwhile the
    consumer's session runs out, so the next poll serves the loss of its partitions (``on_lost``,
    through the revoke callbacks, counted by ``lost_assignments`` as ``KafkaSource`` counts it); the
    statistics still say the coordinator is up (no ``unavailable``, ``answering`` true)."""

    losses = 0

    def lost_assignments(self) -> int:
        return self.losses

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        if self.revoke is not None:
            self.losses += 1
        return super().poll(max_records, timeout)


def test_a_commit_unanswered_before_the_partitions_are_lost_is_an_outage(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an attack on the rule above: a coordinator that froze leaves the commit unanswered
    for a session timeout, and the consumer's own session runs out in that time, so the very next
    poll serves a revocation, the loss of its partitions: taken for the rebalance the commit waited
    for, the outage was logged at INFO as "no broker outage" and not at all as one."""
    inbox = _inbox(sqlite_db)
    source = LostInAnOutage([at(record(TOPIC, "a", 1), 0, 0)])
    source.rebalancing = True
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with _running(inbox, source) as until:
        until(lambda: source.losses and source.unanswered >= 2 and not source.rebalancing)  # the loss served
        source.pending = [at(record(TOPIC, "b", 1), 1, 0)]  # assigned again: the consumer goes on
        until(lambda: source.commits)
    lines = [r.getMessage() for r in caplog.records if "the broker" in r.getMessage()]
    assert lines and lines[0].startswith("the broker unavailable (CommitUnansweredError"), lines
    assert_one_outage_logged(caplog)
    assert source.commits == [{(TOPIC, 1): 1}]


def test_kafka_source_counts_a_lost_assignment_apart_from_a_revocation() -> None:
    """Both go through the revoke callbacks; only a loss counts in ``lost_assignments``."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"])
    try:
        gone: list[object] = []
        source.on_revoke(gone.append)
        source._revoked(source._consumer, [TopicPartition("t", 0)])
        assert source.lost_assignments() == 0
        source._lost(source._consumer, [TopicPartition("t", 1)])
        assert source.lost_assignments() == 1
        assert gone == [[("t", 0)], [("t", 1)]]
    finally:
        source._consumer.close()


class UnansweredAtStop(ScriptedSource):
    """Commits are refused (the group moved on: the positions stay uncommitted, no outage) until
    ``inbox`` stops; the one it makes at the stop gets no answer."""

    def __init__(self, records: list[Record], inbox: Inbox) -> None:
        super().__init__(records)
        self.inbox = inbox
        self.refused = 0
        self.unanswered = 0

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        if not self.inbox.stopping:
            self.refused += 1
            raise CommitRefusedError("offset commit refused: Broker: Specified group generation id is "
                                     "not valid")
        self.unanswered += 1
        raise CommitUnansweredError("offset commit failed: no answer within 10s (the group coordinator out "
                                    "of reach)")


def test_a_commit_unanswered_at_the_stop_is_logged(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an attack on the rule above: an unanswered commit is told at the next poll, and the
    commit made at the stop has none, so it went unsaid, where any other commit failing at the stop
    says why its positions stay uncommitted (the next owner gets those records again)."""
    inbox = _inbox(sqlite_db)
    source = UnansweredAtStop([at(record(TOPIC, "a", 1), 0, 0)], inbox)
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with _running(inbox, source) as until:
        until(lambda: source.refused)  # applied, its position uncommitted
    assert source.unanswered >= 1  # the loop's own last commit may have met the stop too
    lines = [r.getMessage() for r in caplog.records if "no answer within 10s" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


class RevokedDuringOutage(CommitsFailing):
    """Commits fail while ``down``, except the one inside a revoke callback: sent without waiting, as
    ``KafkaSource`` does under KIP-848, it raises ``CommitUnconfirmedError`` even while down."""

    def __init__(self, records: list, error: Exception) -> None:  # type: ignore[type-arg]
        super().__init__(records, error)
        self.revoking = False
        self.unconfirmed: list[dict[tuple[str, int], int]] = []

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        self.revoking = True  # the callbacks run inside poll, before the records are taken
        try:
            return super().poll(max_records, timeout)
        finally:
            self.revoking = False

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        if self.revoking and offsets:
            self.unconfirmed.append(dict(offsets))
            raise CommitUnconfirmedError("offset commit sent; answered after the revoke callback")
        super().commit(offsets)


def test_a_revocation_in_a_broker_outage_does_not_end_the_outage(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an attack on the KIP-848 revoke commit: an unawaited commit was taken for the broker's
    answer, so a revocation (or a lost assignment) in the middle of an outage logged "the broker
    available again" while it went on, and the next poll logged it beginning a second time."""
    inbox = _inbox(sqlite_db)
    source = RevokedDuringOutage([at(record(TOPIC, "a", 1), 0, 0), at(record(TOPIC, "b", 1), 1, 0)],
                                 RetriableTransportError("offset commit failed: Local: Waiting for "
                                                         "coordinator"))
    source.down = True
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with _running(inbox, source) as until:
        until(lambda: source.failed >= 3)
        source.revoke = [(TOPIC, 0)]
        until(lambda: source.unconfirmed and source.failed >= 6)  # revoked; still down
        source.down = False
        until(lambda: source.commits)
    assert_one_outage_logged(caplog)
    assert source.unconfirmed == [{(TOPIC, 0): 1}]
    assert source.commits == [{(TOPIC, 1): 1}]


class CoordinatorGone(CommitsFailing):
    """Commits fail while ``down``; ``unavailable`` and ``answering`` say what ``KafkaSource``'s would:
    None within a session timeout of the coordinator's loss, and whether it is up."""

    why: str | None = None
    up = True

    def unavailable(self) -> str | None:
        return self.why

    def answering(self) -> bool:
        return self.up


def test_a_commit_outage_that_ends_in_a_revoke_is_not_taken_for_its_end(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The failover campaign with two of three nodes killed (its inboxes logged (2, 2)): commits
    failed, then the group let the partitions go (nothing left to commit), while the source's
    ``unavailable`` still gave the lost coordinator its grace; the poll took that None for an
    answer ("available again") and logged a second outage a moment later."""
    inbox = _inbox(sqlite_db)
    source = CoordinatorGone([at(record(TOPIC, "a", 1), 0, 0)],
                             RetriableTransportError("offset commit failed: no answer within 10s"))
    source.down, source.up = True, False
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with _running(inbox, source) as until:
        until(lambda: source.failed >= 2)  # the commit outage, logged
        source.revoke = [(TOPIC, 0)]  # the session expired: the group took the partition away
        until(lambda: source.revoke is None)
        time.sleep(1.5)  # commit intervals with nothing to commit, many polls within the grace
        source.why = "group coordinator out of reach for 10s, state wait-broker-transport"
        time.sleep(0.5)
        source.why, source.up, source.down = None, True, False  # the nodes are back
        time.sleep(0.5)
    assert_one_outage_logged(caplog)


def test_a_kafka_source_answers_only_while_its_coordinator_is_up() -> None:
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"])
    source._consumer.close()
    assert not source.answering()  # no report yet
    source._statistics('{"cgrp": {"state": "up", "join_state": "steady"}}')
    assert source.answering()
    source._statistics('{"cgrp": {"state": "wait-broker-transport", "join_state": "init"}}')
    assert not source.answering() and source.unavailable() is None  # within the grace: neither
    quiet = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                        settings={"statistics.interval.ms": 0})
    quiet._consumer.close()
    assert quiet.answering()  # no statistics: nothing to tell, as before


def _report(state: str, join: str, made: float | None = None) -> str:
    """A librdkafka statistics report of the group's coordinator ``state`` and ``join`` state, made at
    ``made`` (``time.monotonic()``, now unless given; librdkafka's ``ts``, in microseconds)."""
    made = time.monotonic() if made is None else made
    return json.dumps({"ts": int(made * 1_000_000), "cgrp": {"state": state, "join_state": join}})


def test_a_kafka_source_answers_only_on_a_fresh_report_of_the_consumer_in_its_group() -> None:
    """What ends a broker outage the inbox logged when nothing is left to commit. The loaded failover
    campaign's inbox-2 logged one outage of two nodes as two, each way (lines (2, 2)); the campaign's
    inboxes were served reports 10 to 57 s old (a report waits in the consumer's queue until a poll
    serves it, and none does while an offset commit holds the consumer), and their coordinator said
    "up" 10 s before the group was joined again ("wait-join": librdkafka's connection to a node
    restarted, not yet a group served). "Up" in the newest report served was taken for the answer."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"])
    source._consumer.close()
    source._statistics(_report("up", "steady"))
    assert source.answering()
    killed = time.monotonic()
    source._statistics(_report("up", "steady", made=killed - 30))  # served 30 s after it was made
    assert not source.answering()
    source._statistics(_report("wait-broker-transport", "steady"))
    assert not source.answering()
    source._statistics(_report("up", "wait-join"))  # the node back, the group not joined yet
    assert not source.answering()
    source._statistics(_report("up", "steady"))
    assert source.answering()


class _Message:
    """A consumed message as confluent-kafka hands it over, of ``r`` at ``offset``."""

    def __init__(self, r: Record, offset: int) -> None:
        self.r, self._offset = r, offset

    def error(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)

    def topic(self) -> str:
        return self.r.topic

    def value(self) -> bytes:
        return self.r.value

    def key(self) -> bytes | None:
        return self.r.key

    def headers(self) -> list[tuple[str, bytes]]:
        return list(self.r.headers)

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class _Librdkafka:
    """The confluent-kafka consumer under a ``KafkaSource``, played by ``steps``: each ``consume``
    serves what the current step gives (statistics reports, a lost or new assignment: librdkafka
    serves them inside ``consume``) and hands over its messages; a step returns True once it is
    done. Commits fail with ``_WAIT_COORD`` while ``down``, as they do with the coordinator gone."""

    def __init__(self, source: KafkaSource, steps: list[Callable[[_Librdkafka], bool]]) -> None:
        self.source, self.steps = source, steps
        self.down = False
        self.out: list[_Message] = []
        self.polls = 0  # consumes in the current step
        self.since = 0.0
        self.commits: list[dict[tuple[str, int], int]] = []
        self.failed = 0
        self.done = threading.Event()

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[_Message]:
        if self.steps and num_messages == 1:
            self.polls += 1
            if self.steps[0](self):
                self.steps.pop(0)
                self.polls = 0
        if not self.steps:
            self.done.set()
        out, self.out = self.out[:num_messages], self.out[num_messages:]
        if not out:
            self.done.wait(0.01)  # librdkafka's wait for a message, cut short: nothing comes
        return out

    def report(self, state: str, join: str, made: float | None = None) -> None:
        self.source._statistics(_report(state, join, made))

    def assign(self) -> None:
        self.source._assigned(self, [TopicPartition(TOPIC, 0)])

    def lose(self) -> None:
        self.source._lost(self, [TopicPartition(TOPIC, 0)])

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        if self.down:
            self.failed += 1
            raise KafkaException(KafkaError(KafkaError._WAIT_COORD))
        self.commits.append({(tp.topic, tp.partition): tp.offset for tp in offsets})

    def close(self) -> None:
        pass


REPORTS_EVERY = 0.5
"""The statistics interval of the stand-in's source: a report is fresh for two (1 s)."""


def _two_nodes_killed(false_answer: Callable[[_Librdkafka], bool], a: Record, b: Record,
                      ) -> list[Callable[[_Librdkafka], bool]]:
    """The failover campaign's two-of-three outage as the inbox's consumer meets it (its logs):
    commits fail with the coordinator's node killed; the session runs out and the partition is
    lost (nothing left to commit); ``false_answer`` plays what today's source took for the broker
    back; the coordinator stays out of reach past a session timeout (``unavailable`` says so);
    then the nodes are back: the consumer in its group again, its partition, the next commit
    stored. The broker was gone once."""

    def consuming(c: _Librdkafka) -> bool:
        if c.polls == 1:
            c.assign()
            c.out = [_Message(a, 0)]
        c.report("up", "steady")
        return {(TOPIC, 0): 1} in c.commits

    def killed(c: _Librdkafka) -> bool:
        c.down = True
        if c.polls == 1:
            c.out = [_Message(b, 1)]
        c.report("wait-broker-transport", "steady")
        return c.failed >= 2

    def lost(c: _Librdkafka) -> bool:
        if c.polls == 1:
            c.lose()
            c.since = time.monotonic()
        c.report("wait-broker-transport", "wait-unassign-call")
        return time.monotonic() - c.since > 1.0  # two of the inbox's commit ticks: nothing left to commit

    def out_of_reach(c: _Librdkafka) -> bool:
        c.report("wait-broker-transport", "init")
        if c.source.unavailable() is None:
            c.polls = 0
        return c.polls >= 5  # polls that asked while it said so

    def back(c: _Librdkafka) -> bool:
        c.down = False
        if c.polls == 1:
            c.assign()
            c.out = [_Message(b, 1)]  # from the committed position again: dropped as a duplicate
        c.report("up", "steady")
        return any(commit.get((TOPIC, 0)) == 2 for commit in c.commits)

    return [consuming, killed, lost, false_answer, out_of_reach, back]


def _connected_not_joined(c: _Librdkafka) -> bool:
    """A node restarted: librdkafka's connection to the coordinator up, the group not joined yet."""
    c.report("up", "wait-join")
    return c.polls >= 5


def _an_old_report(made: list[float]) -> Callable[[_Librdkafka], bool]:
    """A report made before the kill served now, the newest its poll serves (it waited in the queue
    while a commit held the consumer; a poll that hands over a record serves nothing behind it)."""

    def served(c: _Librdkafka) -> bool:
        if time.monotonic() - made[0] <= 3 * REPORTS_EVERY:  # not old enough yet to tell
            c.report("wait-broker-transport", "init")
            return False
        c.report("up", "steady", made=made[0])
        return c.polls >= 5

    return served


@pytest.mark.parametrize("false_answer", ["connected-not-joined", "an-old-report"])
def test_a_broker_outage_of_a_kafka_source_is_logged_once_each_way(
    sqlite_db: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, false_answer: str
) -> None:
    """The loaded failover campaign's inbox-2 logged the outage of two nodes (1, 2) twice each way,
    ending the second "after 0.2s", relays and the other inbox once. Its source's ``answering`` said
    yes on the newest report served saying the coordinator was "up": also a report made before the
    kill and served long after, and a coordinator connected to but not serving the group yet. The
    outage ended early, and began again once the coordinator had been out of reach a session
    timeout. Played here on a real ``KafkaSource``, librdkafka's side scripted: one outage, one
    line each way."""
    inbox = _inbox(sqlite_db)
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=[TOPIC],
                         settings={"session.timeout.ms": 1000,
                                   "statistics.interval.ms": int(REPORTS_EVERY * 1000)})
    source._consumer.close()
    made = [time.monotonic()]  # when the report the old-report step serves was made: before the kill
    a, b = record(TOPIC, "a", 1), record(TOPIC, "a", 2)
    steps = _two_nodes_killed(_connected_not_joined if false_answer == "connected-not-joined"
                              else _an_old_report(made), a, b)
    librdkafka = _Librdkafka(source, steps)
    run_script(inbox, source, librdkafka, monkeypatch, caplog)
    assert {(TOPIC, 0): 1} in librdkafka.commits and librdkafka.commits[-1] == {(TOPIC, 0): 2}


def test_a_consumer_loop_that_fails_is_not_a_clean_stop_even_when_its_close_hangs(sqlite_db: str) -> None:
    inbox = _inbox(sqlite_db)
    source = CommitsFailing([at(record(TOPIC, "a", 1), 0, 0)], TransportError("offset commit failed: nope"))
    source.down = source.hang_on_close = True
    failure: list[BaseException] = []

    def run() -> None:
        try:
            inbox.run(source, install_signal_handlers=False, stop_timeout=1.0)  # type: ignore[arg-type]
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    source.close_forever.set()
    assert not thread.is_alive(), "run() did not return"
    assert len(failure) == 1 and isinstance(failure[0], TransportError), failure


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_a_kafka_source_without_partitions_answers_once_in_its_group_on_apache_kafka(
        kafka: str, topic: str, group_protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More consumers than partitions: the one left without any is in its group and served, and an
    outage it logged (``unavailable``, with nothing to commit) can end only on ``answering``. Under
    KIP-848 librdkafka 2.16 reports such a member ``up`` with join state ``init`` for as long as it
    has no partition (seen: a 55 s kill of the single node, the unassigned inbox logged "the broker
    unavailable" and no "available again" 30 s after the node was back, its reports saying up/init
    every 2 s), so ``answering`` never says yes for it."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    settings: dict[str, object] = {"statistics.interval.ms": 500}
    if group_protocol == "consumer":
        settings.update({"group.protocol": "consumer", "fetch.wait.max.ms": 10})
    else:
        settings.update({"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    sources = [KafkaSource(bootstrap_servers=kafka, group_id=f"{topic}-g", topics=[topic], settings=settings)
               for _ in range(2)]
    states: list[dict[str, Any]] = [{}, {}]
    for source, state in zip(sources, states, strict=True):
        told = source._statistics

        def statistics(text: str, told: Callable[[str], None] = told, state: dict[str, Any] = state) -> None:
            state.update(json.loads(text).get("cgrp") or {})
            told(text)

        monkeypatch.setattr(source, "_statistics", statistics)
    try:
        deadline = time.monotonic() + 60
        while not (all(s.get("state") == "up" for s in states)
                   and sorted(s.get("assignment_size", -1) for s in states) == [0, 1]):
            assert time.monotonic() < deadline, f"the group never settled: {states}"
            for source in sources:
                source.poll(10, 0.1)
        for _ in range(20):  # a few reports more, both served
            for source in sources:
                source.poll(10, 0.1)
        idle = next(source for source, state in zip(sources, states, strict=True)
                    if state.get("assignment_size") == 0)
        assert idle.answering(), states
    finally:
        for source in sources:
            source.close()


def test_a_kip_848_consumer_without_partitions_is_not_replaced_by_the_rejoin_watch_on_apache_kafka(
        kafka: str, topic: str) -> None:
    """The same report (up, join state ``init``) read by the rejoin watch: it takes the idle member for
    one never joined and replaces it every ``rejoin_after`` (a WARNING "not joined for 5s (join state
    init) although the broker answers: replacing it" each time), for as long as it has no partition;
    with the default 60 s, a new consumer and a warning a minute, forever. Seen: 7 replacements in 40 s."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    settings = {"group.protocol": "consumer", "fetch.wait.max.ms": 10, "statistics.interval.ms": 500}
    sources = [KafkaSource(bootstrap_servers=kafka, group_id=f"{topic}-g", topics=[topic], rejoin_after=3,
                           settings=settings) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not any(source._assignment for source in sources):
            assert time.monotonic() < deadline, "no partition was ever assigned"
            for source in sources:
                source.poll(10, 0.1)
        settled = time.monotonic()
        while time.monotonic() < settled + 3 * 3 + 2:  # three times rejoin_after, and a report more
            for source in sources:
                source.poll(10, 0.1)
        assert [source.rejoins for source in sources] == [0, 0]
    finally:
        for source in sources:
            source.close()


def test_a_report_from_before_the_outage_does_not_end_it_with_a_long_statistics_interval(
    sqlite_db: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """"Fresh" is two statistics intervals, which a user's ``statistics.interval.ms`` may make longer
    than the outage so far: with reports every 60 s and the default 45 s session, the coordinator's node
    killed, the commit waits a session timeout and fails, the partitions are lost at about the same time,
    and whenever no report was made since the kill (one time in four at 60 s, more the longer the
    interval) the newest one is the up/steady of before the kill, well within 120 s: the next poll ends
    the outage while the node is still dead, and it begins again a session timeout after the next report
    (lines (2, 2), the campaign's double logging). Played with reports every 10 s and a 1 s session."""
    inbox = _inbox(sqlite_db)
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=[TOPIC],
                         settings={"session.timeout.ms": 1000, "statistics.interval.ms": 10_000})
    source._consumer.close()
    a, b = record(TOPIC, "a", 1), record(TOPIC, "a", 2)

    def consuming(c: _Librdkafka) -> bool:
        if c.polls == 1:
            c.assign()
            c.out = [_Message(a, 0)]
            c.report("up", "steady")  # the last report before the kill
        return {(TOPIC, 0): 1} in c.commits

    def killed(c: _Librdkafka) -> bool:  # no report: the next one is due 10 s after the last
        c.down = True
        if c.polls == 1:
            c.out = [_Message(b, 1)]
        return c.failed >= 2

    def lost(c: _Librdkafka) -> bool:  # the session ran out: nothing left to commit
        if c.polls == 1:
            c.lose()
            c.since = time.monotonic()
        return time.monotonic() - c.since > 1.0

    def next_report(c: _Librdkafka) -> bool:  # the node still dead
        c.report("wait-broker-transport", "init")
        if c.source.unavailable() is None:
            c.polls = 0
        return c.polls >= 5

    def back(c: _Librdkafka) -> bool:
        c.down = False
        if c.polls == 1:
            c.assign()
            c.out = [_Message(b, 1)]
        c.report("up", "steady")
        return any(commit.get((TOPIC, 0)) == 2 for commit in c.commits)

    librdkafka = _Librdkafka(source, [consuming, killed, lost, next_report, back])
    run_script(inbox, source, librdkafka, monkeypatch, caplog)
