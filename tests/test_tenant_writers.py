"""A fleet's writer threads are shared: a tenant's write never waits behind another's while one is free.

With a writer per worker, a quiet tenant's write of one row, handed to the
writer of a worker that had just served a backlog, waited behind the backlog's
writes of 1,000 rows (52 and 89 ms in two traced runs next to a 1,000,000-row backlog),
and the quiet tenant's next step waited for it (docs/tenants.md, *Pipelined*).
"""

from __future__ import annotations

import threading

from outbox.tenants._transport import Workers
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
