"""Attacks on the byte bound of a relay's batch (01c25a8, ``max_batch_bytes``): each test here failed
on the commit it attacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, publish, rows, slow_writes, wait_for

from outbox import Outbox, Relay, create_engine
from transports import Outcome, Record, SendResult


class BatchLog(ScriptedTransport):
    """Keeps each batch's records, as the relay handed them over."""

    def __init__(self, script: dict | None = None) -> None:
        super().__init__(script)
        self.batches: list[list[Record]] = []

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        self.batches.append(list(records))
        return super().publish(records)


def _outbox(url: str) -> Iterator[Outbox]:
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    yield outbox
    engine.dispose()


def _relay_running(relay: Relay) -> threading.Thread:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    return thread


def _stopped(relay: Relay, thread: threading.Thread) -> None:
    relay.stop()
    thread.join(40)
    assert not thread.is_alive()


@pytest.fixture
def mysql_outbox(mysql_db: str) -> Iterator[Outbox]:
    yield from _outbox(mysql_db)


def test_mysql_a_fetch_whose_bytes_all_went_to_a_row_being_written_waits_for_the_write(
        mysql_outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """MySQL pipelines: batch 1's row (1,000 bytes, over a budget of 500) is being marked when
    batch 2 fetches. MySQL's fetch cannot leave busy rows out, so it returns that row alone
    (it took the whole budget) and ``BatchRunner.run`` "settles the writes and fetches again".
    But ``_settle()`` without ``keep`` only drops writes already done: it does not wait. The run
    recurses into itself, fetching the same busy row again and again as fast as MySQL answers,
    until the write ends or Python's recursion limit is reached (RecursionError: "batch failed").

    Found (MariaDB, under nice): with the write held 3 s, batch 2 fetched 464 times; held 9 s,
    it raised RecursionError after 946 fetches."""
    outbox = mysql_outbox
    for i in range(2):
        publish(outbox, "t", [f"k{i}"], payload=bytes([i]) * 1000)
    relay = Relay(outbox, BatchLog(), batch_size=100, max_batch_bytes=500, poll_interval=30)
    batch = relay._step._batch
    release = threading.Event()
    real_write = batch._write

    def held_write(plan: Any) -> Any:
        release.wait(10)
        return real_write(plan)

    monkeypatch.setattr(batch, "_write", held_write)
    fetches = []
    real_params = batch.sql.fetch_params

    def counted(*args: Any) -> Any:
        fetches.append(time.monotonic())
        return real_params(*args)

    monkeypatch.setattr(batch.sql, "fetch_params", counted)
    timer = threading.Timer(3.0, release.set)
    try:
        first = relay._step.run(wait=False, leases=True)
        assert first.batch.fetched == 1
        timer.start()
        error: BaseException | None = None
        try:
            second = relay._step.run(wait=False, leases=True)
        except RecursionError as exc:
            error = exc
        n = len(fetches) - 1
        assert error is None, f"batch 2 raised {error!r} after {n} fetches while batch 1 was being written"
        assert n <= 3, f"batch 2 fetched {n} times while batch 1 was being written (a busy loop)"
        assert second.batch.fetched == 1
    finally:
        release.set()
        timer.cancel()
        relay.close()


@pytest.fixture
def pg_outbox(postgres_db: str) -> Iterator[Outbox]:
    yield from _outbox(postgres_db)


@pytest.fixture
def server_outbox(server_db_url: str) -> Iterator[Outbox]:
    yield from _outbox(server_db_url)


@pytest.fixture
def sqlite_outbox(sqlite_db: str) -> Iterator[Outbox]:
    yield from _outbox(sqlite_db)


def test_postgres_a_fetch_cut_to_rows_of_a_held_key_does_not_stall_the_other_keys(
        pg_outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined (``Relay.run``): a1 (its 21st attempt, 1,000 bytes) is retried, its key "a" held
    in the wheel for 30 s, and while its mark is being written the next fetch finds a2 (1,000
    bytes) due: with a budget of 500 bytes that row is the whole fetch. It is held (its key is in
    the wheel), so nothing is sent: ``Step.again`` is False (``sent == 0``) although the fetch was
    cut by its bytes, and the relay waits for the wheel (30 s) or the poll interval (30 s) while
    b1 and b2 are due. Without the byte cut the same fetch took b1 and b2 and sent them.

    Found: b1 and b2 still pending after 8 s (published only after the 30 s wait)."""
    outbox = pg_outbox
    [a1] = publish(outbox, "t", ["a"], payload=b"x" * 1000)
    publish(outbox, "t", ["a"], payload=b"y" * 1000)
    publish(outbox, "t", ["b", "b"], payload=b"z" * 10)
    m = outbox.tables.messages
    with outbox._sessions() as session, session.begin():
        session.execute(sa.update(m).where(m.c.message_id == a1).values(attempts=20))  # backoff: 30 s
    log = BatchLog({str(a1): [Outcome.RETRY]})
    relay = Relay(outbox, log, batch_size=100, max_batch_bytes=500, poll_interval=30)
    slow_writes(relay, monkeypatch, 0.5)  # a mark that takes half a second
    thread = _relay_running(relay)
    try:
        wait_for(lambda: not rows(outbox, status="pending", key="b"), 8,
                 "b's rows published (not after the wheel's 30 s)")
    finally:
        _stopped(relay, thread)


def _fetch_seconds(outbox: Outbox, batch_size: int, budget: int) -> tuple[int, float]:
    """Rows and median seconds of five runs of the relay's backlog fetch over all shards."""
    from datetime import UTC, datetime

    def utcnow() -> datetime:
        return datetime.now(UTC)

    relay = Relay(outbox, BatchLog(), batch_size=batch_size, max_batch_bytes=budget)
    sql = relay._step._batch.sql
    times, got = [], []
    try:
        with relay._step._batch.engine.connect() as conn:
            conn = sql.prepare_fetch(conn)
            for _ in range(5):
                params = sql.fetch_params(utcnow(), batch_size, [], budget)
                started = time.perf_counter()
                got = conn.execute(sql.fetch(range(16), backlog=True), params).all()
                times.append(time.perf_counter() - started)
            conn.rollback()
    finally:
        relay.close()
    return len(got), sorted(times)[2]


def test_mysql_a_fetch_cut_by_its_bytes_costs_what_a_fetch_of_the_rows_it_returns_costs(
        mysql_outbox: Outbox) -> None:
    """The running sum wraps the fetch in a derived table (``_sized``) that MySQL materializes,
    payloads and all, for every one of ``limit`` rows, before the cut leaves all but a few out:
    what is left out does not cross the wire, but the server reads and copies it at every
    fetch. 300 rows of 300 KB pending, a batch size of 300 and a budget of 1 MB (4 rows a
    batch): each fetch copies 90 MB to return 1.2 MB; draining N such rows copies
    O(N * batch_size) payloads. (PostgreSQL keeps TOASTed payloads as pointers there: its cut
    fetch costs what a 4-row fetch costs.)

    Found (MariaDB, under nice): at 300 rows the cut fetch took 0.59-0.63 s, a fetch of 4 rows
    11-12 ms; at 200 rows 0.22-0.85 s against 6-28 ms; at 400 rows (120 MB) 0.7-2.3 s against
    6-84 ms (PostgreSQL at 400 rows: 22-64 ms against 33-167 ms)."""
    outbox = mysql_outbox
    with outbox._sessions() as session, session.begin():
        for i in range(300):
            outbox.publish(session, "t", bytes([i % 256]) * 300_000, key=f"k{i % 7}")
    _fetch_seconds(outbox, 4, 2**40)  # warm the buffer pool
    rows_cut, cut = _fetch_seconds(outbox, 300, 1_000_000)
    rows_few, few = _fetch_seconds(outbox, 4, 2**40)
    assert rows_cut == rows_few == 4
    assert cut < max(0.1, 5 * few), (f"a fetch cut by its bytes to 4 rows took {cut:.3f} s, a fetch of "
                                     f"4 rows {few:.3f} s")


@pytest.mark.parametrize("budget", [pytest.param(2**40, id="no-byte-cut")])
def test_a_retry_due_before_its_pipelined_mark_commits_is_sent_without_waiting_for_the_poll(
        server_outbox: Outbox, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the byte cut's (found while attacking it, with max_batch_bytes=2**40): pipelined, a
    row retried with a backoff (0.05 s) shorter than its mark's write (0.5 s here; a slow commit)
    has its key's wheel timer fire while the mark is in flight. The fetch at that wake-up leaves
    the row out (busy: PostgreSQL's statement, MySQL's ``without_busy``), finds nothing, and the
    wheel is now empty: the relay sleeps the whole poll interval (30 s) although the row is due
    once its mark commits. Nothing wakes it when the write ends. (With a backoff of 1 s, longer
    than the write, the same test passes.)

    Found: PostgreSQL and MariaDB, the row still pending after 8 s (sent after 30 s). In a
    random pipelined run (150 rows, backoff 0.05 s, writes of 0-30 ms) MariaDB left 4 due rows
    pending for 30 s."""
    import tenacity

    outbox = server_outbox
    [a1] = publish(outbox, "t", ["a"], payload=b"x")
    log = BatchLog({str(a1): [Outcome.RETRY]})
    relay = Relay(outbox, log, batch_size=100, max_batch_bytes=budget, poll_interval=30,
                  backoff=tenacity.wait_fixed(0.05))
    slow_writes(relay, monkeypatch, 0.5)
    thread = _relay_running(relay)
    try:
        wait_for(lambda: not rows(outbox, status="pending"), 8, "the due retry sent (not after the poll)")
    finally:
        _stopped(relay, thread)


def test_mysql_a_batch_full_by_its_rows_is_full_when_the_busy_rows_were_marked_before_its_fetch(
        mysql_outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """MySQL asks for ``limit + len(busy)`` rows (``fetch_params``) and ``run`` now judges a batch
    full by that number (``len(rows) >= params["limit"]``), where ``Step.again`` used to be
    ``fetched == limit``. When the write that made those rows busy commits between ``run``'s
    ``_settle`` and its fetch (a pipelined write ending at the wrong moment), the busy rows are
    published, not fetched: the fetch returns ``limit`` due rows, fewer than ``limit + len(busy)``,
    so the batch is not full, ``Step.again`` is False and the relay sleeps its poll interval
    with a backlog (a regression of 01c25a8: before it, ``again`` was ``fetched == limit``).

    Found: batch 2 fetched 10 of 10 rows (15 due, fewer than the 20 asked) with 5 more
    pending, and ``again`` was False."""
    outbox = mysql_outbox
    publish(outbox, "t", [f"k{i % 3}" for i in range(25)])
    relay = Relay(outbox, BatchLog(), batch_size=10, poll_interval=30)
    batch = relay._step._batch
    release = threading.Event()
    real_write = batch._write

    def held_write(plan: Any) -> Any:
        release.wait(10)
        return real_write(plan)

    monkeypatch.setattr(batch, "_write", held_write)
    real_params = batch.sql.fetch_params

    def write_ends_now(*args: Any) -> Any:  # the write commits after _settle, before the fetch
        release.set()
        for writing in list(batch._writes):
            writing.future.result(10)
        return real_params(*args)

    try:
        first = relay._step.run(wait=False, leases=True)
        assert first.batch.fetched == 10 and first.again
        monkeypatch.setattr(batch.sql, "fetch_params", write_ends_now)
        second = relay._step.run(wait=False, leases=True)
        relay._step._batch.finish()
        left = len(rows(outbox, status="pending"))
        assert second.batch.fetched == 10 and left == 5
        assert second.again, f"a batch of 10 of 10 rows, {left} more due, and again={second.again}"
    finally:
        release.set()
        relay.close()


def test_a_fetch_cut_by_its_bytes_to_an_unsendable_row_does_not_stall_the_rows_behind_it(
        sqlite_outbox: Outbox) -> None:
    """The first row always comes, however large: when it is one the relay cannot encode (here
    a hand-written row whose headers are not JSON, 2,000 bytes, over a budget of 1,000), the
    batch is that row alone, failed, nothing sent. ``Step.again`` is ``full and sent > 0``:
    False, so the relay sleeps its poll interval (30 s) while the rows behind it are due.

    Found: SQLite, the 3 rows behind it still pending after 8 s (with a budget of 1 MB the same
    test passes)."""
    outbox = sqlite_outbox
    [bad] = publish(outbox, "t", ["a"], payload=b"x")
    publish(outbox, "t", ["b", "c", "d"], payload=b"y")
    m = outbox.tables.messages
    with outbox._sessions() as conn, conn.begin():
        conn.execute(sa.update(m).where(m.c.message_id == bad)
                     .values({m.c.headers: sa.cast(sa.literal("not json " * 222, sa.Text), sa.Text)}))
        assert conn.scalar(sa.select(sa.func.count()).where(m.c.headers.cast(sa.Text).like("not json%"))) == 1

    def keys_of(status: str) -> list[str]:  # not rows(): the bad row's headers cannot be decoded
        with outbox._sessions() as session:
            return list(session.scalars(sa.select(m.c.key).where(m.c.status == status).order_by(m.c.id)))

    relay = Relay(outbox, BatchLog(), batch_size=100, max_batch_bytes=1000, poll_interval=30)
    thread = _relay_running(relay)
    try:
        wait_for(lambda: not keys_of("pending"), 8, "the rows behind the unsendable one published")
    finally:
        _stopped(relay, thread)
    assert keys_of("failed") == ["a"]
