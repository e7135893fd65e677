"""Hot keys: a key's consecutive messages in one transaction, and what a failure inside the run does.

A run of one key must cost one lock, one claim, one advance and one commit;
a failure at message k commits 1..k-1, rolls back only k's writes, runs
nothing after k, and sends k to retry or park with the rest of its key behind
it. Duplicates, held messages and handler signals inside a run are settled as
they would be one message at a time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from outbox import Disposition, Inbox, ParkMessage, RetryLater, SkipMessage
from outbox.inbox._delivery import Delivery, decode
from outbox.inbox._schedule import KeyScheduler
from tests.inbox_support import (
    INBOX_KINDS,
    TEST_BUDGET,
    TOPIC,
    AlertLog,
    DatabaseOutage,
    applied,
    apply_effect,
    business,
    dispose,
    for_inbox,
    handles,
    inbox_bind,
    insert_effects,
    record,
    settle,
)
from transports import Record


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """These proofs run on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url

@pytest.fixture(params=INBOX_KINDS)
def make_inbox(engine: sa.Engine, request: pytest.FixtureRequest) -> Iterator[Callable[..., Inbox]]:
    """``make(**options)``: an Inbox on ``engine``, or on an AsyncEngine on the same database with
    async handlers."""
    made: list[Inbox] = []

    def make(**options: object) -> Inbox:
        box = Inbox(inbox_bind(engine, request.param), group="hot",
                    **{"retry_backoff": 0.001, "retry_backoff_max": 0.01, "alert": AlertLog(),
                       "batch_budget": TEST_BUDGET, **options})
        made.append(box)
        box.create_tables()
        business.create_all(engine)
        return box

    yield make
    for box in made:
        dispose(box)


@pytest.fixture
def inbox(make_inbox: Callable[..., Inbox]) -> Inbox:
    return make_inbox()


def delivery(key: str, seq: int, message_id: uuid.UUID | None = None) -> Record:
    """The record of ``key``'s ``seq`` as the broker delivers it."""
    return record(TOPIC, key, seq, message_id=message_id)


def run_of(key: str, first: int, last: int) -> list[Record]:
    return [delivery(key, seq) for seq in range(first, last + 1)]


def seqs(pairs) -> list[int | None]:  # type: ignore[no-untyped-def]
    return [d.message.seq for d, *_ in pairs]


def last_seq(inbox: Inbox, engine: sa.Engine, key: str) -> int:
    k = inbox.tables.inbox_keys
    with engine.connect() as conn:
        return conn.scalar(sa.select(k.c.last_seq).where(k.c.consumer_group == inbox.group,
                                                         k.c.key == key)) or 0


def rows(inbox: Inbox, engine: sa.Engine, table: str) -> list[int]:
    t = getattr(inbox.tables, table)
    with engine.connect() as conn:
        return sorted(conn.scalars(sa.select(t.c.seq).where(t.c.consumer_group == inbox.group)))


def drain(inbox: Inbox, batch: list[Record]) -> dict[int, Disposition]:
    """Settle ``batch``; hand what comes back to the settle stage again, as one batch in the order
    given (what the scheduler does with a lane's returned deliveries), until all are done."""
    done: dict[int, Disposition] = {}
    for _ in range(50):
        settled = settle(inbox, batch)
        for d, disposition in settled.done:
            done[d.message.seq] = disposition  # type: ignore[index]
        if not settled.later:
            return done
        time.sleep(max(delay for _, delay in settled.later))
        batch = [d for d, _ in settled.later]
    raise AssertionError("never settled")


def test_a_key_run_is_one_lock_one_claim_one_commit(inbox: Inbox, engine: sa.Engine) -> None:
    inbox.handler(TOPIC)(for_inbox(inbox, apply_effect))
    statements: Counter[str] = Counter()

    @sa.event.listens_for(inbox.engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        text = " ".join(statement.split()).upper()
        for what in ("INSERT INTO INBOX_MESSAGES", "UPDATE INBOX_KEYS", "INBOX_HELD"):
            if what in text:
                statements[what] += 1
        if "FROM INBOX_KEYS" in text:
            statements["lock"] += 1

    sa.event.listen(inbox.engine, "commit", lambda conn: statements.update(["commit"]))
    result = settle(inbox, run_of("a", 1, 50))
    sa.event.remove(inbox.engine, "before_cursor_execute", count)
    assert [disposition for _, disposition in result.done] == [Disposition.APPLIED] * 50
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 51)]
    assert last_seq(inbox, engine, "a") == 50
    # A new key costs the insert of its row; the advance is one statement on both dialects.
    assert statements["INSERT INTO INBOX_MESSAGES"] == 1, statements
    assert statements["commit"] == 1, statements
    assert statements["INBOX_HELD"] == 1, statements  # one look for held successors
    assert statements["lock"] <= 2, statements  # lock (and read again after creating the row)


def test_a_run_that_arrives_out_of_order_applies_in_seq_order(inbox: Inbox, engine: sa.Engine) -> None:
    inbox.handler(TOPIC)(for_inbox(inbox, apply_effect))
    batch = [delivery("a", seq) for seq in (3, 1, 2, 5, 4)]
    result = settle(inbox, batch)
    assert seqs(result.done) == [1, 2, 3, 4, 5]
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 6)]
    assert rows(inbox, engine, "inbox_held") == []


def failing_at(fail: dict[int, int], calls: list[int]):  # type: ignore[no-untyped-def]
    """``apply_effect`` that fails (after writing) at each seq in ``fail`` that many times."""
    def handle(session, message):  # type: ignore[no-untyped-def]
        calls.append(message.seq)
        apply_effect(session, message)
        if fail.get(message.seq, 0) > 0:
            fail[message.seq] -= 1
            raise RuntimeError(f"seq {message.seq} fails")
    return handle


def test_a_failure_mid_run_commits_the_ones_before_and_runs_none_after(
    inbox: Inbox, engine: sa.Engine
) -> None:
    calls: list[int] = []
    inbox.handler(TOPIC)(for_inbox(inbox, failing_at({3: 1}, calls)))
    settled = settle(inbox, run_of("a", 1, 6))
    assert [(d.message.seq, disposition) for d, disposition in settled.done] == [
        (1, Disposition.APPLIED), (2, Disposition.APPLIED)]
    # The failed one first, then the rest of its key, all after the same delay; one attempt counted.
    assert seqs(settled.later) == [3, 4, 5, 6]
    assert len({delay for _, delay in settled.later}) == 1
    assert [d.attempts.count for d, _ in settled.later] == [1, 0, 0, 0]
    assert applied(engine, "a") == [("a", 1), ("a", 2)]  # 3's write rolled back
    assert last_seq(inbox, engine, "a") == 2
    assert rows(inbox, engine, "inbox_messages") == [1, 2]  # no dedup row for 3..6
    assert rows(inbox, engine, "inbox_held") == []
    # Unguarded first, then the redo with savepoints reuses 3's failure: 4..6 never ran.
    assert calls == [1, 2, 3, 1, 2]
    assert drain(inbox, [d for d, _ in settled.later]) == dict.fromkeys(range(3, 7), Disposition.APPLIED)
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 7)]


def test_a_poison_mid_run_parks_with_the_rest_of_its_key_behind_it(inbox: Inbox, engine: sa.Engine) -> None:
    calls: list[int] = []
    inbox.handler(TOPIC)(for_inbox(inbox, failing_at({3: 100}, calls)))
    done = drain(inbox, run_of("a", 1, 5) + run_of("b", 1, 2))
    assert done == {1: Disposition.APPLIED, 2: Disposition.APPLIED, 3: Disposition.PARKED,
                    4: Disposition.PARKED, 5: Disposition.PARKED}
    assert applied(engine, "a") == [("a", 1), ("a", 2)]
    assert applied(engine, "b") == [("b", 1), ("b", 2)]  # another key is not held up
    assert calls.count(3) == 3 and 4 not in calls and 5 not in calls
    parked = inbox.parked(TOPIC, "a")
    assert [(p.seq, p.reason, p.attempts) for p in parked] == [
        (3, "failed", 3), (4, "key_parked", 0), (5, "key_parked", 0)]
    assert [(a.kind, a.key) for a in inbox.alert] == [("key_parked", "a")]
    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, apply_effect))
    assert inbox.replay(TOPIC, "a").applied == 3
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 6)]


def test_handler_signals_inside_a_run(inbox: Inbox, engine: sa.Engine) -> None:
    later_once: set[int] = set()
    # A skipped seq leaves no business row: this handler does not check the order itself.
    calls: list[int] = []

    @handles(inbox, TOPIC)
    def handle_unchecked(session, message):  # type: ignore[no-untyped-def]
        calls.append(message.seq)
        if message.seq == 2:
            raise SkipMessage("not for us")
        insert_effects(session, [message])
        if message.seq == 4 and 4 not in later_once:
            later_once.add(4)
            raise RetryLater(0.01, "busy")
        if message.seq == 6:
            raise ParkMessage("bad amount")

    first = settle(inbox, run_of("a", 1, 8))
    assert seqs(first.later) == [4, 5, 6, 7, 8]
    assert [d.attempts.count for d, _ in first.later] == [0] * 5  # RetryLater counts nothing
    done = drain(inbox, [d for d, _ in first.later])
    assert done == {4: Disposition.APPLIED, 5: Disposition.APPLIED, 6: Disposition.PARKED,
                    7: Disposition.PARKED, 8: Disposition.PARKED}
    assert [seq for _, seq in applied(engine, "a")] == [1, 3, 4, 5]
    assert [(p.seq, p.reason) for p in inbox.parked(TOPIC, "a")] == [
        (6, "failed"), (7, "key_parked"), (8, "key_parked")]
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        assert conn.scalar(sa.select(m.c.outcome).where(m.c.seq == 2)) == "skipped"
    assert 7 not in calls and 8 not in calls


def test_duplicates_inside_a_run_apply_once(inbox: Inbox, engine: sa.Engine) -> None:
    inbox.handler(TOPIC)(for_inbox(inbox, apply_effect))
    one, two_id, three_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert [(d.message.message_id, disposition) for d, disposition in
            settle(inbox, [delivery("a", 1, one)]).done] == [(one, Disposition.APPLIED)]
    two, three, four = delivery("a", 2, two_id), delivery("a", 3, three_id), delivery("a", 4)
    again = [delivery("a", 2, two_id), delivery("a", 3, three_id), delivery("a", 1, one)]
    result = settle(inbox, [two, again[0], three, again[2], four, again[1]])
    assert sorted((d.message.seq, disposition.value) for d, disposition in result.done) == [
        (1, "duplicate"), (2, "applied"), (2, "duplicate"), (3, "applied"), (3, "duplicate"),
        (4, "applied")]
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 5)]
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        assert dict(conn.execute(sa.select(m.c.seq, m.c.deliveries)).all()) == {1: 2, 2: 2, 3: 2, 4: 1}


def test_a_held_message_that_becomes_next_joins_the_run(inbox: Inbox, engine: sa.Engine) -> None:
    inbox.handler(TOPIC)(for_inbox(inbox, apply_effect))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "a", 4)) is Disposition.HELD
    result = settle(inbox, [delivery("a", seq) for seq in (2, 3, 5, 6)])
    assert seqs(result.done) == [2, 3, 4, 5, 6]
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 7)]
    assert rows(inbox, engine, "inbox_held") == []


def test_a_held_copy_of_a_message_the_run_applied_is_removed(
    make_inbox: Callable[..., Inbox], engine: sa.Engine
) -> None:
    """Seq 3 waits in inbox_held; its fresh copy arrives right behind 2 and runs with it."""
    inbox = make_inbox(gap_timeout=0.01)
    inbox.handler(TOPIC)(for_inbox(inbox, apply_effect))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    three = uuid.uuid4()
    assert inbox.handle(record(TOPIC, "a", 3, message_id=three)) is Disposition.HELD
    result = settle(inbox, [delivery("a", 2), delivery("a", 3, three)])
    assert sorted((d.message.seq, disposition.value) for d, disposition in result.done) == [
        (2, "applied"), (3, "applied"), (3, "duplicate")]
    assert rows(inbox, engine, "inbox_held") == []
    time.sleep(0.05)
    inbox.sweep()  # a held row left behind would park the key as a gap that never fills
    assert inbox.parked() == []
    assert applied(engine, "a") == [("a", 1), ("a", 2), ("a", 3)]


def test_a_batch_handler_gets_each_keys_run_in_seq_order(inbox: Inbox, engine: sa.Engine) -> None:
    calls: list[list[tuple[str, int]]] = []
    bad: set[tuple[str, int]] = set()

    @handles(inbox, TOPIC, batch=True)
    def handle(session, messages):  # type: ignore[no-untyped-def]
        calls.append([(m.key, m.seq) for m in messages])
        insert_effects(session, messages)
        if bad & {(m.key, m.seq) for m in messages}:
            raise RuntimeError("after writing")

    batch = [delivery(key, seq) for key, seq in (("a", 3), ("b", 1), ("a", 1), ("a", 2), ("b", 2))]
    settle(inbox, batch)
    assert calls == [[("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]]
    calls.clear()
    bad.add(("a", 5))
    result = settle(inbox, [delivery("a", seq) for seq in (4, 5, 6)] + [delivery("b", 3)])
    # The failed call is redone one message per call, and stops the key at its failure.
    assert calls == [[("a", 4), ("a", 5), ("a", 6), ("b", 3)], [("a", 4)], [("a", 5)], [("b", 3)]]
    # 5 failed (one attempt) and 6, not run, waits behind it.
    assert [(d.message.seq, d.attempts.count) for d, _ in result.later] == [(5, 1), (6, 0)]
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 5)]


def test_an_outage_mid_run_applies_nothing_and_counts_no_attempt(inbox: Inbox, engine: sa.Engine) -> None:
    outage = DatabaseOutage(inbox.engine)

    @handles(inbox, TOPIC)
    def handle(session, message):  # type: ignore[no-untyped-def]
        apply_effect(session, message)
        if message.seq == 3 and not outage.failures:
            outage.fail(times=1)
            session.execute(sa.text("SELECT 1"))

    settled = settle(inbox, run_of("a", 1, 5))
    assert settled.done == []
    assert seqs(settled.later) == [1, 2, 3, 4, 5]
    assert [d.attempts.count for d, _ in settled.later] == [0] * 5
    assert applied(engine, "a") == [] and rows(inbox, engine, "inbox_messages") == []
    assert last_seq(inbox, engine, "a") == 0
    assert drain(inbox, [d for d, _ in settled.later]) == dict.fromkeys(range(1, 6), Disposition.APPLIED)
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 6)]


def test_the_scheduler_hands_out_runs_bounded_by_the_batch_size() -> None:
    batches: list[list[tuple[str | None, int | None]]] = []
    finished = threading.Event()
    returned: list[bool] = []

    def work(batch: list[Delivery]) -> list[tuple[Delivery, float]]:
        batches.append([(d.message.key, d.message.seq) for d in batch])
        if not returned:  # the first batch comes back once, as a failure and its followers would
            returned.append(True)
            return [(d, 0.0) for d in batch if d.message.key == "a"]
        if sum(len(b) for b in batches) == 11 + 3:
            finished.set()
        return []

    scheduler = KeyScheduler(work, concurrency=1, batch_size=4, on_crash=lambda exc: None)
    # The scheduler is internal (the subject here): it takes the inbox's decoded deliveries.
    scheduler.submit([decode(r) for r in run_of("a", 1, 10) + run_of("b", 1, 1)])
    scheduler.start()
    try:
        assert finished.wait(10), batches
    finally:
        scheduler.stop(5)
    assert batches[0] == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]  # each head, then a's run
    assert all(len(b) <= 4 for b in batches)
    a = [seq for b in batches[1:] for key, seq in b if key == "a"]
    assert a == list(range(1, 11))  # what came back runs first, in the order it came back


def test_a_submission_reaches_an_idle_worker_when_another_waiter_stands_first() -> None:
    """The scheduler's condition has waiters of other kinds than its workers: its timer thread
    (waiting for a key's retry timer) and the consumer (waiting for room). ``submit`` woke one
    waiter per delivery, the first in line: when that was not a worker, it found nothing for
    itself and waited again, and the delivery sat queued beside idle workers until some other
    event woke them. Under load the timer thread stood first after a batch; the rebalance test in
    test_inbox_broker_outage.py saw its last record never run (its offset committed unfinished,
    then dropped at the stop). Here a thread waiting on the condition for something of its own
    (as the timer thread waits for a retry timer) stands first in line, deterministically."""
    handled = threading.Event()

    def work(batch: list[Delivery]) -> list[tuple[Delivery, float]]:
        handled.set()
        return []

    scheduler = KeyScheduler(work, concurrency=1, batch_size=1, on_crash=lambda exc: None)
    cond = scheduler._cond
    waiters = cond._waiters  # type: ignore[attr-defined]  # CPython wakes them first in, first out
    done = threading.Event()

    def wait_for_something_else() -> None:
        with cond:
            cond.wait_for(done.is_set, 30)

    def until_waiting(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(waiters) < count:
            assert time.monotonic() < deadline, f"{len(waiters)} threads waiting, not {count}"
            time.sleep(0.001)

    first = threading.Thread(target=wait_for_something_else, daemon=True)
    first.start()
    until_waiting(1)
    scheduler.start()
    until_waiting(3)  # that thread, then the worker and the timer thread
    try:
        scheduler.submit([decode(delivery("k", 1))])
        assert handled.wait(3), "the delivery sat queued beside an idle worker"
    finally:
        scheduler.stop(5)
        done.set()
        with cond:
            cond.notify_all()
        first.join(10)


def test_a_held_backlog_that_becomes_next_runs_as_one_run_up_to_its_next_gap(
    inbox: Inbox, engine: sa.Engine
) -> None:
    inbox.handler(TOPIC)(for_inbox(inbox, apply_effect))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    for seq in [*range(3, 41), *range(42, 46)]:  # 41 is missing too
        assert inbox.handle(record(TOPIC, "a", seq)) is Disposition.HELD
    held_statements: list[str] = []

    @sa.event.listens_for(inbox.engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "inbox_held" in statement:
            held_statements.append(statement)

    result = settle(inbox, [delivery("a", 2)])
    sa.event.remove(inbox.engine, "before_cursor_execute", count)
    assert seqs(result.done) == list(range(2, 41))
    assert [seq for _, seq in applied(engine, "a")] == list(range(1, 41))
    assert rows(inbox, engine, "inbox_held") == list(range(42, 46))  # behind the gap at 41
    # Look after 2, look after 3..40, delete the applied rows: not a round per held message.
    assert len(held_statements) == 3, held_statements
    assert last_seq(inbox, engine, "a") == 40


def test_an_outage_while_parking_mid_run_keeps_the_failed_message_ahead_of_its_key(
    inbox: Inbox, engine: sa.Engine
) -> None:
    outage = DatabaseOutage(inbox.engine, only="INSERT INTO inbox_parked")

    @handles(inbox, TOPIC)
    def handle(session, message):  # type: ignore[no-untyped-def]
        apply_effect(session, message)
        if message.seq == 2:
            raise ParkMessage("bad amount")

    outage.fail(times=1)
    settled = settle(inbox, run_of("a", 1, 4))
    assert seqs(settled.done) == [1]
    assert seqs(settled.later) == [2, 3, 4]  # the park waits out the outage, the key behind it
    assert [d.attempts.count for d, _ in settled.later] == [0, 0, 0]
    outage.end()
    assert drain(inbox, [d for d, _ in settled.later]) == {
        2: Disposition.PARKED, 3: Disposition.PARKED, 4: Disposition.PARKED}
    assert [(p.seq, p.reason) for p in inbox.parked(TOPIC, "a")] == [
        (2, "failed"), (3, "key_parked"), (4, "key_parked")]


class BudgetClock:
    """The clock of ``batch_budget`` (``outbox.inbox._calls.time``), moved only by what the test's
    handlers say they took: a loaded host's stall spends none of a transaction's budget.

    With the host's clock, a test whose handler must fail *within* the budget (or whose first pass
    must fit in it) would fail whenever the host stalled the transaction for the budget's margin."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from outbox.inbox import _calls

        self.now = 1000.0
        monkeypatch.setattr(_calls, "time", self)

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return time.perf_counter()

    def took(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def budget_clock(monkeypatch: pytest.MonkeyPatch) -> BudgetClock:
    return BudgetClock(monkeypatch)


def slow(pause: float, calls: list[int], fail: dict[int, int] | None = None,  # type: ignore[no-untyped-def]
         clock: BudgetClock | None = None):
    """``failing_at`` that takes ``pause`` seconds per call, as a handler calling a service would:
    of the host's time, or only of ``clock``'s."""
    handle = failing_at(fail or {}, calls)

    def slow_handle(session, message):  # type: ignore[no-untyped-def]
        if clock is None:
            time.sleep(pause)
        else:
            clock.took(pause)
        handle(session, message)
    return slow_handle


def test_a_slow_run_commits_what_ran_within_the_budget_and_the_rest_follows_at_once(
    make_inbox: Callable[..., Inbox], engine: sa.Engine
) -> None:
    """A transaction starts no handler past ``batch_budget``: a slow handler's batch commits what
    ran instead of holding its keys for ``batch_size`` calls; the rest comes back at once, in seq
    order, counting no attempt, and its claims are given back."""
    inbox = make_inbox(batch_budget=0.1)
    calls: list[int] = []
    inbox.handler(TOPIC)(for_inbox(inbox, slow(0.04, calls)))
    settled = settle(inbox, run_of("a", 1, 10) + run_of("b", 1, 2))
    ran = seqs(settled.done)
    assert 1 <= len(ran) < 10 and ran == list(range(1, len(ran) + 1)), ran  # a's run, cut short
    assert calls == ran  # nothing called twice, nothing called that did not apply
    assert seqs(settled.later) == [*range(len(ran) + 1, 11), 1, 2]  # the rest of a, then b
    assert {delay for _, delay in settled.later} == {0.0}
    assert [d.attempts.count for d, _ in settled.later] == [0] * len(settled.later)
    assert applied(engine) == [("a", seq) for seq in ran]
    assert last_seq(inbox, engine, "a") == len(ran)
    assert rows(inbox, engine, "inbox_messages") == ran  # the deferred ones hold no claim
    assert drain(inbox, [d for d, _ in settled.later]) == {
        **dict.fromkeys(range(len(ran) + 1, 11), Disposition.APPLIED), 1: Disposition.APPLIED,
        2: Disposition.APPLIED}
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 11)]
    assert applied(engine, "b") == [("b", 1), ("b", 2)]
    assert sorted(calls) == sorted([*range(1, 11), 1, 2])  # each handler ran once


def test_a_failure_in_a_slow_run_is_settled_as_without_a_budget(
    make_inbox: Callable[..., Inbox], engine: sa.Engine, budget_clock: BudgetClock
) -> None:
    """The budget changes how many messages a transaction runs, never what a failure at message k
    does: the ones before k apply once, k is retried with one attempt counted, none after k ran."""
    inbox = make_inbox(batch_budget=0.5)  # a slow handler, a budget that seq 2 fails within
    calls: list[int] = []
    inbox.handler(TOPIC)(for_inbox(inbox, slow(0.04, calls, {2: 1}, budget_clock)))
    settled = settle(inbox, run_of("a", 1, 6))
    assert seqs(settled.done) == [1]
    assert seqs(settled.later) == [2, 3, 4, 5, 6]
    assert [d.attempts.count for d, _ in settled.later] == [1, 0, 0, 0, 0]
    assert calls == [1, 2, 1]  # the redo reuses 2's failure
    assert applied(engine, "a") == [("a", 1)]
    assert drain(inbox, [d for d, _ in settled.later]) == dict.fromkeys(range(2, 7), Disposition.APPLIED)
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 7)]


def test_a_redo_that_outlasts_the_budget_still_counts_the_failure_it_reuses(
    make_inbox: Callable[..., Inbox], engine: sa.Engine, budget_clock: BudgetClock
) -> None:
    """Found by an attack on ``batch_budget``: a failure sends the batch to the redo, one SAVEPOINT
    per message (slower than the first pass); a redo that ran out of budget on another key's
    messages deferred the failed one, whose failure it already knew and which costs no call to
    settle: its attempt was never counted and its failing handler ran once more, for as long as a
    busy key's runs kept coming ahead of it and outlasting the budget in the redo (never parking).
    A failing handler runs ``max_attempts`` times, budget or not."""
    inbox = make_inbox(batch_budget=1.0)  # the first pass within it: the budget's clock stands still
    calls: list[tuple[str | None, int | None]] = []

    def handle(session, message):  # type: ignore[no-untyped-def]
        calls.append((message.key, message.seq))
        if message.key == "b" and calls.count(("b", 1)) == 2:
            budget_clock.took(1.2)  # the redo's call of b's message outlasts the budget
        apply_effect(session, message)
        if message.key == "a":
            raise RuntimeError("a fails, always")

    inbox.handler(TOPIC)(for_inbox(inbox, handle))
    settled = settle(inbox, [delivery("b", 1), delivery("a", 1)])
    assert [(d.message.key, disposition) for d, disposition in settled.done] == [("b", Disposition.APPLIED)]
    assert [(d.message.key, d.attempts.count) for d, _ in settled.later] == [("a", 1)]  # its failure counted
    assert calls == [("b", 1), ("a", 1), ("b", 1)]  # the redo reuses a's failure
    assert drain(inbox, [d for d, _ in settled.later]) == {1: Disposition.PARKED}
    assert calls.count(("a", 1)) == 3  # max_attempts calls, each one counted
    assert [(p.seq, p.reason) for p in inbox.parked(TOPIC, "a")] == [(1, "failed")]


def test_an_operators_replay_has_no_budget(make_inbox: Callable[..., Inbox], engine: sa.Engine) -> None:
    """``batch_budget`` bounds the consumer's transactions only: a replay runs every message it was
    given (nothing takes up what a replay would defer: its caller reads only what applied)."""
    inbox = make_inbox(batch_budget=0.05)
    calls: list[int] = []
    inbox.handler(TOPIC)(for_inbox(inbox, failing_at({1: 100}, calls)))
    assert drain(inbox, run_of("a", 1, 6)) == dict.fromkeys(range(1, 7), Disposition.PARKED)
    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, slow(0.03, calls)))
    assert inbox.replay(TOPIC, "a").applied == 6
    assert applied(engine, "a") == [("a", seq) for seq in range(1, 7)]
    assert inbox.parked(TOPIC, "a") == []
