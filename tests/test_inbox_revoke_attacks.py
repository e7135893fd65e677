"""The revoke's promise under the cases ``test_inbox_revoke.py`` does not list, attacked.

docs/consumer.md, "Rebalance and shutdown": once the revoke returned, this consumer never calls the
handler for a record of a revoked partition (until the partition is assigned to it again: then its
records are handled again from the committed offset, none lost); its running transactions ended; what
they applied is committed; the kept partitions' records are applied all the same, in order.
``Inbox.run`` on the in-memory broker (``transports.memory``), SQLite.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Inbox, Message, RetryLater, create_engine
from tests.inbox_support import AlertLog, applied, apply_effect, business, record
from tests.test_inbox_holes import running, wait_for
from transports import Record
from transports.memory import InMemoryBroker, InMemorySource

TOPIC = "orders"
GROUP = "revoke-attacks"


class Tracked(InMemorySource):
    """Knows which of its partitions are *away*: revoked (the inbox's callback returned) and not
    assigned again. Revokes made by ``close`` are not counted."""

    def __init__(self, broker: InMemoryBroker) -> None:
        super().__init__(broker, group_id=GROUP, topics=[TOPIC])
        self.away: set[int] = set()
        self.revokes: list[list[int]] = []
        self.closing = False
        self.began = threading.Event()
        self.polled: list[tuple[int | None, int | None]] = []

    def on_revoke(self, callback: Any) -> None:
        def tracked(gone: Sequence[tuple[str, int]]) -> None:
            if not self.closing:
                self.began.set()
            callback(gone)
            if not self.closing:
                self.away |= {p for _, p in gone}
                self.revokes.append(sorted(p for _, p in gone))

        super().on_revoke(tracked)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        records = super().poll(max_records, timeout)
        self.polled.extend((r.partition, r.offset) for r in records)
        self.away -= {p for _, p in self.assigned()}  # assigned again: its records are this one's
        return records

    def close(self) -> None:
        self.closing = True
        super().close()


def on(partition: int, key: str, seq: int) -> Record:
    r = record(TOPIC, key, seq)
    r.partition = partition
    return r


class Calls:
    """The handler's calls, by key, and those for a record of a partition away at the time."""

    def __init__(self, source: Tracked, partition_of: dict[str, int]) -> None:
        self.source, self.partition_of = source, partition_of
        self.lock = threading.Lock()
        self.by_key: dict[str, int] = {}
        self.while_away: list[str] = []

    def called(self, key: str) -> int:
        with self.lock:
            self.by_key[key] = self.by_key.get(key, 0) + 1
            if self.partition_of[key] in self.source.away:
                self.while_away.append(key)
            return self.by_key[key]


def make(sqlite_db: str, **options: Any) -> tuple[Any, Inbox]:
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group=GROUP, max_attempts=100, retry_backoff=0.05, retry_backoff_max=0.05,
                  alert=AlertLog(), **options)
    inbox.create_tables()
    business.create_all(engine)
    return engine, inbox


def test_a_lost_record_waiting_for_its_retry_lets_the_kept_record_of_its_key_run_at_once(
        sqlite_db: str) -> None:
    """A key whose records sit on both partitions: the lost partition's record waits for a long
    ``RetryLater`` with the kept partition's record (unordered: no seq) queued behind it in the key's
    lane. The revoke drops the waiting head; the kept record runs at once: it waited for the head
    only, which is the next owner's now."""
    engine, inbox = make(sqlite_db, concurrency=1, batch_size=1)
    broker = InMemoryBroker(partitions=2)
    source = Tracked(broker)
    calls = Calls(source, {"moved": 1})
    kept_done: list[float] = []

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        if message.seq == 1:  # partition 1's, lost
            calls.called("moved")
            raise RetryLater(30.0, "the next owner's")
        apply_effect(session, message)
        kept_done.append(time.monotonic())

    broker.append(on(1, "moved", 1))
    joined: list[InMemorySource] = []
    try:
        with running(inbox, source) as errors:
            wait_for(lambda: calls.by_key.get("moved") == 1, "the lost record waiting", errors=errors)
            kept = record(TOPIC, "moved", None)
            kept.partition = 0
            broker.append(kept)
            wait_for(lambda: (0, 0) in source.polled, "the kept record behind it", errors=errors)
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))  # takes partition 1
            wait_for(lambda: source.revokes == [[1]], "the revoke", errors=errors)
            revoked = time.monotonic()
            wait_for(lambda: bool(kept_done), "the kept record", timeout=5, errors=errors)
    finally:
        for member in joined:
            member.close()
    assert kept_done[0] - revoked < 1.0, f"the kept record waited {kept_done[0] - revoked:.1f}s"
    assert calls.while_away == [] and calls.by_key == {"moved": 1}
    assert applied(engine) == [("moved", None)]


def test_two_revokes_back_to_back_and_a_partition_assigned_again_right_after_its_revoke(
        sqlite_db: str) -> None:
    """Of four partitions, a second member takes 1 and 3; a third joins right after that revoke
    returned: this consumer loses 2 and gets 3 back. Each lost partition's record waits for a long
    ``RetryLater`` when its revoke begins. Once each revoke returned, no record of what it took is
    handled; partition 3's record, back, is read again from the committed offset and applied (not
    lost with the dropped retry); the kept partition's records are applied in order throughout."""
    engine, inbox = make(sqlite_db, concurrency=2, batch_size=2)
    broker = InMemoryBroker(partitions=4)
    source = Tracked(broker)
    calls = Calls(source, {"one": 1, "two": 2, "back": 3, "kept": 0})

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        key = message.key or ""
        if calls.called(key) == 1 and key != "kept":
            raise RetryLater(30.0, "waits when the revoke begins")
        apply_effect(session, message)

    for partition, key in [(1, "one"), (2, "two"), (3, "back")]:
        broker.append(on(partition, key, 1))
    broker.append(on(0, "kept", 1))
    joined: list[InMemorySource] = []
    try:
        with running(inbox, source) as errors:
            wait_for(lambda: all(calls.by_key.get(k) == 1 for k in ("one", "two", "back")),
                     "the three records waiting", errors=errors)
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))
            wait_for(lambda: source.revokes == [[1, 3]], "the first revoke", errors=errors)
            broker.append(on(0, "kept", 2))
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))
            wait_for(lambda: source.revokes == [[1, 3], [2]], "the second revoke", errors=errors)
            broker.append(on(0, "kept", 3))
            wait_for(lambda: applied(engine, "back") == [("back", 1)]
                     and broker.committed(GROUP, TOPIC, 3) == 1, "partition 3's record, back", errors=errors)
            wait_for(lambda: applied(engine, "kept") == [("kept", 1), ("kept", 2), ("kept", 3)]
                     and broker.committed(GROUP, TOPIC, 0) == 3, "the kept records", errors=errors)
    finally:
        for member in joined:
            member.close()
    assert calls.while_away == [], f"handled while their partition was away: {calls.while_away}"
    # "kept" may be called more than once a record: redone in a SAVEPOINT when a record of its batch failed.
    assert {k: n for k, n in calls.by_key.items() if k != "kept"} == {"one": 1, "two": 1, "back": 2}
    assert inbox.parked() == []


def test_a_revoke_during_the_stop_waits_for_its_running_transaction_and_commits_it(
        sqlite_db: str) -> None:
    """The revoke begins while a transaction of the lost partition runs, and ``stop()`` comes while it
    waits for that transaction. The transaction ends and is committed by the revoke; the record queued
    behind it is never handled; ``run`` returns."""
    engine, inbox = make(sqlite_db, concurrency=1, batch_size=1)
    broker = InMemoryBroker(partitions=2)
    source = Tracked(broker)
    calls = Calls(source, {"busy": 1})
    stopped = threading.Event()

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        calls.called(message.key or "")
        if message.seq == 1:
            assert source.began.wait(10), "the revoke never began"
            assert stopped.wait(10), "the stop never came"
        apply_effect(session, message)

    broker.append(on(1, "busy", 1))
    broker.append(on(1, "busy", 2))  # queued behind it when the revoke begins
    joined: list[InMemorySource] = []
    try:
        with running(inbox, source) as errors:
            wait_for(lambda: calls.by_key.get("busy") == 1, "the running transaction", errors=errors)
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))  # takes partition 1
            wait_for(source.began.is_set, "the revoke", errors=errors)
            inbox.stop()
            stopped.set()
            wait_for(lambda: source.revokes == [[1]], "the revoke's return", errors=errors)
    finally:
        for member in joined:
            member.close()
    assert calls.while_away == [] and calls.by_key == {"busy": 1}
    assert applied(engine) == [("busy", 1)]
    assert broker.committed(GROUP, TOPIC, 1) == 1, "the revoke returned with its applied offset uncommitted"


def test_a_revoke_while_the_lost_partitions_transaction_meets_an_outage_leaves_it_to_the_next_owner(
        sqlite_db: str) -> None:
    """The database file is locked (another connection's ``BEGIN EXCLUSIVE``): the transactions of a
    lost and of a kept partition's record fail with "database is locked" and wait with the outage
    backoff when the revoke begins. Once the file is free, the kept record is applied and the lost one
    is never handled: its retry went with the revoke; its offset stays uncommitted (the next owner's)."""
    engine = sa.create_engine(sqlite_db, connect_args={"timeout": 0.1})
    inbox = Inbox(engine, group=GROUP, concurrency=1, batch_size=1, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    broker = InMemoryBroker(partitions=2)
    source = Tracked(broker)
    calls = Calls(source, {"lost": 1, "kept": 0})
    failed: list[float] = []
    sa.event.listen(engine, "handle_error", lambda context: failed.append(time.monotonic()))

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        calls.called(message.key or "")
        apply_effect(session, message)

    locker = sqlite3.connect(str(engine.url.database), isolation_level=None)
    joined: list[InMemorySource] = []
    try:
        with running(inbox, source) as errors:
            broker.append(on(0, "kept", 1))
            wait_for(lambda: broker.committed(GROUP, TOPIC, 0) == 1, "the consumer started", errors=errors)
            locker.execute("BEGIN EXCLUSIVE")
            broker.append(on(1, "lost", 1))
            broker.append(on(0, "kept", 2))
            wait_for(lambda: {(0, 1), (1, 0)} <= set(source.polled) and len(failed) >= 3,
                     "both transactions meeting the outage", errors=errors)
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))  # takes partition 1
            wait_for(lambda: source.revokes == [[1]], "the revoke", errors=errors)
            locker.execute("ROLLBACK")
            wait_for(lambda: applied(engine, "kept") == [("kept", 1), ("kept", 2)]
                     and broker.committed(GROUP, TOPIC, 0) == 2, "the kept record", errors=errors)
    finally:
        locker.close()
        for member in joined:
            member.close()
    assert calls.while_away == [], f"handled after the revoke returned: {calls.while_away}"
    assert applied(engine) == [("kept", 1), ("kept", 2)]
    assert broker.committed(GROUP, TOPIC, 1) in (None, 0), "the lost record's offset committed past it"
    engine.dispose()
