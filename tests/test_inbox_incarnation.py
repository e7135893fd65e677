"""A producer database has an identity (issue 23, item 2): a restarted producer is never silently dropped.

The producer's outbox database is rebuilt (a restore, a new server) and its keys
count from seq 1 again with new message ids. Before the incarnation, the inbox
took every one of them at or below the key's ``last_seq`` for a duplicate: not
applied, not parked, no alert, no count. Now only a recorded id is a duplicate;
another id is a producer restart (handled by the start policy) or a conflict
(parked with its key, one alert). Every test runs on SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY

from outbox import Disposition, Inbox
from tests.inbox_support import TEST_BUDGET, AlertLog, record, settle

TOPIC = "orders"
X, Y = str(uuid.uuid4()), str(uuid.uuid4())  # two incarnations of one producer database

effects = sa.Table(
    "incarnation_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("message_id", sa.Uuid, nullable=False, unique=True),
    sa.Column("key", sa.String(50)),
    sa.Column("seq", sa.Integer),
    sa.Column("incarnation", sa.String(36)),
)


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    return proof_db_url


@pytest.fixture
def make(engine: sa.Engine) -> Iterator:  # type: ignore[type-arg]
    group = f"g-{uuid.uuid4().hex[:8]}"
    effects.create(engine, checkfirst=True)

    def make_inbox(**kwargs) -> Inbox:  # type: ignore[no-untyped-def]
        inbox = Inbox(engine, group=group, retry_backoff=0, alert=AlertLog(),
                      **{"batch_budget": TEST_BUDGET, **kwargs})
        inbox.create_tables()

        @inbox.handler(TOPIC)
        def handle(session, message):  # type: ignore[no-untyped-def]
            session.execute(effects.insert().values(
                message_id=message.message_id, key=message.key, seq=message.seq,
                incarnation=message.incarnation))
        return inbox

    yield make_inbox
    with engine.begin() as conn:
        conn.execute(sa.delete(effects))


def applied(engine: sa.Engine) -> list[tuple[str | None, int, str | None]]:
    with engine.connect() as conn:
        return [(i if i is None else "XY"[[X, Y].index(i)], seq, key) for key, seq, i in conn.execute(
            sa.select(effects.c.key, effects.c.seq, effects.c.incarnation).order_by(effects.c.id))]


def key_row(inbox: Inbox, key: str) -> tuple:  # type: ignore[type-arg]
    k = inbox.tables.inbox_keys
    with inbox.engine.connect() as conn:  # type: ignore[union-attr]
        return tuple(conn.execute(sa.select(k.c.last_seq, k.c.started_at_seq, k.c.incarnation, k.c.parked)
                                  .where(k.c.consumer_group == inbox.group, k.c.key == key)).one())


def conflicts(inbox: Inbox, verdict: str) -> float:
    return REGISTRY.get_sample_value("outbox_inbox_seq_conflicts_total", {
        "group": inbox.group, "topic": TOPIC, "verdict": verdict}) or 0.0


def history(inbox: Inbox, incarnation: str | None, seqs: range, key: str = "k") -> list:  # type: ignore[type-arg]
    return [record(TOPIC, key, seq, incarnation=incarnation) for seq in seqs]


def test_a_rebuilt_producer_is_parked_under_strict_and_replay_applies_it(make, engine) -> None:  # type: ignore[no-untyped-def]
    """The issue's regression: seqs that restart with new ids were dropped as duplicates."""
    inbox = make()
    old = history(inbox, X, range(1, 4))
    assert [inbox.handle(r) for r in old] == [Disposition.APPLIED] * 3
    rebuilt = history(inbox, Y, range(1, 6))  # the restored database sends seq 1..5 again
    assert [inbox.handle(r) for r in rebuilt] == [Disposition.PARKED] * 5
    parked = inbox.parked()
    assert [(p.seq, p.reason) for p in parked] == [(1, "new_incarnation")] + [
        (seq, "key_parked") for seq in range(2, 6)]
    assert "the producer database was rebuilt" in (parked[0].error or "")
    assert [(a.kind, a.details["reason"]) for a in inbox.alert] == [("key_parked", "new_incarnation")]
    assert conflicts(inbox, "new_incarnation") == 1
    result = inbox.replay(TOPIC, "k")  # the operator's decision: apply the new incarnation
    assert (result.applied, result.unparked) == (5, True)
    assert applied(engine) == [("X", s, "k") for s in (1, 2, 3)] + [("Y", s, "k") for s in range(1, 6)]
    assert key_row(inbox, "k") == (5, 1, Y, False)
    assert inbox.handle(record(TOPIC, "k", 6, incarnation=Y)) is Disposition.APPLIED
    assert inbox.handle(old[1]) is Disposition.DUPLICATE  # a known id is still a duplicate


@pytest.mark.parametrize("one_batch", [False, True])
def test_first_seen_starts_the_key_again_at_the_new_incarnation(make, engine, one_batch) -> None:  # type: ignore[no-untyped-def]
    inbox = make(start="first_seen", batch_size=20)
    for r in history(inbox, X, range(1, 4)):
        assert inbox.handle(r) is Disposition.APPLIED
    rebuilt = history(inbox, Y, range(1, 6))  # in one batch: seqs 1-3 below the key, 4-5 above
    if one_batch:
        done = settle(inbox, rebuilt).done
        assert [disposition for _, disposition in done] == [Disposition.APPLIED] * 5
    else:
        assert [inbox.handle(r) for r in rebuilt] == [Disposition.APPLIED] * 5
    assert applied(engine) == [("X", s, "k") for s in (1, 2, 3)] + [("Y", s, "k") for s in range(1, 6)]
    assert key_row(inbox, "k") == (5, 1, Y, False)  # recorded like a first_seen start
    assert inbox.parked() == [] and list(inbox.alert) == []
    assert conflicts(inbox, "restart") == 1


def test_a_conflict_within_one_incarnation_parks_its_key_and_alerts_once(make, engine) -> None:  # type: ignore[no-untyped-def]
    inbox = make(start="first_seen")  # the policy only speaks for a new incarnation
    for r in history(inbox, X, range(1, 4)):
        inbox.handle(r)
    assert inbox.handle(record(TOPIC, "k", 2, incarnation=X)) is Disposition.PARKED
    assert inbox.handle(record(TOPIC, "k", 3, incarnation=X)) is Disposition.PARKED
    assert inbox.handle(record(TOPIC, "k", 4, incarnation=X)) is Disposition.PARKED
    assert [(p.seq, p.reason) for p in inbox.parked()] == [
        (2, "seq_conflict"), (3, "key_parked"), (4, "key_parked")]
    assert [(a.kind, a.details["reason"]) for a in inbox.alert] == [("key_parked", "seq_conflict")]
    assert conflicts(inbox, "seq_conflict") == 1 and conflicts(inbox, "key_parked") == 1
    assert applied(engine) == [("X", s, "k") for s in (1, 2, 3)]
    assert key_row(inbox, "k")[3] is True


def test_old_envelopes_without_the_header_keep_working_and_are_never_dropped(make, engine) -> None:  # type: ignore[no-untyped-def]
    inbox = make()
    old = history(inbox, None, range(1, 4))
    assert [inbox.handle(r) for r in old] == [Disposition.APPLIED] * 3
    assert inbox.handle(old[0]) is Disposition.DUPLICATE  # a redelivery, as before
    assert inbox.handle(record(TOPIC, "k", 5)) is Disposition.HELD  # gaps, as before
    assert key_row(inbox, "k") == (3, None, None, False)
    # Without an incarnation a restart cannot be told from a conflict: parked, not dropped.
    assert inbox.handle(record(TOPIC, "k", 1)) is Disposition.PARKED
    assert [(p.seq, p.reason) for p in inbox.parked(TOPIC, "k")] == [(1, "seq_conflict"), (5, "key_parked")]
    # A key first met by old envelopes, then a header-carrying producer: a restart is unprovable.
    for r in history(inbox, None, range(1, 3), key="m"):
        inbox.handle(r)
    assert inbox.handle(record(TOPIC, "m", 1, incarnation=Y)) is Disposition.PARKED
    assert inbox.parked(TOPIC, "m")[0].reason == "seq_conflict"


def test_an_upgraded_producer_continues_its_keys_and_records_its_incarnation(make) -> None:  # type: ignore[no-untyped-def]
    inbox = make()
    for r in history(inbox, None, range(1, 3)):
        inbox.handle(r)
    assert inbox.handle(record(TOPIC, "k", 3, incarnation=X)) is Disposition.APPLIED
    assert key_row(inbox, "k") == (3, None, X, False)
    assert inbox.handle(record(TOPIC, "k", 4)) is Disposition.APPLIED  # an old relay still running
    assert key_row(inbox, "k") == (4, None, X, False)  # keeps the incarnation it knows


def test_a_redelivery_older_than_the_dedup_window_is_counted_not_parked(make, engine) -> None:  # type: ignore[no-untyped-def]
    inbox = make(dedup_window=timedelta(hours=1))
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    old = [record(TOPIC, "k", seq, incarnation=X, created_at=long_ago) for seq in (1, 2, 3)]
    for r in old:
        inbox.handle(r)
    m = inbox.tables.inbox_messages
    with engine.begin() as conn:  # what `outbox spark archive --dedup-window 1h` deletes
        conn.execute(sa.delete(m).where(m.c.consumer_group == inbox.group))
    assert inbox.handle(old[1]) is Disposition.DUPLICATE
    assert conflicts(inbox, "expired") == 1 and inbox.parked() == []
    assert inbox.handle(record(TOPIC, "k", 2, incarnation=X)) is Disposition.PARKED  # a fresh one
    assert applied(engine) == [("X", s, "k") for s in (1, 2, 3)]


def test_a_restart_whose_first_message_keeps_failing_is_parked_not_dropped(make, engine) -> None:  # type: ignore[no-untyped-def]
    inbox = make(start="first_seen", max_attempts=2)
    for r in history(inbox, X, range(1, 4)):
        inbox.handle(r)

    def fail(session, message):  # type: ignore[no-untyped-def]
        raise RuntimeError("downstream refuses")

    inbox.handler(TOPIC, replace=True)(fail)
    assert inbox.handle(record(TOPIC, "k", 1, incarnation=Y)) is Disposition.PARKED
    [parked] = inbox.parked()
    assert (parked.seq, parked.reason) == (1, "failed")
    assert key_row(inbox, "k")[:3] == (3, None, X)  # the restart did not commit


@pytest.mark.parametrize("start", ["strict", "first_seen"])
@pytest.mark.parametrize("incarnation", [Y, X, None], ids=["rebuilt", "same", "unknown"])
def test_a_second_message_for_a_held_seq_is_parked_not_dropped(make, engine, start, incarnation) -> None:  # type: ignore[no-untyped-def]
    """The model test's find: a key holds one message per seq ahead of a gap, so another id at a
    held seq (a rebuilt producer's, or the same seq sent twice) was reported held and never stored."""
    inbox = make(start=start)
    assert inbox.handle(record(TOPIC, "k", 1, incarnation=X)) is Disposition.APPLIED
    waiting = record(TOPIC, "k", 3, incarnation=X)
    assert inbox.handle(waiting) is Disposition.HELD  # seq 2 is missing
    assert inbox.handle(waiting) is Disposition.HELD  # a redelivery of the held one changes nothing
    waiting_id = uuid.UUID(dict(waiting.headers)["outbox-message-id"].decode())
    reused = record(TOPIC, "k", 4, incarnation=X, message_id=waiting_id)  # one id, another seq
    assert inbox.handle(reused) is Disposition.HELD  # one id is one message: the held one
    second = record(TOPIC, "k", 3, incarnation=incarnation)
    assert inbox.handle(second) is Disposition.PARKED
    reason = "new_incarnation" if incarnation == Y else "seq_conflict"
    parked = inbox.parked(TOPIC, "k")
    second_id = uuid.UUID(dict(second.headers)["outbox-message-id"].decode())
    assert [(p.message_id, p.seq, p.reason) for p in parked] == [
        (second_id, 3, reason), (waiting_id, 3, "key_parked")]
    assert f"message {waiting_id}" in (parked[0].error or "")
    assert [(a.kind, a.details["reason"]) for a in inbox.alert] == [("key_parked", reason)]
    assert conflicts(inbox, reason) == 1
    assert key_row(inbox, "k")[3] is True
    assert applied(engine) == [("X", 1, "k")]


def held_ids(inbox: Inbox) -> set[uuid.UUID]:
    h = inbox.tables.inbox_held
    with inbox.engine.connect() as conn:  # type: ignore[union-attr]
        return set(conn.scalars(sa.select(h.c.message_id).where(h.c.consumer_group == inbox.group)))


def recorded_ids(inbox: Inbox) -> set[uuid.UUID]:
    m = inbox.tables.inbox_messages
    with inbox.engine.connect() as conn:  # type: ignore[union-attr]
        return set(conn.scalars(sa.select(m.c.message_id).where(m.c.consumer_group == inbox.group)))


def message_id(r) -> uuid.UUID:  # type: ignore[no-untyped-def]
    return uuid.UUID(dict(r.headers)["outbox-message-id"].decode())


def test_resends_from_before_a_restart_stay_duplicates_in_one_run(make, engine) -> None:  # type: ignore[no-untyped-def]
    """The model test's second find: after a key restarted below them, two recorded ids in one run
    of a batch: the first ended the run and the second's dedup record was deleted with the
    claims given back, so it was held, and applied again once the new incarnation reached it."""
    inbox = make(start="first_seen", batch_size=20)
    old = history(inbox, X, range(1, 5))
    for r in old:
        inbox.handle(r)
    assert inbox.handle(record(TOPIC, "k", 1, incarnation=Y)) is Disposition.APPLIED  # a restart
    done = settle(inbox, old[1:3]).done
    assert [disposition for _, disposition in done] == [Disposition.DUPLICATE] * 2
    assert {message_id(r) for r in old} <= recorded_ids(inbox) and held_ids(inbox) == set()
    for seq in (2, 3):
        assert inbox.handle(record(TOPIC, "k", seq, incarnation=Y)) is Disposition.APPLIED
    assert applied(engine) == [("X", s, "k") for s in (1, 2, 3, 4)] + [("Y", s, "k") for s in (1, 2, 3)]


def test_a_held_resend_from_before_a_restart_gives_way_to_the_new_incarnation(make, engine) -> None:  # type: ignore[no-untyped-def]
    inbox = make(start="first_seen")
    old = history(inbox, X, range(1, 6))
    for r in old:
        inbox.handle(r)
    assert inbox.handle(record(TOPIC, "k", 1, incarnation=Y)) is Disposition.APPLIED  # a restart
    assert inbox.handle(old[3]) is Disposition.HELD  # X's seq 4 again: ahead of the key, not looked up
    new4 = record(TOPIC, "k", 4, incarnation=Y)
    assert inbox.handle(new4) is Disposition.HELD  # the recorded resend gives way
    assert held_ids(inbox) == {message_id(new4)}
    assert inbox.handle(old[4]) is Disposition.HELD  # X's seq 5: no conflict with anything held
    new5 = record(TOPIC, "k", 5, incarnation=Y)
    assert inbox.handle(new5) is Disposition.HELD
    assert inbox.handle(old[3]) is Disposition.DUPLICATE  # the resend meets Y's held seq 4
    for seq in (2, 3):
        assert inbox.handle(record(TOPIC, "k", seq, incarnation=Y)) is Disposition.APPLIED
    assert applied(engine) == [("X", s, "k") for s in range(1, 6)] + [("Y", s, "k") for s in range(1, 6)]
    assert inbox.parked() == [] and held_ids(inbox) == set()
