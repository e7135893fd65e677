"""Foreign and undecodable records, handler signals, batches with savepoints, bad configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox import (
    ConfigurationError,
    Disposition,
    Inbox,
    LoggingAlertSink,
    Message,
    ParkMessage,
    RetryLater,
    SkipMessage,
    create_engine,
)
from tests.inbox_support import (
    INBOX_KINDS,
    TEST_BUDGET,
    TOPIC,
    AlertLog,
    applied,
    apply_effect,
    business,
    dispose,
    for_inbox,
    handles,
    inbox_bind,
    insert_effect,
    insert_effects,
    record,
    settle,
    settle_all,
)
from transports import Record


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """These proofs run on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url

@pytest.fixture(params=INBOX_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Each test runs with a sync Inbox and with one on an AsyncEngine (async handlers)."""
    return str(request.param)


@contextmanager
def inbox_on(engine: sa.Engine, kind: str) -> Iterator[Inbox]:
    """An inbox of ``kind`` on ``engine``, its tables made, ``apply_effect`` handling ``TOPIC``."""
    # TEST_BUDGET: a test reads a whole transaction's outcome (a held successor applied behind its
    # predecessor), which a loaded host's 1 s default batch_budget may cut.
    box = Inbox(inbox_bind(engine, kind), group="g", retry_backoff=0.001, retry_backoff_max=0.01,
                alert=AlertLog(), batch_budget=TEST_BUDGET)
    box.create_tables()
    business.create_all(engine)
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    try:
        yield box
    finally:
        dispose(box)


@pytest.fixture
def inbox(engine: sa.Engine, kind: str) -> Iterator[Inbox]:
    with inbox_on(engine, kind) as box:
        yield box


def test_a_foreign_record_parks_with_its_reason_and_the_next_one_is_handled(
    inbox: Inbox, engine: sa.Engine
) -> None:
    foreign = Record(topic=TOPIC, value=b"hello from a legacy producer", key=b"a", partition=2, offset=7)
    assert inbox.handle(foreign) is Disposition.PARKED
    assert inbox.handle(foreign) is Disposition.PARKED  # redelivered: still one row
    [parked] = inbox.parked()
    assert (parked.reason, parked.key, parked.partition, parked.offset) == ("foreign", "a", 2, 7)
    assert "outbox-message-id" in parked.error
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED  # the key is not blocked
    assert [a.kind for a in inbox.alert] == ["foreign_record"]
    inbox.handle(Record(topic=TOPIC, value=b"again", partition=2, offset=8))
    assert len(inbox.alert) == 1  # one alert per topic, not one per record


def test_a_broken_envelope_parks_as_foreign(inbox: Inbox) -> None:
    broken = record(TOPIC, "a", 1)
    broken.headers = [(n, b"not-a-uuid" if n == "outbox-message-id" else v) for n, v in broken.headers]
    assert inbox.handle(broken) is Disposition.PARKED
    assert "broken outbox envelope" in inbox.parked()[0].error


def with_header(r: Record, name: str, value: bytes) -> Record:
    r.headers = [(n, value if n == name else v) for n, v in r.headers]
    return r


def with_key(r: Record, key: bytes) -> Record:
    r.key = key
    return r


# Values publish() refuses; stored as they are they would fail the inbox's own INSERT
# on PostgreSQL on every redelivery, so they must park as foreign instead.
UNSTORABLE = {
    "key with NUL": with_key(record(TOPIC, "a", 1), b"bad\x00key"),
    "key over 255": with_key(record(TOPIC, "a", 1), b"k" * 300),
    "seq zero": with_header(record(TOPIC, "a", 1), "outbox-seq", b"0"),
    "seq over bigint": with_header(record(TOPIC, "a", 1), "outbox-seq", str(2**63).encode()),
    "content type over 100": with_header(record(TOPIC, "a", 1), "content-type", b"x/" + b"y" * 120),
    "content type with NUL": with_header(record(TOPIC, "a", 1), "content-type", b"text/plain\x00"),
    "naive timestamp": with_header(record(TOPIC, "a", 1), "outbox-created-at", b"2026-01-01T00:00:00"),
}


@pytest.mark.parametrize("name", UNSTORABLE)
def test_an_envelope_with_unstorable_values_parks_as_foreign(inbox: Inbox, name: str) -> None:
    assert inbox.handle(UNSTORABLE[name]) is Disposition.PARKED
    [parked] = inbox.parked()
    assert parked.reason == "foreign" and "broken outbox envelope" in (parked.error or "")
    assert inbox.handle(record(TOPIC, "b", 1)) is Disposition.APPLIED  # the consumer goes on


def test_bad_json_parks_the_message_and_its_key(inbox: Inbox, engine: sa.Engine) -> None:
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "a", 2, payload=b"{not json")) is Disposition.PARKED
    assert inbox.handle(record(TOPIC, "a", 3)) is Disposition.PARKED
    assert inbox.handle(record(TOPIC, "b", 1)) is Disposition.APPLIED
    parked = inbox.parked()
    assert [(p.seq, p.reason) for p in parked] == [(2, "undecodable"), (3, "key_parked")]
    assert "not valid JSON" in parked[0].error
    [alert] = inbox.alert
    assert (alert.kind, alert.key) == ("key_parked", "a")


def test_a_record_met_before_the_inbox_tables_exist_counts_no_attempt_and_parks_nothing(
        engine: sa.Engine, kind: str) -> None:
    """No inbox tables yet: ``handle`` raises at once, for its caller to deliver the record again
    (the FastStream subscriber seeks back). The setup failed, not the handler (it never ran): no
    attempt counts, nothing parks. Counted, the park after the last attempt could find the tables
    an operator made just after that attempt failed, and park the key for good (a FastStream test
    on a loaded host did). Here the failed statements are counted: one, not three attempts and
    the park's."""
    box = Inbox(inbox_bind(engine, kind), group="g", retry_backoff=0.001, retry_backoff_max=0.01,
                alert=AlertLog())
    business.create_all(engine)
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    failed: list[str] = []  # every statement of the inbox's that failed (SQLAlchemy's public event)
    bound = getattr(box.engine, "sync_engine", box.engine)
    sa.event.listen(bound, "handle_error", lambda context: failed.append(str(context.original_exception)))
    try:
        with pytest.raises(sa.exc.DBAPIError):
            box.handle(record(TOPIC, "a", 1))
        # Raised at once: not tried again as a handler's failure (three attempts and a park that
        # failed too, before the fix).
        assert len(failed) == 1, failed
        box.create_tables()
        assert box.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED  # delivered again
        assert box.handle(record(TOPIC, "a", 2)) is Disposition.APPLIED
        assert box.parked() == [] and list(box.alert) == []
        assert applied(engine) == [("a", 1), ("a", 2)]
    finally:
        dispose(box)


def test_a_fresh_inbox_on_tables_made_elsewhere_applies_its_first_record_with_no_failed_statement(
        engine: sa.Engine, kind: str) -> None:
    """A consumer deployed on tables made before (``outbox inbox create-tables``): its first
    statement is the key lock's. On MariaDB an async engine learns whose server it is only at its
    first connection, and the lock named the keys' collation before connecting: MySQL 8's
    (``utf8mb4_0900_bin``, unknown to MariaDB, error 1273), a failure counted as an attempt."""
    with inbox_on(engine, kind):
        pass  # the tables made, by another inbox
    box = Inbox(inbox_bind(engine, kind), group="g", alert=AlertLog())
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    failed: list[str] = []
    bound = getattr(box.engine, "sync_engine", box.engine)
    sa.event.listen(bound, "handle_error", lambda context: failed.append(str(context.original_exception)))
    try:
        assert box.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
        assert failed == []
        assert applied(engine) == [("a", 1)]
    finally:
        dispose(box)


def test_a_handler_meeting_a_missing_table_of_its_own_fails_and_parks_as_any_failure(inbox: Inbox) -> None:
    """Only the inbox's own tables missing counts no attempt; a handler's missing table is its failure."""
    def handler(session, message):  # type: ignore[no-untyped-def]
        session.execute(sa.text("SELECT * FROM no_such_business_table"))

    inbox.handler("other")(for_inbox(inbox, handler))
    assert inbox.handle(record("other", "a", 1)) is Disposition.PARKED
    [parked] = inbox.parked()
    assert (parked.reason, parked.attempts) == ("failed", 3)
    assert [a.kind for a in inbox.alert] == ["key_parked"]


class _Unmade(DeclarativeBase):
    pass


class NeverMade(_Unmade):
    """A handler's own model whose table nobody made."""
    __tablename__ = "never_made"
    id: Mapped[int] = mapped_column(primary_key=True)


def delivered_until_settled(box: Inbox, times: int = 6) -> list[object]:
    """Deliver one record again each time ``handle`` raises, as its caller would, ``times`` at most:
    the dispositions and the names of what was raised."""
    outcomes: list[object] = []
    for _ in range(times):
        try:
            outcomes.append(box.handle(record("other", "a", 1)))
            break
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


def test_a_handlers_model_on_a_missing_table_fails_at_the_flush_and_parks(inbox: Inbox) -> None:
    """The handler only adds an object: the INSERT on its missing table runs at the flush, within
    the inbox's transaction, yet it is the handler's failure: three attempts, then parked."""
    def handler(session: Session, message: Message) -> None:
        session.add(NeverMade(id=1))

    inbox.handler("other")(for_inbox(inbox, handler))
    assert delivered_until_settled(inbox)[-1] is Disposition.PARKED
    [parked] = inbox.parked()
    assert parked.attempts == 3


def test_a_handler_that_swallows_its_missing_table_error_does_not_loop(inbox: Inbox) -> None:
    """The handler catches its own missing table's error; on PostgreSQL its transaction stays failed
    and the inbox's next statement fails for it. Not the inbox's tables: it settles, never raises."""
    def handler(session: Session, message: Message) -> None:
        with suppress(sa.exc.DBAPIError):
            session.execute(sa.text("SELECT * FROM no_such_business_table"))

    inbox.handler("other")(for_inbox(inbox, handler))
    assert delivered_until_settled(inbox)[-1] in (Disposition.PARKED, Disposition.APPLIED)


@pytest.mark.postgres
def test_a_deferred_trigger_meeting_a_missing_table_at_commit_is_the_handlers_and_parks(
        postgres_db: str, kind: str) -> None:
    """The handler's INSERT fires a deferred constraint trigger that reads a missing table: the
    error comes at the inbox's COMMIT, which names no statement, so it is the handler's write's
    failure and parks (taken for the inbox's tables, the record came again for ever)."""
    engine = create_engine(postgres_db)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE triggered (id int)")
        conn.exec_driver_sql("CREATE FUNCTION reads_nothing() RETURNS trigger LANGUAGE plpgsql AS "
                             "$$ BEGIN PERFORM 1 FROM no_such_table; RETURN NULL; END $$")
        conn.exec_driver_sql("CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON triggered "
                             "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION reads_nothing()")

    def handler(session: Session, message: Message) -> None:
        session.execute(sa.text("INSERT INTO triggered VALUES (1)"))

    try:
        with inbox_on(engine, kind) as box:
            box.handler("other")(for_inbox(box, handler))
            assert delivered_until_settled(box)[-1] is Disposition.PARKED
            [parked] = box.parked()
            assert parked.attempts == 3
    finally:
        engine.dispose()


def test_accept_policy_handles_foreign_records_as_unkeyed(engine: sa.Engine) -> None:
    box = Inbox(engine, group="g", foreign_records="accept")
    box.create_tables()
    seen = []
    box.handler(TOPIC)(lambda session, message: seen.append(message))
    foreign = Record(topic=TOPIC, value=b"raw", key=b"legacy-key", partition=0, offset=3)
    assert box.handle(foreign) is Disposition.APPLIED
    assert box.handle(foreign) is Disposition.DUPLICATE  # same broker position, same derived id
    assert (seen[0].key, seen[0].seq, seen[0].payload) == (None, None, b"raw")
    assert seen[0].content_type == "application/octet-stream"


def test_retry_later_does_not_count_as_an_attempt(inbox: Inbox, engine: sa.Engine) -> None:
    calls = []

    def busy_then_ok(session, message):  # type: ignore[no-untyped-def]
        calls.append(message.seq)
        if len(calls) <= 4:
            raise RetryLater(0.001, "downstream busy")
        apply_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, busy_then_ok))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED  # 4 > max_attempts, no park
    assert len(calls) == 5


def test_skip_message_records_the_skip_and_moves_the_key_on(inbox: Inbox, engine: sa.Engine) -> None:
    def skip_first(session, message):  # type: ignore[no-untyped-def]
        insert_effect(session, message)
        if message.seq == 1:
            raise SkipMessage("order already cancelled")

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, skip_first))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.SKIPPED
    assert inbox.handle(record(TOPIC, "a", 2)) is Disposition.APPLIED
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        rows = conn.execute(sa.select(m.c.seq, m.c.outcome, m.c.note).order_by(m.c.seq)).all()
    assert [tuple(r) for r in rows] == [(1, "skipped", "order already cancelled"), (2, "processed", None)]
    assert applied(engine) == [("a", 2)]  # the skipped message's own write was rolled back


def test_park_message_parks_at_once(inbox: Inbox) -> None:
    calls = []

    def invalid(session, message):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise ParkMessage("amount must be positive")

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, invalid))
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.PARKED
    assert len(calls) == 1
    assert inbox.parked()[0].error == "ParkMessage: amount must be positive"


def test_a_batch_commits_the_others_when_one_handler_fails(inbox: Inbox, engine: sa.Engine) -> None:
    calls: list[str] = []

    def handler(session, message):  # type: ignore[no-untyped-def]
        calls.append(message.key)
        apply_effect(session, message)
        if message.key == "bad":
            raise RuntimeError("after writing: the savepoint must undo this write")

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    result = settle(inbox, [record(TOPIC, key, 1) for key in ("a", "bad", "c")])
    assert sorted(d.message.key for d, disposition in result.done
                  if disposition is Disposition.APPLIED) == ["a", "c"]
    assert [(d.message.key, d.attempts.count) for d, _ in result.later] == [("bad", 1)]
    assert sorted(applied(engine)) == [("a", 1), ("c", 1)]
    # Redone with savepoints after the failure; the failed handler is not run a second time.
    assert calls == ["a", "bad", "a", "c"]
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        assert sorted(conn.scalars(sa.select(m.c.key))) == ["a", "c"]  # no dedup row for "bad"


def test_a_lone_message_tries_first_without_a_savepoint_and_retries_in_one(inbox: Inbox,
                                                                          engine: sa.Engine) -> None:
    """A SAVEPOINT costs two round trips of a one-message transaction's seven: a lone first try goes
    bare, as a batch does; its failure is redone without running the handler again. A lone retry,
    likely to fail again, goes straight to its SAVEPOINT."""
    calls: list[int] = []

    def fails_once(session, message):  # type: ignore[no-untyped-def]
        calls.append(message.seq)
        apply_effect(session, message)
        if message.seq == 2 and calls.count(2) == 1:
            raise RuntimeError("once")

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, fails_once))
    savepoints: list[str] = []

    def statement(conn, cursor, text, *rest):  # type: ignore[no-untyped-def]
        if text.lstrip().upper().startswith("SAVEPOINT"):
            savepoints.append(text)

    sa.event.listen(sa.Engine, "before_cursor_execute", statement)
    try:
        assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
        assert savepoints == []
        first = settle(inbox, [record(TOPIC, "a", 2)])
        [(failed, _)] = first.later
        assert failed.attempts.count == 1 and calls == [1, 2] and savepoints == []
        retried = settle(inbox, [failed])
        assert [disposition for _, disposition in retried.done] == [Disposition.APPLIED]
        assert calls == [1, 2, 2] and len(savepoints) == 1
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", statement)
    assert applied(engine) == [("a", 1), ("a", 2)]


MakeInbox = Callable[..., Inbox]


@pytest.fixture
def batch_inbox(engine: sa.Engine, kind: str) -> Iterator[MakeInbox]:
    """``make(calls, bad=None)``: an inbox whose batch handler logs each call's keys and fails
    any call that holds ``bad``; sync or async as ``kind`` says."""
    made: list[Inbox] = []

    def make(calls: list[list[str | None]], *, bad: str | None = None) -> Inbox:
        box = Inbox(inbox_bind(engine, kind), group="b", retry_backoff=0.001, retry_backoff_max=0.01,
                    alert=AlertLog(), batch_budget=TEST_BUDGET)  # as ``inbox_on``: a whole redo read
        made.append(box)
        box.create_tables()
        business.create_all(engine)
        handles(box, TOPIC, batch=True)(logged_batch(calls, bad))
        return box

    yield make
    for box in made:
        dispose(box)


def logged_batch(calls: list[list[str | None]], bad: str | None):  # type: ignore[no-untyped-def]
    def handle(session, messages):  # type: ignore[no-untyped-def]
        calls.append([m.key for m in messages])
        insert_effects(session, messages)
        if any(m.key == bad for m in messages):
            raise RuntimeError("after writing: the rollback must undo this call's writes")

    return handle


def deliveries(*keys: str) -> list[Record]:
    return [record(TOPIC, key, 1) for key in keys]


def test_a_batch_handler_gets_the_batch_in_one_call(engine: sa.Engine, batch_inbox: MakeInbox) -> None:
    calls: list[list[str | None]] = []
    box = batch_inbox(calls)
    result = settle(box, deliveries("a", "b", "c"))
    assert calls == [["a", "b", "c"]]
    assert [disposition for _, disposition in result.done] == [Disposition.APPLIED] * 3
    assert sorted(applied(engine)) == [("a", 1), ("b", 1), ("c", 1)]


def test_a_failed_batch_call_is_redone_one_message_per_call(
    engine: sa.Engine, batch_inbox: MakeInbox
) -> None:
    calls: list[list[str | None]] = []
    box = batch_inbox(calls, bad="bad")
    result = settle(box, deliveries("a", "bad", "c"))
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    assert [(d.message.key, d.attempts.count) for d, _ in result.later] == [("bad", 1)]
    assert sorted(applied(engine)) == [("a", 1), ("c", 1)]


def test_a_batch_handler_poison_parks_after_exactly_max_attempts(
    engine: sa.Engine, batch_inbox: MakeInbox
) -> None:
    calls: list[list[str | None]] = []
    box = batch_inbox(calls, bad="bad")
    done = dict((d.message.key, disposition) for d, disposition in
                settle_all(box, deliveries("a", "bad", "c")))
    assert done == {"a": Disposition.APPLIED, "bad": Disposition.PARKED, "c": Disposition.APPLIED}
    # The failed three-message call counts for no one; the three calls of "bad" alone do.
    assert calls.count(["bad"]) == 3
    [parked] = box.parked(TOPIC, "bad")
    assert parked.attempts == 3 and "RuntimeError" in (parked.error or "")
    assert [(a.kind, a.key) for a in box.alert] == [("key_parked", "bad")]


def test_a_batch_handler_must_take_session_and_messages(engine: sa.Engine) -> None:
    box = Inbox(engine, group="b")
    with pytest.raises(ConfigurationError, match=r"\(session, messages\)"):
        box.batch_handler(TOPIC)(lambda messages: None)
    box.batch_handler(TOPIC)(insert_effects)
    with pytest.raises(ConfigurationError, match="already has a handler"):
        box.handler(TOPIC)(insert_effect)


def test_a_held_successor_is_applied_in_the_same_batch(inbox: Inbox, engine: sa.Engine) -> None:
    assert inbox.handle(record(TOPIC, "a", 2)) is Disposition.HELD
    assert inbox.handle(record(TOPIC, "a", 3)) is Disposition.HELD
    result = settle(inbox, [record(TOPIC, "a", 1), record(TOPIC, "b", 1)])
    assert [(d.message.key, d.message.seq) for d, _ in result.done] == [
        ("a", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert applied(engine, "a") == [("a", 1), ("a", 2), ("a", 3)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"group": ""}, "group"),
    ({"group": "g", "max_attempts": 0}, "max_attempts"),
    ({"group": "g", "concurrency": 0}, "concurrency"),
    ({"group": "g", "batch_size": True}, "batch_size"),
    ({"group": "g", "gap_timeout": 0}, "gap_timeout"),
    ({"group": "g", "retry_backoff": -1}, "retry_backoff"),
    ({"group": "g", "foreign_records": "drop"}, "foreign_records"),
    ({"group": "g", "alert": "pager"}, "alert"),
    ({"group": "g", "prefix": "bad-prefix"}, "prefix"),
])
def test_bad_configuration_is_rejected_at_construction(sqlite_db: str, kwargs, message) -> None:  # type: ignore[no-untyped-def]
    from outbox import create_engine

    with pytest.raises(ConfigurationError, match=message):
        Inbox(create_engine(sqlite_db), **kwargs)


def test_bad_binds_and_handlers_are_rejected(sqlite_db: str) -> None:
    from outbox import create_async_engine, create_engine

    with pytest.raises(ConfigurationError, match="AsyncEngine, or a sessionmaker or async_sessionmaker"):
        Inbox(create_async_engine("sqlite+aiosqlite:///:memory:").sync_engine.url, group="g")
    asynchronous = Inbox(create_async_engine("sqlite+aiosqlite:///:memory:"), group="g")
    with pytest.raises(ConfigurationError, match="must be an async def function"):
        asynchronous.handler(TOPIC)(lambda session, message: None)

    async def handle(session, message):  # type: ignore[no-untyped-def]
        pass

    box = Inbox(create_engine(sqlite_db), group="g", alert=LoggingAlertSink())
    with pytest.raises(ConfigurationError, match="must be a plain function: an async def handler needs"):
        box.handler(TOPIC)(handle)
    with pytest.raises(ConfigurationError, match="session, message"):
        box.handler(TOPIC)(lambda message: None)
    box.handler(TOPIC)(lambda session, message: None)
    with pytest.raises(ConfigurationError, match="already has a handler"):
        box.handler(TOPIC)(lambda session, message: None)
    with pytest.raises(ValueError, match="topic"):
        box.handler("no spaces allowed")


@pytest.mark.postgres
def test_a_commit_rejected_for_one_message_fails_only_that_message(postgres_db: str) -> None:
    """A deferred constraint broken by one handler fails the whole batch at COMMIT, not in the
    handler: the batch is split to find that message, which retries and parks; the others commit."""
    engine = create_engine(postgres_db)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE codes (code text UNIQUE DEFERRABLE INITIALLY DEFERRED)")
            conn.exec_driver_sql("INSERT INTO codes VALUES ('taken')")
        box = Inbox(engine, group="g", retry_backoff=0.001, retry_backoff_max=0.01, alert=AlertLog())
        box.create_tables()

        @box.batch_handler(TOPIC)
        def handle(session, messages):  # type: ignore[no-untyped-def]
            session.execute(sa.text("INSERT INTO codes VALUES (:code)"),
                            [{"code": "taken" if m.key == "bad" else m.key} for m in messages])

        done = {d.message.key: disposition for d, disposition in
                settle_all(box, deliveries("a", "bad", "c"))}
        assert done == {"a": Disposition.APPLIED, "bad": Disposition.PARKED, "c": Disposition.APPLIED}
        [parked] = box.parked(TOPIC, "bad")
        assert parked.attempts == 3 and "UniqueViolation" in (parked.error or "")
        with engine.connect() as conn:
            assert sorted(conn.scalars(sa.text("SELECT code FROM codes"))) == ["a", "c", "taken"]
    finally:
        engine.dispose()
