"""A fleet's writer threads and producers are shared: a tenant's write never waits behind another's
while a writer is free, and a publish held by the broker holds one worker, not every one behind it.

With a writer per worker, a quiet tenant's write of one row, handed to the
writer of a worker that had just served a backlog, waited behind the backlog's
writes of 1,000 rows (52 and 89 ms in two traced runs next to a 1,000,000-row backlog),
and the quiet tenant's next step waited for it (docs/tenants.md, *Pipelined*).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from _relay_helpers import wait_for

from outbox import ConfigurationError
from outbox.tenants import TenantRelay
from outbox.tenants._transport import LEND_WAIT, Workers
from transports import Record, SendResult
from transports.memory import InMemoryBroker, InMemoryTransport


def test_a_write_runs_on_a_free_writer_while_the_same_workers_earlier_write_is_stuck() -> None:
    broker = InMemoryBroker()
    workers = Workers([InMemoryTransport(broker), InMemoryTransport(broker)])
    release = threading.Event()
    try:
        workers.bind(0)  # the worker that served the backlog goes on to the quiet tenant
        backlog = workers.submit(lambda: release.wait(10))
        quiet = workers.submit(lambda: "marked")
        assert quiet.result(timeout=5) == "marked"
        assert not backlog.done()
    finally:
        release.set()
        workers.close()
    assert backlog.result(timeout=5) is True


def test_the_writers_are_as_many_as_the_workers() -> None:
    broker = InMemoryBroker()
    workers = Workers([InMemoryTransport(broker), InMemoryTransport(broker)])
    release = threading.Event()
    started = threading.Semaphore(0)

    def stuck() -> bool:
        started.release()
        return release.wait(10)

    try:
        workers.bind(1)
        first, second = workers.submit(stuck), workers.submit(stuck)
        third = workers.submit(lambda: "after")
        assert started.acquire(timeout=5) and started.acquire(timeout=5)
        assert not third.done()  # both writers are busy: the third write waits for one
        release.set()
        assert third.result(timeout=5) == "after"
    finally:
        release.set()
        workers.close()
    assert first.result(timeout=5) and second.result(timeout=5)


class Held(InMemoryTransport):
    """A transport that keeps a publish of key ``held`` waiting for ``release`` (a broker that holds a
    request); it counts the publishes under way at once."""

    def __init__(self, broker: InMemoryBroker, release: threading.Event) -> None:
        super().__init__(broker)
        self.release, self.busy, self.most = release, 0, 0
        self._count = threading.Lock()

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        with self._count:
            self.busy += 1
            self.most = max(self.most, self.busy)
        try:
            if any(r.key == b"held" for r in records):
                self.release.wait(10)
            return super().publish(records)
        finally:
            with self._count:
                self.busy -= 1


def publish_as(workers: Workers, index: int, key: bytes = b"k") -> list[str]:
    workers.bind(index)
    with workers.producer() as transport:
        return [r.outcome.value for r in transport.publish([Record("t", b"v", key)])]


def producers(broker: InMemoryBroker, release: threading.Event,
              kind: type[Held] | None = None) -> tuple[list[Held], Callable[[], Held]]:
    """A transport factory making ``kind`` (``Held``), and the list of what it made."""
    made: list[Held] = []

    def more() -> Held:
        made.append((kind or Held)(broker, release))
        return made[-1]
    return made, more


def test_eight_workers_publish_through_two_producers_one_publish_at_a_time_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No publish is held here, so none more is made: with ``LEND_WAIT`` at a minute, a host that
    stalls a worker for a second while it holds a producer cannot make a third either."""
    monkeypatch.setattr("outbox.tenants._transport.LEND_WAIT", 60.0)
    broker = InMemoryBroker()
    made, more = producers(broker, threading.Event())
    workers = Workers([more(), more()], workers=8, more=more)
    try:
        with ThreadPoolExecutor(8) as pool:
            for outcomes in pool.map(lambda i: publish_as(workers, i % 8), range(400)):
                assert outcomes == ["delivered"]
        assert len(made) == 2  # no publish was held: none more was made
        assert all(t.most <= 1 for t in made)  # never by two threads at once (LIFO: the second may go unused)
        assert len(broker.records("t")) == 400
    finally:
        workers.close()


def test_a_held_publish_holds_its_worker_alone_another_producer_is_made_for_the_others() -> None:
    broker, release = InMemoryBroker(), threading.Event()
    made, more = producers(broker, release)
    workers = Workers([more()], workers=3, more=more)
    try:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(publish_as, workers, 0, b"held")
            second = pool.submit(publish_as, workers, 1, b"held")  # waits LEND_WAIT, then has its own
            wait_for(lambda: len(made) == 2 and all(t.busy for t in made), 10, "the publishes held")
            started = time.monotonic()
            assert pool.submit(publish_as, workers, 2).result(timeout=5) == ["delivered"]
            waited = time.monotonic() - started
            assert LEND_WAIT * 0.9 <= waited < LEND_WAIT + 2, waited  # one more made after LEND_WAIT
            assert len(made) == 3 and not first.done() and not second.done()
            # One per worker at most: all three held, a fourth publish waits for one to come back.
            third = pool.submit(publish_as, workers, 2, b"held")
            wait_for(lambda: all(t.busy for t in made), 10, "the publishes held")
            fourth = pool.submit(publish_as, workers, 0)
            time.sleep(LEND_WAIT + 0.5)
            assert not fourth.done() and len(made) == 3
            release.set()
            assert [f.result(timeout=5) for f in (first, second, third, fourth)] == [["delivered"]] * 4
    finally:
        release.set()
        workers.close()


def held_then_another(pool: ThreadPoolExecutor, workers: Workers, held: Held) -> tuple[Future, Future]:
    """Worker 0's publish held on ``held`` (the only transport), then worker 1's publish asked for."""
    first = pool.submit(publish_as, workers, 0, b"held")
    wait_for(lambda: held.busy == 1, 10, "the first publish held")
    return first, pool.submit(publish_as, workers, 1)


def test_a_publish_off_the_workers_threads_is_refused() -> None:
    workers = Workers([InMemoryTransport(InMemoryBroker())])
    try:
        with pytest.raises(ConfigurationError, match="worker threads"), workers.producer():
            pass
    finally:
        workers.close()


def test_a_transport_factory_that_fails_late_leaves_the_worker_waiting_for_a_lent_one() -> None:
    """A factory failing when every producer is held (out of threads, a secret store down) is logged;
    the worker waits for a lent producer, as it would at one per worker: its tenant's publish does not
    fail with the factory's error, which names nothing of that tenant."""
    broker, release = InMemoryBroker(), threading.Event()
    held = Held(broker, release)
    asked = threading.Event()

    def more() -> Held:
        asked.set()
        raise RuntimeError("cannot make a producer now")
    workers = Workers([held], workers=2, more=more)
    try:
        with ThreadPoolExecutor(2) as pool:
            first, second = held_then_another(pool, workers, held)
            assert asked.wait(LEND_WAIT + 5)  # past the wait: the factory was called, and failed
            release.set()
            assert first.result(timeout=5) == second.result(timeout=5) == ["delivered"]
        assert held.most == 1
    finally:
        release.set()
        workers.close()


def test_close_does_not_wait_for_a_transport_being_made_and_closes_it_once_made() -> None:
    """A factory that is slow (a producer's settings read from a slow store) does not hold ``close``;
    what it makes after the close is closed at once, never lent."""
    broker, release, making, made_late = InMemoryBroker(), threading.Event(), threading.Event(), []
    go_on = threading.Event()
    held = Held(broker, release)

    def more() -> Held:
        making.set()
        go_on.wait(10)
        made_late.append(Held(broker, release))
        return made_late[-1]
    workers = Workers([held], workers=2, more=more)
    try:
        with ThreadPoolExecutor(3) as pool:
            first, second = held_then_another(pool, workers, held)
            assert making.wait(5)
            closing = pool.submit(workers.close)
            closing.result(timeout=2)  # not held by the factory
            go_on.set()
            wait_for(lambda: bool(made_late) and made_late[0].closed, 10, "the late transport closed")
            assert made_late[0].most == 0  # closed, not lent
            release.set()
            first.exception(timeout=5)  # on a closed fleet: whatever they get, they return
            second.exception(timeout=5)
            assert held.closed
    finally:
        go_on.set()
        release.set()
        workers.close()


def test_a_factory_that_returns_a_transport_already_made_is_refused_not_lent_twice(
        caplog: pytest.LogCaptureFixture) -> None:
    """``lambda: transport`` shares one producer between the workers: it would be used by two threads
    at once. Refused by name at the start when two are made, and never lent twice when the second
    comes from a late call."""
    broker = InMemoryBroker()
    same = InMemoryTransport(broker)
    with pytest.raises(ConfigurationError, match="same transport"):
        Workers([same, same], workers=2, more=lambda: same)
    release = threading.Event()
    held = Held(broker, release)
    workers = Workers([held], workers=2, more=lambda: held)
    try:
        with ThreadPoolExecutor(2) as pool:
            first, second = held_then_another(pool, workers, held)
            wait_for(lambda: "same transport" in caplog.text, LEND_WAIT + 5, "the late call refused")
            assert not second.done()  # waits for the one producer, not a second use of it
            release.set()
            assert first.result(timeout=5) == second.result(timeout=5) == ["delivered"]
        assert held.most == 1
        assert "same transport" in caplog.text
    finally:
        release.set()
        workers.close()


def test_close_leaves_a_held_publish_its_transport_and_closes_it_once_given_back() -> None:
    """``close`` after a stop that gave up on a held publish (``run``'s bound) closes the free
    transports at once, and a lent one when its publish gives it back: closed under that publish, it
    was used by two threads at once (a Kafka producer flushed by one while another polls it, its
    delivery reports served on the closing thread). A publish after the close is refused by name."""
    broker, release = InMemoryBroker(), threading.Event()
    held, spare = Held(broker, release), Held(broker, release)
    workers = Workers([held, spare], workers=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(publish_as, workers, 0, b"held")
            wait_for(lambda: held.busy == 1, 10, "the publishes held")
            workers.close()
            assert spare.closed and not held.closed
            release.set()
            assert first.result(timeout=5) == ["delivered"]
            assert held.closed
            with pytest.raises(RuntimeError, match=r"closed \(TenantRelay.close"):
                pool.submit(publish_as, workers, 1).result(timeout=5)
    finally:
        release.set()
        workers.close()


class Sized(Held):
    """A transport that says how many records it has queued (none): ``len()`` 0, so false."""

    def __len__(self) -> int:
        return 0


def test_a_transport_made_late_is_lent_even_when_it_is_false() -> None:
    """One more made for a worker that waited is lent to it whatever its truth value: taken as none
    made (``another() or wait``), it was kept, never lent, and the worker waited behind the held
    publish it was made to spare it."""
    broker, release = InMemoryBroker(), threading.Event()
    held = Held(broker, release)
    made, more = producers(broker, release, Sized)
    workers = Workers([held], workers=2, more=more)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(publish_as, workers, 0, b"held")
            wait_for(lambda: held.busy == 1, 10, "the publishes held")
            assert pool.submit(publish_as, workers, 1).result(timeout=LEND_WAIT + 3) == ["delivered"]
            assert not first.done() and len(made) == 1
            release.set()
            assert first.result(timeout=5) == ["delivered"]
    finally:
        release.set()
        workers.close()


class Closing(InMemoryTransport):
    """A transport that says whether it was closed."""

    closed = False

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True


def test_transports_made_for_a_fleet_that_is_refused_are_closed() -> None:
    """A factory that fails on its second call, or a second transport that is no transport, refuses
    the fleet: the producer already made is closed, not left with its connections and threads."""
    broker = InMemoryBroker()
    made: list[Closing] = []

    def second_fails() -> Closing:
        if made:
            raise RuntimeError("no second producer")
        made.append(Closing(broker))
        return made[-1]

    with pytest.raises(RuntimeError, match="no second producer"):
        TenantRelay(["a"], second_fails, producers=2, workers=2)
    assert [t.closed for t in made] == [True]
    first = Closing(broker)
    no_transport: Any = object()  # what a factory returning the wrong thing gives
    with pytest.raises(ConfigurationError, match="no publish"):
        Workers([first, no_transport], workers=2)
    assert first.closed
