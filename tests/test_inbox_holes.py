"""Regression tests for the holes of issue 10, each reproduced on the code before the fix.

Doubled effects, messages that vanish, a consumer that dies or stalls: every
test here failed before the inbox became one pipeline (``outbox/inbox/``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from outbox import (
    CommitRefusedError,
    DiscardRefusedError,
    Disposition,
    Inbox,
    RetriableTransportError,
    RetryLater,
    create_engine,
)
from outbox.inbox._outage import is_handler_outage, is_missing_schema, is_outage
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
    inbox_bind,
    insert_effect,
    record,
    settle,
    settle_all,
)
from tests.test_inbox_runner import ScriptedSource, at
from transports import Record

_made: list[Inbox] = []
_kind = ["sync"]



@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """These proofs run on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url

@pytest.fixture(autouse=True, params=INBOX_KINDS)
def inbox_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs with a sync Inbox and with one on an AsyncEngine (async handlers)."""
    _kind[0] = request.param
    yield request.param
    while _made:
        dispose(_made.pop())


def make_inbox(engine: sa.Engine, **kwargs) -> Inbox:  # type: ignore[no-untyped-def]
    """An Inbox of this run's kind on ``engine``'s database; ``inbox.engine`` is the one it uses."""
    options = {"retry_backoff": 0.001, "retry_backoff_max": 0.01, "alert": AlertLog(),
               "batch_budget": TEST_BUDGET}
    box = Inbox(inbox_bind(engine, _kind[0]), group="holes", **{**options, **kwargs})
    _made.append(box)
    box.create_tables()
    business.create_all(engine)
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    return box


@contextmanager
def running(inbox: Inbox, source: ScriptedSource) -> Iterator[list[BaseException]]:
    """``inbox.run(source)`` on a thread; yields the list its exception lands in.

    On leaving, the test fails unless ``run`` returned after ``stop()`` without raising:
    an exception it raised at any point (even after the test's last wait) is re-raised here.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            inbox.run(source, install_signal_handlers=False)  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        inbox.stop()
        thread.join(30)
    assert not thread.is_alive(), "Inbox.run did not return within 30 s of stop()"
    if errors:
        raise AssertionError(f"Inbox.run raised {errors[0]!r}") from errors[0]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0,
             errors: list[BaseException] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if errors:
            raise AssertionError(f"Inbox.run ended while waiting for {what}") from errors[0]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# 1. Two copies of one unkeyed message in one batch ran the handler twice.

def test_two_copies_of_an_unkeyed_message_in_one_batch_apply_once(engine: sa.Engine) -> None:
    inbox = make_inbox(engine)
    sent = record(TOPIC, None, None)
    other = record(TOPIC, None, None)
    result = settle(inbox, [sent, other, sent])
    assert [disposition for _, disposition in result.done] == [
        Disposition.APPLIED, Disposition.APPLIED, Disposition.DUPLICATE]
    assert len(applied(engine)) == 2
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        assert sorted(conn.scalars(sa.select(m.c.deliveries))) == [1, 2]


def test_resent_unkeyed_messages_through_run_take_effect_once(engine: sa.Engine) -> None:
    inbox = make_inbox(engine, batch_size=50, concurrency=2)
    records, offset = [], 0
    for n in range(200):
        r = record(TOPIC, None, None)
        for _ in range(2 if n % 5 == 0 else 1):  # every fifth one twice, back to back
            copy = Record(r.topic, r.value, r.key, list(r.headers))
            records.append(at(copy, 0, offset))
            offset += 1
    source = ScriptedSource(records)
    with running(inbox, source) as errors:
        wait_for(lambda: any(c.get((TOPIC, 0)) == offset for c in source.commits), "all committed",
                 errors=errors)
    with engine.connect() as conn:
        effects = conn.execute(sa.text("SELECT message_id, count(*) FROM effects "
                                       "GROUP BY message_id HAVING count(*) > 1")).all()
    assert effects == [] and len(applied(engine)) == 200
    assert inbox.parked() == []  # (the unique effects row made the second run fail and park)


# 2. Discard of a message with earlier parked ones, then replay, lost the earlier ones.

def test_discard_refuses_to_skip_past_earlier_parked_messages(engine: sa.Engine) -> None:
    inbox = make_inbox(engine)
    broken = {1, 2}

    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.seq in broken:
            raise RuntimeError(f"broken {message.seq}")
        insert_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    for seq in (1, 2, 3):
        assert inbox.handle(record(TOPIC, "k", seq)) is Disposition.PARKED
    _, two, _ = inbox.parked(TOPIC, "k")
    with pytest.raises(DiscardRefusedError, match="1 earlier message"):
        inbox.discard(two.message_id, by="alice", reason="order 2 is bogus")
    assert [p.seq for p in inbox.parked(TOPIC, "k")] == [1, 2, 3]  # nothing changed

    broken.discard(1)
    result = inbox.replay(TOPIC, "k")  # 1 applies, 2 fails again and stops the replay
    assert (result.applied, result.remaining) == (1, 2)
    inbox.discard(two.message_id, by="alice", reason="order 2 is bogus")  # now the head: allowed
    assert inbox.replay(TOPIC, "k").unparked
    assert applied(engine, "k") == [("k", 1), ("k", 3)]
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        outcomes = dict(conn.execute(sa.select(m.c.seq, m.c.outcome)).all())
    assert outcomes == {1: "processed", 2: "discarded", 3: "processed"}  # each one accounted for


# 3. An outage under a handler counted as attempts and parked; a dead connection crashed the worker.

@pytest.mark.slow
def test_an_outage_inside_the_handler_is_not_an_attempt(engine: sa.Engine) -> None:
    inbox = make_inbox(engine)
    outage = DatabaseOutage(inbox.engine, only="INSERT INTO effects")
    outage.fail(times=5)  # more than max_attempts
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    assert outage.failures == 5
    assert inbox.parked() == [] and inbox.alert == []
    assert applied(engine) == [("a", 1)]


def test_a_refused_connection_is_an_outage_for_the_inbox_and_a_failure_for_a_handler(
    engine: sa.Engine
) -> None:
    """asyncpg raises the socket's ConnectionRefusedError when the database is down (waited out, see
    test_inbox_outage.py); the same error from a handler's own HTTP call is the handler's failure."""

    refused = ConnectionRefusedError(111, "Connect call failed")
    assert is_outage(refused) and not is_handler_outage(refused)
    inbox = make_inbox(engine)

    def handler(session, message):  # type: ignore[no-untyped-def]
        raise ConnectionRefusedError(111, "the payment API refused")

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.PARKED
    [parked] = inbox.parked()
    assert parked.attempts == 3 and "payment API" in parked.error


@pytest.mark.postgres
def test_a_connection_killed_under_the_handler_is_waited_out(postgres_db: str) -> None:
    engine = create_engine(postgres_db)
    try:
        inbox = make_inbox(engine, batch_size=4)
        killed: list[int] = []

        def handler(session, message):  # type: ignore[no-untyped-def]
            if message.key == "b" and len(killed) < 2:
                killed.append(1)
                session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))
            apply_effect(session, message)

        inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
        done = dict((d.message.key, disposition) for d, disposition in
                    settle_all(inbox, [record(TOPIC, key, 1) for key in "abc"]))
        assert done == {"a": Disposition.APPLIED, "b": Disposition.APPLIED, "c": Disposition.APPLIED}
        assert len(killed) == 2 and inbox.parked() == [] and inbox.alert == []
    finally:
        engine.dispose()


@pytest.mark.slow
def test_run_waits_out_a_database_outage_and_resumes(sqlite_db: str) -> None:
    engine = create_engine(sqlite_db)
    inbox = make_inbox(engine, gap_timeout=0.2, concurrency=2, batch_size=5)
    outage = DatabaseOutage(inbox.engine)
    first = [at(record(TOPIC, f"k{n}", 1), 0, n) for n in range(10)]
    source = ScriptedSource(first)
    with running(inbox, source) as errors:
        wait_for(lambda: len(applied(engine)) == 10, "the first records", errors=errors)
        outage.fail()  # workers, the gap sweeper, the parked-keys gauge: everything fails now
        source.pending.extend(at(record(TOPIC, f"k{n}", 2), 0, 10 + n) for n in range(10))
        time.sleep(1.5)  # several sweeps and commits, longer than gap_timeout
        assert not errors and outage.failures > 0
        outage.end()
        wait_for(lambda: len(applied(engine)) == 20, "the records sent during the outage",
                 errors=errors)
        wait_for(lambda: any(c.get((TOPIC, 0)) == 20 for c in source.commits), "the commit")
    assert not errors
    assert inbox.parked() == [] and inbox.alert == []


def test_a_retriable_commit_error_does_not_end_run(sqlite_db: str) -> None:
    engine = create_engine(sqlite_db)
    inbox = make_inbox(engine)

    class FlakyCommits(ScriptedSource):
        refusals = 3

        def commit(self, offsets) -> None:  # type: ignore[no-untyped-def]
            if self.refusals:
                self.refusals -= 1
                raise RetriableTransportError("coordinator not available")
            super().commit(offsets)

    source = FlakyCommits([at(record(TOPIC, "a", 1), 0, 0), at(record(TOPIC, "b", 1), 0, 1)])
    with running(inbox, source) as errors:
        wait_for(lambda: any(c.get((TOPIC, 0)) == 2 for c in source.commits), "the commit",
                 errors=errors)
    assert not errors and source.refusals == 0


# 4. An outage during a revoke abandoned the whole batch, kept partitions' records included.

def test_a_revoke_during_an_outage_keeps_the_other_partitions_records(sqlite_db: str) -> None:
    engine = create_engine(sqlite_db)
    inbox = make_inbox(engine, concurrency=1, batch_size=10)
    # The batch meets it (its first statement reads FROM inbox_keys); run()'s schema check,
    # which looks the inbox tables up by name, does not.
    outage = DatabaseOutage(inbox.engine, only="FROM inbox_")
    outage.fail()
    source = ScriptedSource([at(record(TOPIC, "gone", 1), 0, 0), at(record(TOPIC, "kept", 1), 1, 0)])
    with running(inbox, source) as errors:
        wait_for(lambda: outage.failures >= 2, "the batch to meet the outage", errors=errors)
        source.revoke = [(TOPIC, 0)]
        wait_for(lambda: source.revoke is None, "the revoke")
        time.sleep(0.3)
        outage.end()
        wait_for(lambda: applied(engine) == [("kept", 1)], "the kept partition's record", errors=errors)
        wait_for(lambda: any(c.get((TOPIC, 1)) == 1 for c in source.commits), "its commit")
    assert not errors
    assert all(c.get((TOPIC, 0), 0) == 0 for c in source.commits)  # the next owner redoes it
    assert inbox.parked() == []


# 5. A group that meets a key past seq 1 parked it as a gap; now it can start there.

def test_start_at_first_seen_applies_a_key_met_mid_stream_and_records_where(engine: sa.Engine) -> None:
    inbox = make_inbox(engine, start="first_seen")
    failed_once: list[int] = []

    def handler(session, message):  # type: ignore[no-untyped-def]
        if not failed_once:
            failed_once.append(message.seq)
            raise RuntimeError("the first attempt fails: the retry must start the key the same way")
        insert_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    assert inbox.handle(record(TOPIC, "late", 5)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "late", 7)) is Disposition.HELD  # later gaps are gaps
    assert inbox.handle(record(TOPIC, "late", 6)) is Disposition.APPLIED
    assert applied(engine, "late") == [("late", 5), ("late", 6), ("late", 7)]
    early = record(TOPIC, "late", 3)
    assert inbox.handle(early) is Disposition.PARKED  # below the start: kept, not dropped
    [parked] = inbox.parked()
    assert (parked.seq, parked.reason) == (3, "before_start")
    assert [a.kind for a in inbox.alert] == ["message_parked"]
    assert inbox.handle(record(TOPIC, "late", 8)) is Disposition.APPLIED  # the key is not stopped
    inbox.discard(parked.message_id, by="ops", reason="before this group started")
    assert inbox.handle(early) is Disposition.DUPLICATE  # discarded for good
    k = inbox.tables.inbox_keys
    with engine.connect() as conn:
        started = conn.execute(sa.select(k.c.key, k.c.started_at_seq, k.c.last_seq)).all()
    assert [tuple(r) for r in started] == [("late", 5, 8)]
    assert inbox.handle(record(TOPIC, "fresh", 1)) is Disposition.APPLIED
    with engine.connect() as conn:
        assert conn.scalar(sa.select(k.c.started_at_seq).where(k.c.key == "fresh")) is None


def test_strict_start_still_holds_a_key_met_mid_stream(engine: sa.Engine) -> None:
    inbox = make_inbox(engine)
    assert inbox.handle(record(TOPIC, "late", 5)) is Disposition.HELD


# 6. Stuck keys slept on worker threads: as many stuck keys as workers stalled everything,
#    and a hot stuck key's queue stopped the poll.

def test_keys_waiting_for_a_retry_do_not_hold_up_the_others(sqlite_db: str) -> None:
    engine = create_engine(sqlite_db)
    inbox = make_inbox(engine, concurrency=2, batch_size=1)
    waits: list[str] = []

    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.key.startswith("stuck"):
            waits.append(message.key)
            raise RetryLater(30, "downstream busy")
        apply_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    records = [record(TOPIC, "stuck-1", 1), record(TOPIC, "stuck-2", 1)]
    records += [record(TOPIC, "stuck-hot", seq) for seq in range(1, 1501)]  # a hot stuck key
    records += [record(TOPIC, f"k{n}", 1) for n in range(100)]
    source = ScriptedSource([at(r, 0, n) for n, r in enumerate(records)])
    with running(inbox, source) as errors:
        wait_for(lambda: len(applied(engine)) == 100, "the healthy keys", timeout=20, errors=errors)
    assert sorted(set(waits)) == ["stuck-1", "stuck-2", "stuck-hot"]
    assert inbox.parked() == []


# 7. A commit refused by a rebalance was recorded as committed, so it was never tried again.

def test_a_refused_commit_is_not_recorded_as_committed(sqlite_db: str) -> None:
    engine = create_engine(sqlite_db)
    inbox = make_inbox(engine)

    class RefusingSource(ScriptedSource):
        refused: list[dict[tuple[str, int], int]] = []

        def commit(self, offsets) -> None:  # type: ignore[no-untyped-def]
            if not self.refused and offsets.get((TOPIC, 0)) == 1:
                self.refused.append(dict(offsets))
                raise CommitRefusedError("rebalance in progress")
            super().commit(offsets)

    source = RefusingSource([at(record(TOPIC, "a", 1), 0, 0)])
    with running(inbox, source) as errors:
        wait_for(lambda: len(applied(engine)) == 1 and source.refused, "the refused commit",
                 errors=errors)
        wait_for(lambda: {(TOPIC, 0): 1} in source.commits, "the same position committed again")
    assert source.refused == [{(TOPIC, 0): 1}]


def test_kafka_source_reports_a_commit_refused_by_a_rebalance() -> None:
    from confluent_kafka import KafkaError, KafkaException

    from transports.kafka import KafkaSource

    class Refusing:
        def commit(self, **_: object) -> None:
            raise KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))

    # A port nothing listens on: the consumer is built (it connects lazily) but answers nothing.
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=[TOPIC])
    real, source._consumer = source._consumer, Refusing()  # type: ignore[assignment]
    try:
        with pytest.raises(CommitRefusedError, match="refused"):
            source.commit({(TOPIC, 0): 5})
    finally:
        source._consumer = real
        source.close()


def _wrapped(kind: type[sa.exc.DBAPIError], orig: BaseException) -> sa.exc.DBAPIError:
    return kind("SELECT 1", {}, orig)  # type: ignore[arg-type]


def _outage_cases() -> list:  # type: ignore[type-arg]
    import sqlite3

    import psycopg

    return [
        pytest.param(_wrapped(sa.exc.OperationalError, psycopg.OperationalError("server closed")), True,
                     id="connection lost"),
        pytest.param(_wrapped(sa.exc.OperationalError, psycopg.errors.AdminShutdown()), True,
                     id="server shutting down"),
        pytest.param(_wrapped(sa.exc.OperationalError, psycopg.errors.SerializationFailure()), True,
                     id="serialization failure"),
        pytest.param(_wrapped(sa.exc.OperationalError, psycopg.errors.LockNotAvailable()), True,
                     id="lock timeout"),
        pytest.param(_wrapped(sa.exc.OperationalError, psycopg.errors.QueryCanceled()), False,
                     id="statement timeout"),
        pytest.param(_wrapped(sa.exc.IntegrityError, psycopg.errors.UniqueViolation()), False,
                     id="unique violation"),
        pytest.param(_wrapped(sa.exc.ProgrammingError, psycopg.errors.UndefinedTable()), False,
                     id="undefined table"),
        pytest.param(_wrapped(sa.exc.OperationalError, sqlite3.OperationalError("database is locked")),
                     True, id="sqlite locked"),
        pytest.param(_wrapped(sa.exc.OperationalError, sqlite3.OperationalError("no such table: x")),
                     False, id="sqlite no such table"),
        pytest.param(sa.exc.PendingRollbackError("Can't reconnect until invalid transaction is rolled "
                                                 "back."), True, id="connection died in a transaction"),
        pytest.param(ValueError("a handler's own bug"), False, id="handler bug"),
    ]


@pytest.mark.parametrize(("error", "outage"), _outage_cases())
def test_what_counts_as_an_outage(error: BaseException, outage: bool) -> None:

    assert is_outage(error) is outage
    try:
        raise RuntimeError("wrapped by a handler") from error
    except RuntimeError as wrapped:
        assert is_outage(wrapped) is outage  # a handler that wraps an outage still reports one


def _missing_schema_cases() -> list[object]:
    import sqlite3

    import psycopg
    import pymysql

    return [
        pytest.param(_wrapped(sa.exc.ProgrammingError, psycopg.errors.UndefinedTable()), True,
                     id="undefined table"),
        pytest.param(_wrapped(sa.exc.ProgrammingError, psycopg.errors.UndefinedColumn()), True,
                     id="undefined column: tables not upgraded"),
        pytest.param(_wrapped(sa.exc.ProgrammingError, psycopg.errors.InvalidSchemaName()), True,
                     id="no such schema"),
        pytest.param(_wrapped(sa.exc.OperationalError, sqlite3.OperationalError("no such table: inbox_keys")),
                     True, id="sqlite no such table"),
        pytest.param(_wrapped(sa.exc.OperationalError, sqlite3.OperationalError("no such column: seq")),
                     True, id="sqlite no such column"),
        pytest.param(_wrapped(sa.exc.ProgrammingError,
                              pymysql.err.ProgrammingError(1146, "Table 'db.inbox_keys' doesn't exist")),
                     True, id="mysql no such table"),
        pytest.param(_wrapped(sa.exc.OperationalError,
                              pymysql.err.OperationalError(1054, "Unknown column 'event_type'")),
                     True, id="mysql unknown column"),
        pytest.param(_wrapped(sa.exc.IntegrityError, psycopg.errors.UniqueViolation()), False,
                     id="unique violation"),
        pytest.param(_wrapped(sa.exc.OperationalError, psycopg.errors.QueryCanceled()), False,
                     id="statement timeout"),
        pytest.param(_wrapped(sa.exc.OperationalError, sqlite3.OperationalError("database is locked")),
                     False, id="sqlite locked"),
        pytest.param(_wrapped(sa.exc.OperationalError, pymysql.err.OperationalError(1213, "Deadlock")),
                     False, id="mysql deadlock"),
        pytest.param(ValueError("no such table: a handler's own words"), False, id="not a database error"),
    ]


@pytest.mark.parametrize(("error", "missing"), _missing_schema_cases())
def test_what_says_the_tables_are_missing(error: BaseException, missing: bool) -> None:
    """A missing table is the setup's failure when the inbox's own statement meets it (the settle
    stage counts no attempt for it): only the statement's own error is read."""
    assert is_missing_schema(error) is missing
    try:
        raise RuntimeError("raised while handling it") from error
    except RuntimeError as wrapped:
        assert not is_missing_schema(wrapped)
