"""An operator's replay takes a key's parked messages a batch per transaction, with replay's rules intact.

``Inbox.replay`` used to commit once per parked message (295 msg/s on
PostgreSQL for a 200,000-message key). It now takes ``replay_batch`` rows per
transaction; these tests count the commits and check that batching changes
nothing else: order, the stop at the first failure (with what came before it
committed), the stop at a hole, the restart of a conflict, the unpark.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from outbox import Disposition, Inbox, Message, OutboxTables
from outbox.inbox import Reason
from outbox.inbox._delivery import OrderedDelivery, decode, delivery
from outbox.inbox.storage import ParkedRow, ParkedTable, postgres_storage
from outbox.testing import OutboxTestHarness
from tests.inbox_support import AlertLog, applied, apply_effect, business, dispose, insert_effect, record

TOPIC = "orders"


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    return proof_db_url


@pytest.fixture
def inbox(engine: sa.Engine) -> Iterator[Inbox]:
    box = Inbox(engine, group="billing", retry_backoff=0.001, retry_backoff_max=0.01,
                gap_timeout=60, alert=AlertLog())
    box.create_tables()
    business.create_all(engine)
    yield box
    dispose(box)


def commits(engine: sa.Engine) -> list[None]:
    """A list that grows by one at each commit on ``engine``."""
    seen: list[None] = []
    sa.event.listen(engine, "commit", lambda conn: seen.append(None))
    return seen


def park_flood(inbox: Inbox, key: str, count: int) -> None:
    """Park ``key`` at seq 1 (its handler fails), then park seqs 2..count behind it in one transaction."""
    inbox.handle(record(TOPIC, key, 1))
    OutboxTestHarness(inbox=inbox).settle([record(TOPIC, key, seq) for seq in range(2, count + 1)])


def test_a_replay_of_1000_messages_commits_once_per_batch_in_seq_order(
        inbox: Inbox, engine: sa.Engine) -> None:
    broken = True

    def handler(session, message):  # type: ignore[no-untyped-def]
        if broken and message.seq == 1:
            raise RuntimeError("not yet")
        apply_effect(session, message)  # raises OrderViolation out of order

    inbox.handler(TOPIC)(handler)
    park_flood(inbox, "k", 1000)
    assert len(inbox.parked(TOPIC, "k")) == 1000
    broken = False
    inbox.admin.replay_batch = 250
    committed = commits(engine)
    result = inbox.replay(TOPIC, "k")
    assert (result.applied, result.remaining, result.unparked, result.error) == (1000, 0, True, None)
    assert len(committed) <= math.ceil(1000 / 250)
    assert applied(engine, "k") == [("k", seq) for seq in range(1, 1001)]
    assert inbox.handle(record(TOPIC, "k", 1001)) is Disposition.APPLIED  # unparked, at seq 1000


def test_a_failure_inside_a_batch_stops_there_with_the_messages_before_it_committed(
        inbox: Inbox, engine: sa.Engine) -> None:
    broken = {1, 634}
    calls: list[int] = []

    def handler(session, message):  # type: ignore[no-untyped-def]
        calls.append(message.seq)
        if message.seq in broken:
            raise RuntimeError(f"broken {message.seq}")
        apply_effect(session, message)

    inbox.handler(TOPIC)(handler)
    park_flood(inbox, "k", 1000)
    broken.discard(1)
    inbox.admin.replay_batch = 250
    committed = commits(engine)
    calls.clear()
    result = inbox.replay(TOPIC, "k")
    assert (result.applied, result.remaining, result.unparked) == (633, 367, False)
    assert "broken 634" in (result.error or "")
    assert len(committed) <= 3  # two full batches, then the one that stops at 634
    assert calls.count(634) == 1  # the bare run's failure is reused, not run a second time
    assert applied(engine, "k") == [("k", seq) for seq in range(1, 634)]
    parked = inbox.parked(TOPIC, "k")
    assert [(p.seq, p.attempts) for p in parked[:2]] == [(634, 1), (635, 0)]
    assert inbox.handle(record(TOPIC, "k", 1001)) is Disposition.PARKED  # still parked behind it


# -- batching changes nothing: a batched replay ends as the per-message one does ---------------

_rows = st.lists(
    st.tuples(
        st.integers(1, 8),  # seq: runs, holes, two rows of one seq, rows at or below the key's
        st.sampled_from([Reason.FAILED, Reason.KEY_PARKED, Reason.SEQ_CONFLICT,
                         Reason.NEW_INCARNATION]),
        st.sampled_from([False, False, False, True]),  # its id is recorded already
        st.sampled_from([False, False, False, True]),  # its handler fails on replay
    ),
    min_size=1, max_size=10,
)


def _outcome(url: str, last_seq: int, rows: list[tuple[int, Reason, bool, bool]],
             batch: int) -> tuple[object, ...]:
    """Park ``rows`` behind a key at ``last_seq`` on a fresh database, replay in ``batch``es; what it left."""
    engine = sa.create_engine(url, poolclass=sa.pool.StaticPool,
                              connect_args={"check_same_thread": False})
    box = Inbox(engine, group="g", alert=AlertLog())
    box.create_tables()
    business.create_all(engine)
    failing = {uuid.UUID(int=n + 1) for n, row in enumerate(rows) if row[3]}

    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.message_id in failing:
            raise RuntimeError(f"broken {message.message_id}")
        insert_effect(session, message)

    box.handler(TOPIC)(handler)
    storage = box.storage
    with box._sessions() as session, session.begin():
        storage.keys.lock(session, [(TOPIC, "k")])
        storage.keys.advance(session, {(TOPIC, "k"): last_seq})
        for n, (seq, reason, recorded, _) in enumerate(rows):
            d = decode(record(TOPIC, "k", seq, message_id=uuid.UUID(int=n + 1)))
            storage.park(session, d, reason)
            if recorded:
                storage.dedup.claim(session, [d])
    box.admin.replay_batch = batch
    result = box.replay(TOPIC, "k")
    with engine.connect() as conn:
        k = box.tables.inbox_keys
        key = conn.execute(sa.select(k.c.last_seq, k.c.parked, k.c.started_at_seq)).one()
    left = [(p.message_id, p.attempts, p.error is not None) for p in box.parked(TOPIC, "k")]
    effects = [(s, mid) for (_, s), mid in zip(applied(engine), _effect_ids(engine), strict=True)]
    dispose(box)
    engine.dispose()
    return result, tuple(key), left, effects


def _effect_ids(engine: sa.Engine) -> list[uuid.UUID]:
    from tests.inbox_support import effects
    with engine.connect() as conn:
        return [uuid.UUID(str(m)) for m in conn.scalars(
            sa.select(effects.c.message_id).order_by(effects.c.id))]


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite:///:memory:"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(last_seq=st.integers(0, 3), rows=_rows, batch=st.integers(2, 5))
def test_a_batched_replay_ends_exactly_as_the_per_message_replay(
        db_url: str, last_seq: int, rows: list[tuple[int, Reason, bool, bool]], batch: int) -> None:
    rows = sorted(rows, key=lambda r: r[0])  # parked rows are replayed in seq order (then id)
    assert _outcome(db_url, last_seq, rows, batch) == _outcome(db_url, last_seq, rows, 1)


# -- a parked key's flood is parked in one statement ---------------------------------------------

def test_a_parked_keys_flood_is_parked_in_one_statement_in_order_and_replays(
        inbox: Inbox, engine: sa.Engine) -> None:
    broken = True

    def handler(session, message):  # type: ignore[no-untyped-def]
        if broken and (message.key, message.seq) == ("k", 1):
            raise RuntimeError("not yet")
        apply_effect(session, message)

    inbox.handler(TOPIC)(handler)
    inbox.handle(record(TOPIC, "k", 1))
    parking: list[str] = []

    def statement(conn, cursor, sql, params, context, executemany):  # type: ignore[no-untyped-def]
        if sql.lstrip().upper().startswith("INSERT") and "inbox_parked" in sql:
            parking.append(sql)

    sa.event.listen(engine, "before_cursor_execute", statement)
    flood = [record(TOPIC, "k", seq) for seq in range(2, 302)]
    other = record(TOPIC, "other", 1)
    resent = flood[5]  # a copy of one arriving again in the same batch: parked once
    committed = OutboxTestHarness(inbox=inbox).settle([*flood[:150], other, resent, *flood[150:]])
    sa.event.remove(engine, "before_cursor_execute", statement)
    assert len(parking) == 1
    assert sum(1 for _, disposition in committed.done if disposition is Disposition.PARKED) == 300
    assert [p.seq for p in inbox.parked(TOPIC, "k")] == list(range(1, 302))
    assert applied(engine, "other") == [("other", 1)]
    OutboxTestHarness(inbox=inbox).settle(flood[:10])  # delivered again: already parked, nothing changes
    assert len(inbox.parked(TOPIC, "k")) == 301
    broken = False
    assert inbox.replay(TOPIC, "k").unparked
    assert applied(engine, "k") == [("k", seq) for seq in range(1, 302)]


# -- a replay's page reads about a batch of rows, whatever the key holds -----------------------

_page_rows = st.lists(
    st.tuples(
        st.sampled_from(["k", "k", "k", "other"]),
        st.one_of(st.none(), st.integers(1, 6)),  # ties, and keyed messages without a seq
        st.sampled_from([Reason.FAILED, Reason.KEY_PARKED, Reason.KEY_PARKED, Reason.FOREIGN]),
    ),
    max_size=14,
)


@pytest.fixture
def page_inbox(proof_db_url: str) -> Iterator[Inbox]:
    engine = sa.create_engine(proof_db_url)
    box = Inbox(engine, group="g", alert=AlertLog())
    box.create_tables()
    yield box
    dispose(box)
    engine.dispose()


def replay_order(rows: list[ParkedRow]) -> list[int]:
    """The ids of a key's parked ``rows`` (as ``rows()`` lists them) in the order replay takes them.

    Seq order (then id). On a key whose rows have seqs and rows have none (ours and another
    producer's), arrival (id) order, each seq'd place taken by the seq'd rows in seq order.
    """
    numbered = [r for r in rows if r.delivery.message.seq is not None]
    if not numbered or len(numbered) == len(rows):
        return [r.id for r in rows]
    in_seq = iter(sorted(numbered, key=lambda r: (r.delivery.message.seq, r.id)))
    return [next(in_seq).id if r.delivery.message.seq is not None else r.id
            for r in sorted(rows, key=lambda r: r.id)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_page_rows, limit=st.integers(1, 16))
def test_a_replay_page_is_the_first_replayable_rows_in_replay_order(
        page_inbox: Inbox, rows: list[tuple[str, int | None, Reason]], limit: int) -> None:
    storage = page_inbox.storage
    with page_inbox._sessions() as session, session.begin():
        session.execute(page_inbox.tables.inbox_parked.delete())
        for key, seq, reason in rows:
            storage.park(session, decode(record(TOPIC, key, seq)), reason)
    with page_inbox._sessions() as session, session.begin():
        everything = replay_order(storage.parked.rows(session, TOPIC, "k", replayable=True))
        assert [r.id for r in storage.parked.replay_page(session, TOPIC, "k", limit)] == everything[:limit]


def test_a_replay_page_on_postgresql_fetches_about_a_page_of_a_long_key(postgres_db: str) -> None:
    """The (seq, id) order is not the index's there: a page used to fetch and sort every parked row."""
    engine = sa.create_engine(postgres_db)
    box = Inbox(engine, group="g", alert=AlertLog())
    box.create_tables()
    storage = box.storage
    with box._sessions() as session, session.begin():
        storage.keys.lock(session, [(TOPIC, "k")])
        storage.park(session, decode(record(TOPIC, "k", 1)), Reason.FAILED)
        flood = [decode(record(TOPIC, "k", seq)) for seq in range(2, 3001)]
        storage.park_behind(session, [d for d in flood if isinstance(d, OrderedDelivery)])
    p = box.tables.inbox_parked
    fetched = sa.text("SELECT (coalesce(sum(idx_tup_fetch), 0) + coalesce(sum(seq_tup_read), 0))::bigint "
                      "FROM pg_stat_xact_user_tables WHERE relname = :t")
    with box._sessions() as session, session.begin():
        before = session.scalar(fetched, {"t": p.name})
        page = box.storage.parked.replay_page(session, TOPIC, "k", 50)
        read = session.scalar(fetched, {"t": p.name}) - before
    assert [r.delivery.message.seq for r in page] == list(range(1, 51))
    assert read <= 3 * 50, f"a page of 50 fetched {read} of the key's 3,000 rows"
    dispose(box)
    engine.dispose()


_text = st.text(st.characters(codec="utf-8", blacklist_characters="\x00"), max_size=8)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(st.tuples(st.binary(max_size=40), st.dictionaries(_text, _text, max_size=3),
                                   st.one_of(st.none(), _text), st.one_of(st.none(), _text),
                                   _text.filter(bool)), min_size=1, max_size=5))
def test_a_parked_keys_flood_is_stored_on_postgresql_as_one_insert_per_message_stores_it(
        postgres_engine: sa.Engine,
        messages: list[tuple[bytes, dict[str, str], str | None, str | None, str]]) -> None:
    """PostgreSQL parks a flood with one array per column; each row must be what an INSERT stores."""
    tables = OutboxTables()
    arrays, one_by_one = postgres_storage(tables, "arrays"), postgres_storage(tables, "each")
    now = datetime.now(UTC)
    flood = [delivery(Message.model_construct(
        message_id=uuid.uuid4(), topic=TOPIC, key="k", seq=n + 2, payload=payload, content_type=ctype,
        headers=headers, created_at=now, available_at=now, incarnation=incarnation, event_type=event),
        n % 3, n * 7)
        for n, (payload, headers, incarnation, event, ctype) in enumerate(messages)]
    ordered = [d for d in flood if isinstance(d, OrderedDelivery)]
    with Session(postgres_engine) as session, session.begin():
        session.execute(tables.inbox_parked.delete())
        arrays.park_behind(session, ordered)
        ParkedTable.add_behind(one_by_one.parked, session, ordered)  # the executemany of SQLite, MySQL
        arrays.park_behind(session, ordered)  # again: parked already, left as it is
    p = tables.inbox_parked
    kept = [c for c in p.c if c.name not in ("id", "consumer_group", "first_failure_at", "last_failure_at")]
    with postgres_engine.connect() as conn:
        rows = {g: conn.execute(sa.select(*kept).where(p.c.consumer_group == g).order_by(p.c.seq)).all()
                for g in ("arrays", "each")}
    assert rows["arrays"] == rows["each"] and len(rows["arrays"]) == len(messages)


@pytest.fixture
def postgres_engine(postgres_db: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(postgres_db)
    OutboxTables().metadata.create_all(engine)
    yield engine
    engine.dispose()
