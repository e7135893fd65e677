"""``Inbox.run``'s bookkeeping under a revoke, driven by a scripted ``Source``.

The Kafka tests show the loop against a real broker; this one needs exact
control over *when* a partition is revoked (while a message of it waits for its
next attempt), which a broker's rebalance timing cannot give.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import sqlalchemy as sa
from prometheus_client import REGISTRY

from outbox import Inbox
from tests.inbox_support import AlertLog, applied, apply_effect, business, record
from transports import Record, Source

TOPIC = "orders"


class ScriptedSource:
    """Hands out the given records once, records commits, revokes when told to."""

    def __init__(self, records: list[Record]) -> None:
        self.pending = records
        self.commits: list[dict[tuple[str, int], int]] = []
        self.callbacks: list = []  # type: ignore[type-arg]
        self.revoke: list[tuple[str, int]] | None = None
        self.closed = False

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        if self.revoke is not None:  # like librdkafka: the callback runs inside poll
            gone, self.revoke = self.revoke, None
            for callback in self.callbacks:
                callback(gone)
        # Taken off the list in place, not by assigning its rest: a test thread may extend it
        # meanwhile (test_inbox_holes' outage test), and a rest sliced before that extend dropped
        # whatever the extend added. The list is held here so that a test reassigning
        # ``pending`` loses nothing either.
        pending = self.pending
        out = pending[:max_records]
        del pending[:len(out)]
        if not out:
            time.sleep(min(timeout, 0.01))
        return out

    def commit(self, offsets) -> None:  # type: ignore[no-untyped-def]
        self.commits.append(dict(offsets))

    def on_revoke(self, callback) -> None:  # type: ignore[no-untyped-def]
        self.callbacks.append(callback)

    def close(self) -> None:
        self.closed = True


def at(r: Record, partition: int, offset: int) -> Record:
    r.partition, r.offset = partition, offset
    return r


def test_scripted_source_keeps_records_added_while_it_polls() -> None:
    """Records a test adds to ``pending`` while the consumer thread is inside ``poll`` are polled later.

    ``poll`` used to assign the list's rest (``self.pending = self.pending[n:]``): a
    ``pending.extend`` from the test thread between that slice and the assignment went into the
    list being replaced, and its records were never polled. test_inbox_holes' outage test lost
    the records it sent during the outage that way (a stall after the outage, under load). The
    list here adds a record each time it is sliced, as the test thread's extend would.
    """
    added: list[Record] = []

    class ExtendedMeanwhile(list[Record]):
        def __getitem__(self, index: Any) -> Any:
            got = list.__getitem__(self, index)
            if isinstance(index, slice) and len(added) < 2:
                added.append(at(record(TOPIC, f"late{len(added)}", 1), 0, 1 + len(added)))
                self.append(added[-1])
            return got

    first = at(record(TOPIC, "a", 1), 0, 0)
    source = ScriptedSource(ExtendedMeanwhile([first]))
    polled = source.poll(1, 0)
    while batch := source.poll(10, 0):
        polled += batch
    assert len(added) == 2 and polled == [first, *added]


def test_revoke_abandons_a_waiting_retry_and_still_commits_its_batch_mates(sqlite_db: str) -> None:
    from outbox import create_engine

    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="runner", concurrency=1, batch_size=10, retry_backoff=0.4,
                  alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    attempts: list[int] = []

    @inbox.handler(TOPIC)
    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.key == "poison":
            attempts.append(1)
            raise RuntimeError("waits for its next attempt")
        apply_effect(session, message)

    source = ScriptedSource([at(record(TOPIC, "poison", 1), 0, 0),
                             at(record(TOPIC, "a", 1), 1, 0), at(record(TOPIC, "b", 1), 1, 1)])
    assert isinstance(source, Source)
    thread = threading.Thread(target=inbox.run, args=(source,),
                              kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while len(applied(engine)) < 2 or not attempts:
            assert time.monotonic() < deadline, "the batch never ran"
            time.sleep(0.01)
        source.revoke = [(TOPIC, 0)]  # while "poison" sleeps before attempt 2
        while not any(c.get((TOPIC, 1)) == 2 for c in source.commits):
            assert time.monotonic() < deadline, f"partition 1 never committed: {source.commits}"
            time.sleep(0.01)
    finally:
        inbox.stop()
        thread.join(10)
    assert not thread.is_alive() and source.closed
    assert len(attempts) < 3  # abandoned, not parked: the next owner retries it
    assert inbox.parked() == []
    assert all(c.get((TOPIC, 0), 0) == 0 for c in source.commits)  # poison's offset stays open
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(inbox.tables.inbox_messages)) == 2
    lag = REGISTRY.get_sample_value("outbox_inbox_commit_lag",
                                    {"group": "runner", "topic": TOPIC, "partition": "1"})
    assert lag == 0  # both records of partition 1 committed


def test_a_sweep_that_hangs_holds_up_no_poll(sqlite_db: str) -> None:
    """The gap sweep queries the database every second; on the polling thread, a slow or frozen
    database held up every key's records (and, frozen, the poll itself). It has a thread of its own."""
    from outbox import create_engine
    from outbox.inbox.storage import storage_for

    sweeping, release = threading.Event(), threading.Event()

    class HangingHeld:
        """The held store, whose sweep query (``ready``) hangs until released."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def ready(self, session: Any, limit: int) -> Any:
            sweeping.set()
            release.wait(30)
            return self.inner.ready(session, limit)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def hanging_sweep(tables: Any, group: str) -> Any:
        own = storage_for("sqlite")(tables, group)
        return dataclasses.replace(own, held=HangingHeld(own.held))

    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="sweep", alert=AlertLog(), storage=hanging_sweep)
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler(TOPIC)(apply_effect)
    records = [at(record(TOPIC, "a", seq), 0, seq - 1) for seq in (1, 2, 3)]

    class AfterTheSweepStarted(ScriptedSource):
        def poll(self, max_records: int, timeout: float) -> list[Record]:
            if not sweeping.is_set():
                time.sleep(0.01)
                return []
            return super().poll(max_records, timeout)

    source = AfterTheSweepStarted(records)
    thread = threading.Thread(target=inbox.run, args=(source,),
                              kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not any(c.get((TOPIC, 0)) == 3 for c in source.commits):
            assert time.monotonic() < deadline, f"not applied and committed while the sweep hung: " \
                                                f"{applied(engine)}, {source.commits}"
            time.sleep(0.01)
        assert applied(engine) == [("a", 1), ("a", 2), ("a", 3)]
    finally:
        release.set()
        inbox.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_a_slow_backlog_commits_in_budgets_and_applies_every_message_in_order(sqlite_db: str) -> None:
    """``batch_budget`` through the whole loop: a key's backlog of a slow handler is applied in
    several transactions (what did not fit goes back to its lane at once), each message once and
    in seq order, and the partition's offsets are committed to its end."""
    from outbox import create_engine

    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group="runner", concurrency=1, batch_budget=0.05, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    commits: list[int] = []
    sa.event.listen(engine, "commit", lambda conn: commits.append(1))

    @inbox.handler(TOPIC)
    def handler(session, message):  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        apply_effect(session, message)

    source = ScriptedSource([at(record(TOPIC, "a", seq), 0, seq - 1) for seq in range(1, 31)])
    thread = threading.Thread(target=inbox.run, args=(source,), kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not any(c.get((TOPIC, 0)) == 30 for c in source.commits):
            assert time.monotonic() < deadline, f"never committed to the end: {source.commits}"
            time.sleep(0.01)
    finally:
        inbox.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 31)]
    assert inbox.parked() == []
    assert len(commits) >= 3  # one batch of 30 without the budget: ~0.3 s in one transaction
