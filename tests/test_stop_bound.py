"""Workers stop on time (DESIGN §10): ``Inbox.run``, ``Relay.run`` and ``Inbox.handle(cancel=…)``.

Each test puts the worker in a call that does not come back, as librdkafka's
synchronous offset commit or close does when the broker is gone, and a
producer's flush when nothing answers, then sends SIGTERM (or cancels) and
asserts the worker returned within its stop bound. The calls "hang" for
``HANG`` seconds rather than forever, so that a worker that waits for them
fails the test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, publish, rows, wait_for

from outbox import ConfigurationError, Inbox, Outbox, Relay, create_engine
from outbox.core._stopping import StopLatch
from outbox.faststream._threads import in_daemon_thread
from outbox.inbox import StopRequested
from outbox.relay._writer import BackgroundWriter
from tests.inbox_support import DatabaseOutage, apply_effect, business, record
from transports import Outcome, Record, SendResult
from transports.kafka import KafkaTransport
from transports.testing import BrokerProcess

pytestmark = pytest.mark.xdist_group("timing")  # wall-clock bounds: one at a time (docs/testing.md)

HANG = 30.0
"""How long a "blocking" broker call lasts here: far past any stop bound."""
STOP_TIMEOUT = 1.0
MARGIN = 1.5
"""Seconds on top of the bound for the thread switch and a slow, shared machine."""


class Hang:
    """A call into a dead broker: returns only after ``HANG`` seconds, whatever signal comes.

    Or once the test is over (``no_thread_outlives_its_test`` releases it), so that a
    worker loop a test left behind in it ends within that test.
    """

    made: ClassVar[list[Hang]] = []

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        Hang.made.append(self)

    def __call__(self) -> None:
        self.entered.set()
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline and not self.released.is_set():
            time.sleep(0.05)  # like C code: a signal handler may run, nothing returns


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test() -> Iterator[None]:
    """Every thread a test started ends before the next test starts.

    These tests leave worker loops behind on purpose, inside a ``Hang`` that
    lasts ``HANG`` seconds: a relay loop then came back from its hanging publish
    and logged "batch failed" on ``outbox.relay`` half a minute later, into
    whatever test this xdist worker ran by then (a tenant fleet test, whose
    assertion of no relay error failed on it under load). So the hangs are
    released at the end of the test and its threads waited for here.
    """
    before = set(threading.enumerate())
    Hang.made.clear()
    yield
    for hang in Hang.made:
        hang.released.set()
    deadline = time.monotonic() + HANG
    left = [t for t in threading.enumerate() if t not in before]
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert [t.name for t in left if t.is_alive()] == [], "threads the test left running"


class DeadBrokerSource:
    """Delivers ``records`` once; then every commit and the close hang as librdkafka's do."""

    def __init__(self, records: list[Record]) -> None:
        self.pending = records
        self.hang = Hang()

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        out, self.pending = self.pending[:max_records], self.pending[max_records:]
        if not out:
            time.sleep(min(timeout, 0.01))
        return out

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        self.hang()

    def on_revoke(self, callback: object) -> None:
        pass

    def close(self) -> None:
        self.hang()


@pytest.fixture
def sigterm_once_entered() -> Iterator[list[Hang]]:
    """Sends this process SIGTERM as soon as the ``Hang`` put in the list was entered."""
    hangs: list[Hang] = []
    sent = threading.Event()

    def send() -> None:
        while not hangs or not hangs[0].entered.wait(0.05):
            if sent.is_set():
                return
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    yield hangs
    sent.set()


def stopped_within(run: Callable[[], None], bound: float) -> float:
    started = time.monotonic()
    run()
    took = time.monotonic() - started
    assert took < bound, f"returned {took:.1f}s after it started, bound {bound}s"
    return took


def test_inbox_run_returns_on_sigterm_while_the_offset_commit_hangs(
    sqlite_db: str, sigterm_once_entered: list[Hang]
) -> None:
    """On the main thread, as ``outbox inbox run`` calls it: SIGTERM must be seen during the commit."""
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="stop", concurrency=2)
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler("orders")(apply_effect)
    records = [record("orders", f"k{i}", 1) for i in range(5)]
    for n, r in enumerate(records):
        r.partition, r.offset = 0, n
    source = DeadBrokerSource(records)
    sigterm_once_entered.append(source.hang)
    previous = signal.getsignal(signal.SIGTERM)
    # The commit hangs from the first try on; the stop must not wait for it, nor for the close.
    stopped_within(lambda: inbox.run(source, stop_timeout=STOP_TIMEOUT), HANG / 2)
    assert source.hang.entered.is_set()
    assert signal.getsignal(signal.SIGTERM) is previous, "the handler was not put back"
    engine.dispose()


def test_inbox_run_returns_within_its_bound_after_stop(sqlite_db: str) -> None:
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="stop", concurrency=2)
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler("orders")(apply_effect)
    r = record("orders", "k", 1)
    r.partition, r.offset = 0, 0
    source = DeadBrokerSource([r])
    def stop_once_committing() -> None:
        source.hang.entered.wait(HANG)
        inbox.stop()

    threading.Thread(target=stop_once_committing, daemon=True).start()
    took = stopped_within(lambda: inbox.run(source, install_signal_handlers=False,
                                            stop_timeout=STOP_TIMEOUT), STOP_TIMEOUT + MARGIN)
    assert took >= STOP_TIMEOUT * 0.9, "it gave the loop less than its bound to wind down"
    engine.dispose()


class DeadBrokerTransport:
    """A producer whose flush waits for a broker that never answers."""

    def __init__(self) -> None:
        self.hang = Hang()

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        self.hang()
        raise AssertionError("unreachable within the test")

    def close(self, timeout: float = 10.0) -> None:
        pass


def test_relay_run_returns_on_sigterm_while_a_publish_hangs(
    sqlite_db: str, sigterm_once_entered: list[Hang]
) -> None:
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    publish(outbox, "orders", ["k1", "k2"])
    transport = DeadBrokerTransport()
    sigterm_once_entered.append(transport.hang)
    relay = Relay(outbox, transport, poll_interval=0.05)
    stopped_within(lambda: relay.run(stop_timeout=STOP_TIMEOUT), HANG / 2)
    assert transport.hang.entered.is_set()
    engine.dispose()


def test_an_error_of_the_loop_is_raised_by_run(sqlite_db: str) -> None:
    """The loop's own thread hands its exception to the caller, as the loop on the caller's did."""
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="stop")
    inbox.create_tables()
    inbox.handler("orders")(apply_effect)

    class Broken(DeadBrokerSource):
        def poll(self, max_records: int, timeout: float) -> list[Record]:
            raise TypeError("a bug in the source")

        def close(self) -> None:
            pass

    with pytest.raises(TypeError, match="a bug"):
        inbox.run(Broken([]), install_signal_handlers=False)
    wrongs: list[Any] = [0, -1.0, True, "10"]
    for wrong in wrongs:
        with pytest.raises(ConfigurationError, match="stop_timeout must be positive seconds"):
            inbox.run(Broken([]), install_signal_handlers=False, stop_timeout=wrong)
    engine.dispose()


def test_handle_gives_up_waiting_out_an_outage_when_cancelled(sqlite_db: str) -> None:
    """The FastStream subscriber's worker thread: ``Inbox.handle`` in a database outage ends on cancel."""
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="stop")
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler("orders")(apply_effect)
    outage = DatabaseOutage(engine)
    outage.fail()
    cancel = threading.Event()
    failures: list[BaseException] = []

    def handle() -> None:
        try:
            inbox.handle(record("orders", "k", 1), cancel=cancel)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=handle, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while outage.failures < 3:
        assert time.monotonic() < deadline, "the outage was never met"
        time.sleep(0.01)
    cancel.set()
    thread.join(STOP_TIMEOUT + MARGIN)
    assert not thread.is_alive(), "handle() went on waiting out the outage after cancel"
    assert len(failures) == 1 and isinstance(failures[0], StopRequested), failures
    outage.end()
    engine.dispose()


def test_the_subscribers_thread_never_holds_the_process_at_exit() -> None:
    """``in_daemon_thread`` is awaited like ``to_thread``, but ``asyncio.run`` does not join it."""
    release = threading.Event()

    async def main() -> str:
        assert await in_daemon_thread(lambda: "value") == "value"
        with pytest.raises(KeyError):
            empty: dict[str, int] = {}
            await in_daemon_thread(lambda: empty["missing"])
        task = asyncio.ensure_future(in_daemon_thread(lambda: release.wait(HANG)))
        await asyncio.sleep(0.05)
        task.cancel()
        return "done"

    started = time.monotonic()
    assert asyncio.run(main()) == "done"  # to_thread: asyncio.run would wait for the thread
    assert time.monotonic() - started < MARGIN
    release.set()


def test_the_relays_writer_thread_never_holds_the_process_at_exit() -> None:
    """A batch write stuck in a frozen database's commit must not keep a stopped relay alive.

    ``ThreadPoolExecutor``'s threads are joined at interpreter exit: the relay
    returned at its stop bound and the process then hung in that join.
    """
    writer = BackgroundWriter("test-writer")
    done = [writer.submit(lambda n=n: n) for n in range(3)]
    failing = writer.submit(lambda: {}["missing"])
    assert [f.result(MARGIN) for f in done] == [0, 1, 2]
    with pytest.raises(KeyError):
        failing.result(MARGIN)
    writer.shutdown()

    # Timed from the script's last line to the process's end: the interpreter's start and the
    # package's import took 11.9 s on a loaded CI host, where a bound on the whole run failed.
    script = ("import threading, time; from outbox.relay._writer import BackgroundWriter; "
              f"BackgroundWriter('stuck').submit(lambda: threading.Event().wait({HANG})); "
              "print(time.monotonic())")
    ran = subprocess.run([sys.executable, "-c", script], check=True, timeout=2 * HANG,
                         capture_output=True, text=True)
    assert time.monotonic() - float(ran.stdout) < HANG / 3  # its exit, not the stuck write


def _in_thread(run: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class IdleSource(DeadBrokerSource):
    """Nothing to deliver, and a close that returns."""

    def close(self) -> None:
        pass


def test_a_stop_asked_before_run_is_kept_and_the_worker_runs_again_after(sqlite_db: str) -> None:
    """An application starts ``run`` on a thread and shuts down at once: its ``stop()`` may come
    before the thread reached ``run``. ``run`` cleared it and ran on forever (the join hung)."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    inbox = Inbox(engine, group="stop")
    inbox.handler("orders")(apply_effect)
    transport = ScriptedTransport()
    relay = Relay(outbox, transport, poll_interval=0.05)
    workers: list[tuple[Callable[[], None], Callable[[], None]]] = [
        (relay.stop, lambda: relay.run(stop_timeout=STOP_TIMEOUT)),
        (inbox.stop, lambda: inbox.run(IdleSource([]), stop_timeout=STOP_TIMEOUT)),
    ]
    try:
        for stop, run in workers:
            stop()
            thread = _in_thread(run)
            thread.join(STOP_TIMEOUT + MARGIN)
            assert not thread.is_alive(), f"{run} lost the stop asked before it ran"
        # Once returned, it runs again until the next stop.
        thread = _in_thread(lambda: relay.run(stop_timeout=STOP_TIMEOUT))
        publish(outbox, "orders", ["k1"])
        wait_for(lambda: transport.sent, 10, "the relay's second run to publish")
        relay.stop()
        thread.join(STOP_TIMEOUT + MARGIN)
        assert not thread.is_alive()
    finally:
        relay.stop()
        inbox.stop()
    engine.dispose()


class AnsweringLateTransport:
    """A producer whose flush answers only once the test lets it (``hang.released``), delivered."""

    def __init__(self) -> None:
        self.hang = Hang()

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        self.hang()
        return [SendResult(Outcome.DELIVERED, 0, offset) for offset, _ in enumerate(records)]

    def close(self, timeout: float = 10.0) -> None:
        pass


def left_behind(outbox: Outbox, transport: DeadBrokerTransport | AnsweringLateTransport) -> Relay:
    """A relay whose ``run`` returned at its stop without its loop, left in ``transport``'s send of k1."""
    outbox.create_tables()
    publish(outbox, "orders", ["k1"])
    relay = Relay(outbox, transport, poll_interval=0.05)
    thread = _in_thread(lambda: relay.run(stop_timeout=STOP_TIMEOUT))
    assert transport.hang.entered.wait(10)
    relay.stop()
    thread.join(STOP_TIMEOUT + MARGIN)
    assert not thread.is_alive()
    return relay


def test_run_is_refused_while_a_loop_left_behind_at_its_stop_still_runs(sqlite_db: str) -> None:
    """A second ``run`` would clear the stop the first loop (stuck in a broker call) waits to see:
    two loops on one relay, the old one resuming once its call returns."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    relay = left_behind(outbox, DeadBrokerTransport())
    refused: list[ConfigurationError] = []

    def again() -> None:
        try:
            relay.run(stop_timeout=STOP_TIMEOUT)
        except ConfigurationError as exc:
            refused.append(exc)

    second = _in_thread(again)
    second.join(STOP_TIMEOUT + MARGIN)
    try:
        assert refused and "still running" in str(refused[0]), "a second loop was started"
        assert relay._stopping.is_set(), "the stop the first loop waits to see was cleared"
    finally:
        relay.stop()
    engine.dispose()


def test_close_leaves_the_leases_to_a_loop_left_behind_until_its_call_returns(sqlite_db: str) -> None:
    """``close()`` after a ``run`` that returned without its loop (still in its send) gave the leases
    back under that loop's batch: when the send came back its marks were fenced, and the row it had
    delivered stayed pending, to be sent again (an exactly-once producer was closed mid-transaction).
    The loop gives them back itself, after it marked its batch."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    transport = AnsweringLateTransport()
    relay = left_behind(outbox, transport)
    leases = outbox.tables.leases

    def owners() -> set[str | None]:
        with engine.connect() as conn:
            return set(conn.scalars(sa.select(leases.c.owner)))

    relay.close()
    assert owners() == {relay.worker_id}, "close() gave the leases back under the loop's batch"
    transport.hang.released.set()
    wait_for(lambda: owners() == {None}, 10, "the loop to give its leases back once its send returned")
    assert [row.published_at is not None for row in rows(outbox)] == [True]
    engine.dispose()


def test_a_stop_before_the_worker_exists_is_handed_to_it() -> None:
    """``outbox relay`` / ``outbox inbox run`` catch SIGTERM from their first line (``StopLatch``):
    one that came while they connected or imported the app stops the worker's ``run()`` at once."""
    early, late = StopLatch(), StopLatch()
    stopped: list[str] = []
    early()  # the signal, before the worker exists
    assert early.asked.is_set() and stopped == []
    early.hand_to(lambda: stopped.append("early"))
    late.hand_to(lambda: stopped.append("late"))
    assert stopped == ["early"]
    late()
    assert stopped == ["early", "late"] and late.asked.is_set()


def test_an_exactly_once_relay_stopped_while_its_progress_topic_waits_for_the_broker_ends_its_loop(
        sqlite_db: str, caplog: pytest.LogCaptureFixture) -> None:
    """The progress topic is looked up (and made) before the first send, a wait as long as the
    transaction timeout (30 s by default, three times the stop bound) when the broker does not answer.
    A stop there left the loop behind in the wait, holding the transport and an admin client (CI,
    639d058: librdkafka's mock cluster never answered the creation). The stop now ends the wait:
    ``run`` returns with its loop ended, no warning."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    with BrokerProcess(brokers=1) as broker:
        broker.freeze()
        # 8 s a transaction: the thread asking the broker ends within the test (its fixture waits).
        transport = KafkaTransport(bootstrap_servers=broker.bootstrap, delivery_timeout=8)
        relay = Relay(outbox, transport, worker_id="stopped-early", exactly_once=True)
        runner = _in_thread(lambda: relay.run(stop_timeout=HANG / 3))
        wait_for(lambda: any(t.name == "outbox-metadata" for t in threading.enumerate()), 30,
                 "the relay to ask the frozen broker for its progress topic")
        asked = time.monotonic()
        relay.stop()
        runner.join(HANG / 3 + MARGIN)
        took = time.monotonic() - asked
        transport.close(0)
    assert not runner.is_alive()
    assert took < 1 + MARGIN, f"run returned {took:.1f}s after the stop"
    assert "did not finish" not in caplog.text, "the loop was left behind in its wait for the broker"
    engine.dispose()
