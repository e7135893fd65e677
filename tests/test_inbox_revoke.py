"""What a revoke itself does, seen from inside the group's rebalance: no dedup to hide behind.

``Inbox.run`` on the in-memory broker (``transports.memory``), whose group hands
a partition to a new member only after its holder's revoke callbacks returned,
as Kafka does. A second member joins while the first inbox has, of the partitions
it is about to lose, a transaction running, records queued behind it and a record
waiting for its retry, and of the partition it keeps, records queued. The source
tells the test when its revoke callback begins and returns, and what stood at
that moment.

The crash test (``test_inbox_crash.py``) passes with a revoke that drops
nothing and waits for nothing: the next owner's dedup drops the doubles. These
look at the revoke's own promise (docs/consumer.md, "Rebalance and shutdown"):
once it returned, this consumer never calls the handler for a record of the
revoked partition, its running transactions have ended, what they applied is
committed, and the kept partition's records are applied all the same.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy.orm import Session

from outbox import Inbox, Message, RetryLater, create_engine
from outbox.inbox._schedule import KeyScheduler
from tests.inbox_support import AlertLog, applied, apply_effect, business, record
from tests.test_inbox_holes import running, wait_for
from transports import Record
from transports.memory import InMemoryBroker, InMemorySource

TOPIC = "orders"
GROUP = "revoke"
KEPT, GONE, GONE_TOO = 0, 1, 3
"""Of four partitions, the first member keeps 0 and 2 when a second one joins (the broker deals them
in turn): 1 and 3 are revoked."""

TRAP = 0.5
"""How long a running handler of the revoked partition waits, once the revoke began, for the revoke
to return before it ends its transaction: a revoke that waits for it never returns meanwhile, one that
does not returns at once."""

RUNNING_AT_REVOKE = {("busy", 1), ("flaky", 1)}
"""The one transaction running when the revoke begins (partition 1's offsets 0 and 1)."""

LATER = 1.5
"""The retry delay of the revoked partition's waiting record: long past the revoke's return (about
``TRAP`` after it began), so a retry the revoke left waiting runs after it returned."""


class Watched(InMemorySource):
    """Calls ``began`` before the inbox's revoke callback and ``returned`` after it, for the first
    revocation of ``GONE`` (not the one ``close`` makes of what is left); polls nothing while
    ``held`` is set, so that records appended one by one come in one poll."""

    def __init__(self, broker: InMemoryBroker, *, began: Any, returned: Any) -> None:
        super().__init__(broker, group_id=GROUP, topics=[TOPIC])
        self.began, self.returned = began, returned
        self.polled: list[tuple[int | None, int | None]] = []
        self.held = threading.Event()
        self.watched = False

    def on_revoke(self, callback: Any) -> None:
        def watched(gone: Sequence[tuple[str, int]]) -> None:
            if (TOPIC, GONE) not in gone or self.watched:
                callback(gone)
                return
            self.watched = True
            self.began()
            callback(gone)
            self.returned()

        super().on_revoke(watched)

    def poll(self, max_records: int, timeout: float) -> list[Record]:
        if self.held.is_set():
            self.held.wait(min(timeout, 0.01))  # returns at once: a poll with nothing
            return []
        records = super().poll(max_records, timeout)
        self.polled.extend((r.partition, r.offset) for r in records)
        return records


def on(partition: int, key: str, seq: int) -> Record:
    r = record(TOPIC, key, seq)
    r.partition = partition
    return r


def test_a_revoke_ends_the_lost_partitions_work_commits_it_and_leaves_the_kept_one_alone(
        sqlite_db: str) -> None:
    """When the revoke begins: "later" (partition 3) waits for its retry; one transaction runs
    "busy" 1, which it applies, and "flaky" 1, which fails (partition 1, offsets 0 and 1); "busy" 2
    and "other" 1 queue behind it, and so do the three records of the kept partition 0. On SQLite
    one transaction at a time writes: one worker takes two records a transaction."""
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group=GROUP, concurrency=1, batch_size=2, max_attempts=100,
                  retry_backoff=0.05, retry_backoff_max=0.05, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    lock = threading.Lock()
    began, returned = threading.Event(), threading.Event()
    calls: Counter[tuple[str, int]] = Counter()
    # Handler calls for records of the revoked partitions once the revoke began, but for those of
    # the transaction it found running until it returns (the failure of "flaky" redoes "busy" in a
    # SAVEPOINT): a queued or waiting record, or a retry of the running ones.
    after_revoke: list[tuple[str, int]] = []
    in_handler: set[str] = set()
    trapped = [False]
    later_due = [0.0]
    at_return: dict[str, Any] = {}

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        key, seq = message.key, message.seq
        assert key is not None and seq is not None  # every record here has both
        with lock:
            calls[key, seq] += 1
            first = calls[key, seq] == 1
            if began.is_set() and not key.startswith("kept") and (
                    (key, seq) not in RUNNING_AT_REVOKE or returned.is_set()):
                after_revoke.append((key, seq))
            in_handler.add(key)
        try:
            if first and key in ("busy", "flaky"):  # running when the revoke begins
                began.wait(10)
                with lock:
                    trap, trapped[0] = not trapped[0], True
                if trap:
                    returned.wait(TRAP)
                if key == "flaky":  # its retry is the next owner's, never this consumer's
                    raise RuntimeError("fails after the revoke began")
            elif first and key == "later":  # waiting for its retry when the revoke begins
                later_due[0] = time.monotonic() + LATER
                raise RetryLater(LATER)
            elif first and key == "kept-later":  # applied only after "later" would have run again
                raise RetryLater(max(0.0, later_due[0] - time.monotonic()) + 0.2)
            apply_effect(session, message)
        finally:
            with lock:
                in_handler.discard(key)

    broker = InMemoryBroker(partitions=4)

    def revoke_returned() -> None:
        with lock:
            at_return["running"] = sorted(in_handler)
        at_return["applied"] = applied(engine)
        at_return["committed"] = broker.committed(GROUP, TOPIC, GONE)
        returned.set()

    source = Watched(broker, began=began.set, returned=revoke_returned)
    broker.append(on(GONE_TOO, "later", 1))
    joined: list[InMemorySource] = []  # left only once the inbox stopped: it takes nothing back
    try:
        with running(inbox, source) as errors:
            wait_for(lambda: calls["later", 1] == 1, "the retry waiting", errors=errors)
            source.held.set()
            for key, seq in [("busy", 1), ("flaky", 1), ("busy", 2), ("other", 1)]:
                broker.append(on(GONE, key, seq))
            source.held.clear()
            wait_for(lambda: "busy" in in_handler, "the running transaction", errors=errors)
            for key, seq in [("kept", 1), ("kept", 2), ("kept-later", 1)]:
                broker.append(on(KEPT, key, seq))
            wait_for(lambda: {(KEPT, n) for n in range(3)} <= set(source.polled),
                     "the kept partition's records queued behind the running transaction", errors=errors)
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))  # 1 and 3 its share
            wait_for(returned.is_set, "the revoke", errors=errors)
            wait_for(lambda: applied(engine, "kept-later") == [("kept-later", 1)]
                     and broker.committed(GROUP, TOPIC, KEPT) == 3,
                     "the kept partition's records applied and committed", timeout=10, errors=errors)
    finally:
        for member in joined:
            member.close()
    assert at_return["running"] == [], "the revoke returned while a transaction of its partition ran"
    assert ("busy", 1) in at_return["applied"], "the revoke returned before its running transaction ended"
    assert at_return["committed"] == 1, "the revoke returned with its applied offsets uncommitted"
    assert after_revoke == [], f"revoked partitions' records handled once the revoke began: {after_revoke}"
    assert applied(engine, "kept") == [("kept", 1), ("kept", 2)]
    assert applied(engine, "busy") == [("busy", 1)]  # its second record is the next owner's
    assert inbox.parked() == []


def test_a_revoke_leaves_a_kept_record_waiting_for_its_retry_to_wait(sqlite_db: str) -> None:
    """A key whose records sit on both partitions (it moved: more partitions, a new partitioner):
    its kept record waits for its retry with the lost partition's record queued behind it. The
    revoke drops that one and used to wake the whole lane, so the kept record ran again at once,
    its ``RetryLater`` (or a failure's backoff) cut short."""
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group=GROUP, concurrency=1, batch_size=1, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    delay = 1.0
    called: list[float] = []
    revoked = threading.Event()

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        if message.seq == 1:
            called.append(time.monotonic())
            if len(called) == 1:
                raise RetryLater(delay, "downstream busy")
        apply_effect(session, message)

    broker = InMemoryBroker(partitions=2)
    source = Watched(broker, began=lambda: None, returned=revoked.set)
    broker.append(on(KEPT, "moved", 1))
    broker.append(on(GONE, "moved", 2))
    joined: list[InMemorySource] = []  # left only once the inbox stopped: it takes nothing back
    try:
        with running(inbox, source) as errors:
            wait_for(lambda: len(called) == 1 and {(KEPT, 0), (GONE, 0)} <= set(source.polled),
                     "the kept record waiting, the lost one queued behind it", errors=errors)
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))  # GONE its share
            wait_for(revoked.is_set, "the revoke", errors=errors)
            wait_for(lambda: applied(engine) == [("moved", 1)], "the kept record applied", errors=errors)
    finally:
        for member in joined:
            member.close()
    # The timer wheel fires on a 20 ms tick: a little early at most, never at once.
    waited = called[1] - called[0]
    assert waited >= 0.9 * delay, f"tried again {waited:.2f}s after, not {delay}s"
    assert applied(engine) == [("moved", 1)]  # seq 2 is the next owner's


def test_a_batch_ending_as_the_revoke_begins_leaves_no_retry_of_the_lost_partition(
        sqlite_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch checks its failed records are still this consumer's (``Runner._still_mine``) before
    it puts their retries back (``KeyScheduler._release``). A revoke that begins between the two
    drops what is queued (nothing yet), then waits for that batch, which then queues the retry of
    the lost partition's record: this consumer used to handle it again after the revoke returned.
    The revoke is made to begin exactly in that gap; a record of the same key on the kept partition
    (unordered: no seq) comes after it, behind any retry left in the key's lane."""
    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group=GROUP, concurrency=1, batch_size=1, max_attempts=100,
                  retry_backoff=0.05, retry_backoff_max=0.05, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    broker = InMemoryBroker(partitions=2)
    revoked = threading.Event()
    source = Watched(broker, began=lambda: None, returned=revoked.set)
    calls: list[tuple[int | None, bool]] = []  # (seq, whether the revoke had returned)
    joined: list[InMemorySource] = []  # left only once the inbox stopped: it takes nothing back
    revoke_waits = threading.Event()

    @inbox.handler(TOPIC)
    def handler(session: Session, message: Message) -> None:
        calls.append((message.seq, revoked.is_set()))
        if message.seq == 1:
            raise RuntimeError("fails; its retry is the next owner's")
        apply_effect(session, message)

    wait_idle, release = KeyScheduler.wait_idle, KeyScheduler._release

    def waits_idle(self: KeyScheduler, *args: Any, **kwargs: Any) -> bool:
        revoke_waits.set()
        return wait_idle(self, *args, **kwargs)

    def released(self: KeyScheduler, lanes: Any, batch: list[Any], later: list[Any]) -> None:
        if later and not joined:  # the lost record's first failure, checked still this consumer's
            joined.append(InMemorySource(broker, group_id=GROUP, topics=[TOPIC]))  # GONE its share
            assert revoke_waits.wait(10), "the revoke never began"
        release(self, lanes, batch, later)

    monkeypatch.setattr(KeyScheduler, "wait_idle", waits_idle)
    monkeypatch.setattr(KeyScheduler, "_release", released)
    broker.append(on(GONE, "lost", 1))
    try:
        with running(inbox, source) as errors:
            wait_for(revoked.is_set, "the revoke", errors=errors)
            kept = record(TOPIC, "lost", None)
            kept.partition = KEPT
            broker.append(kept)
            wait_for(lambda: (None, True) in calls, "the kept record handled", errors=errors)
    finally:
        for member in joined:
            member.close()
    assert calls == [(1, False), (None, True)], f"handled (seq, after the revoke): {calls}"
