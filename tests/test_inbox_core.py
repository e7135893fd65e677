"""The inbox's per-message state machine, through ``Inbox.handle``, on SQLite, PostgreSQL and MariaDB.

No broker here: records are built as the relay builds them and handed to the
middleware call, in the order a test wants them to arrive.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa

from outbox import Disposition, Inbox
from outbox.core._envelope import utcnow
from tests.inbox_support import (
    INBOX_KINDS,
    TEST_BUDGET,
    TOPIC,
    AlertLog,
    OrderViolation,
    applied,
    apply_effect,
    business,
    dispose,
    effects,
    for_inbox,
    inbox_bind,
    insert_effect,
    record,
)

GAP_TIMEOUT = 0.3
"""The inbox fixture's ``gap_timeout``, seconds."""


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """The inbox's core behaviour runs on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


@pytest.fixture(params=INBOX_KINDS)
def inbox(engine: sa.Engine, request: pytest.FixtureRequest) -> Iterator[Inbox]:
    """An Inbox on ``engine``, or on an AsyncEngine on the same database with async handlers."""
    # TEST_BUDGET: a test reads a record's whole transaction (the held messages applied behind it),
    # which a loaded host's 1 s default batch_budget may cut, leaving the rest to the next sweep().
    box = Inbox(inbox_bind(engine, request.param), group="billing", retry_backoff=0.001,
                retry_backoff_max=0.01, gap_timeout=GAP_TIMEOUT, alert=AlertLog(), batch_budget=TEST_BUDGET)
    box.create_tables()
    business.create_all(engine)
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    yield box
    dispose(box)


def test_applies_once_and_counts_redeliveries(inbox: Inbox, engine: sa.Engine) -> None:
    first = record(TOPIC, "a", 1)
    assert inbox.handle(first) is Disposition.APPLIED
    assert inbox.handle(first) is Disposition.DUPLICATE
    assert inbox.handle(first) is Disposition.DUPLICATE
    assert applied(engine) == [("a", 1)]
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        row = conn.execute(sa.select(m.c.deliveries, m.c.outcome, m.c.seq)).one()
    assert tuple(row) == (3, "processed", 1)


def test_same_seq_with_another_message_id_is_a_conflict(inbox: Inbox, engine: sa.Engine) -> None:
    """Issue 23: only a recorded id is a duplicate; another id at a used seq parks its key."""
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.PARKED
    assert applied(engine) == [("a", 1)]
    [parked] = inbox.parked()
    assert (parked.seq, parked.reason) == (1, "seq_conflict")


def test_unkeyed_messages_are_deduplicated_by_message_id(inbox: Inbox, engine: sa.Engine) -> None:
    one = record(TOPIC, None, None)
    assert inbox.handle(one) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, None, None)) is Disposition.APPLIED
    assert inbox.handle(one) is Disposition.DUPLICATE
    assert len(applied(engine)) == 2


def test_out_of_order_is_held_then_applied_in_seq_order(inbox: Inbox, engine: sa.Engine) -> None:
    assert inbox.handle(record(TOPIC, "a", 1)) is Disposition.APPLIED
    assert inbox.handle(record(TOPIC, "a", 4)) is Disposition.HELD
    assert inbox.handle(record(TOPIC, "a", 3)) is Disposition.HELD
    assert applied(engine) == [("a", 1)]
    assert inbox.handle(record(TOPIC, "a", 2)) is Disposition.APPLIED
    assert applied(engine) == [("a", 1), ("a", 2), ("a", 3), ("a", 4)]
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(inbox.tables.inbox_held)) == 0
    assert inbox.handle(record(TOPIC, "a", 5)) is Disposition.APPLIED


def test_a_gap_that_never_fills_parks_the_key_after_the_timeout(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's clock is the test's (``outbox.inbox._gaps.utcnow``, as in test_stuck_alerts):
    on a loaded host holding and sweeping took 0.47 s once (CI, async MySQL), past the timeout,
    and "not yet" had to accept a park; at a sweep pinned before the hold it is "not yet" again."""
    inbox.handle(record(TOPIC, "a", 1))
    held = record(TOPIC, "a", 3)
    sweep_at = {"now": utcnow()}  # before seq 3 arrives: no gap is older than this
    monkeypatch.setattr("outbox.inbox._gaps.utcnow", lambda: sweep_at["now"])
    assert inbox.handle(held) is Disposition.HELD
    inbox.sweep()
    assert inbox.parked() == [] and inbox.alert == []  # not yet: neither parked nor warned
    sweep_at["now"] = utcnow() + timedelta(seconds=GAP_TIMEOUT + 0.1)  # held past the timeout
    inbox.sweep()
    inbox.sweep()
    [parked] = inbox.parked()
    assert (parked.key, parked.seq, parked.reason) == ("a", 3, "gap")
    assert "seq 2 did not arrive" in parked.error
    warned, alert = inbox.alert  # held past gap_alert_after (half the timeout), then parked
    assert (warned.kind, warned.key, warned.details["seq"]) == ("gap_held", "a", 3)
    assert (alert.kind, alert.key, alert.details["reason"]) == ("key_parked", "a", "gap")
    assert inbox.handle(record(TOPIC, "a", 4)) is Disposition.PARKED
    assert [p.seq for p in inbox.parked()] == [3, 4]


def test_poison_parks_its_key_only_and_alerts_once(inbox: Inbox, engine: sa.Engine) -> None:
    calls: list[int] = []

    def flaky(session, message):  # type: ignore[no-untyped-def]
        if message.key == "K":
            calls.append(message.seq)
            if message.seq == 5:
                raise ValueError("cannot bill order K#5")
        apply_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, flaky))
    for seq in range(1, 11):
        for key in ("K", "x", "y"):
            expected = Disposition.PARKED if key == "K" and seq >= 5 else Disposition.APPLIED
            assert inbox.handle(record(TOPIC, key, seq)) is expected
    assert calls == [1, 2, 3, 4, 5, 5, 5]  # exactly 3 attempts, later messages never handled
    assert [s for _, s in applied(engine, "x")] == list(range(1, 11))
    assert [s for _, s in applied(engine, "K")] == [1, 2, 3, 4]
    parked = inbox.parked(TOPIC, "K")
    assert [p.seq for p in parked] == list(range(5, 11))
    assert (parked[0].reason, parked[0].attempts) == ("failed", 3)
    assert "ValueError: cannot bill order K#5" in parked[0].error
    assert "Traceback" in inbox_parked_traceback(engine, inbox, parked[0].message_id)
    assert {p.reason for p in parked[1:]} == {"key_parked"}
    [alert] = inbox.alert
    assert (alert.kind, alert.topic, alert.key, alert.group) == ("key_parked", TOPIC, "K", "billing")
    assert alert.message_id == str(parked[0].message_id)
    assert "cannot bill order K#5" in alert.error

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, apply_effect))  # the fix is deployed
    result = inbox.replay(TOPIC, "K")
    assert (result.applied, result.remaining, result.unparked) == (6, 0, True)
    assert [s for _, s in applied(engine, "K")] == list(range(1, 11))
    assert inbox.parked() == []
    assert inbox.handle(record(TOPIC, "K", 11)) is Disposition.APPLIED
    assert len(inbox.alert) == 1


def inbox_parked_traceback(engine: sa.Engine, inbox: Inbox, message_id: uuid.UUID) -> str:
    p = inbox.tables.inbox_parked
    with engine.connect() as conn:
        return conn.scalar(sa.select(p.c.traceback).where(p.c.message_id == message_id))


def test_replay_stops_at_the_first_failure_which_stays_parked(inbox: Inbox, engine: sa.Engine) -> None:
    broken = {3, 5}

    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.seq in broken:
            raise RuntimeError(f"broken {message.seq}")
        apply_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    for seq in range(1, 7):
        inbox.handle(record(TOPIC, "k", seq))
    broken.discard(3)
    result = inbox.replay(TOPIC, "k")
    assert (result.applied, result.remaining, result.unparked) == (2, 2, False)
    assert "broken 5" in result.error
    parked = inbox.parked(TOPIC, "k")
    # seq 5 was parked behind 3 without running; its one replay attempt is recorded.
    assert [(p.seq, p.attempts) for p in parked] == [(5, 1), (6, 0)]
    assert "broken 5" in parked[0].error
    assert [s for _, s in applied(engine, "k")] == [1, 2, 3, 4]
    assert inbox.handle(record(TOPIC, "k", 7)) is Disposition.PARKED


def test_discard_skips_one_message_with_a_record_and_the_key_continues(
    inbox: Inbox, engine: sa.Engine
) -> None:
    def handler(session, message):  # type: ignore[no-untyped-def]
        if message.seq == 2:
            raise RuntimeError("poison")
        insert_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    records = [record(TOPIC, "k", seq) for seq in range(1, 5)]
    for r in records:
        inbox.handle(r)
    poison = inbox.parked(TOPIC, "k")[0]
    with pytest.raises(ValueError, match="who"):
        inbox.discard(poison.message_id, by="", reason="x")
    inbox.discard(poison.message_id, by="alice", reason="order 2 was cancelled by hand")
    assert inbox.replay(TOPIC, "k").unparked
    assert [s for _, s in applied(engine, "k")] == [1, 3, 4]
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        outcome, note = conn.execute(sa.select(m.c.outcome, m.c.note).where(
            m.c.message_id == poison.message_id)).one()
    assert outcome == "discarded"
    assert note.startswith("discarded by alice at ") and note.endswith("order 2 was cancelled by hand")
    assert inbox.handle(records[1]) is Disposition.DUPLICATE
    assert inbox.handle(record(TOPIC, "k", 5)) is Disposition.APPLIED


def test_discarding_the_only_parked_message_unparks_the_key(inbox: Inbox, engine: sa.Engine) -> None:
    def handler(session, message):  # type: ignore[no-untyped-def]
        raise RuntimeError("down")

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    inbox.handle(record(TOPIC, "k", 1))
    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, insert_effect))
    inbox.discard(inbox.parked()[0].message_id, by="bob", reason="test data")
    assert inbox.parked() == []
    assert inbox.handle(record(TOPIC, "k", 2)) is Disposition.APPLIED


def test_order_check_in_the_test_handler_can_fail(inbox: Inbox, engine: sa.Engine) -> None:
    """The crash test relies on apply_effect noticing a wrong order; prove it does."""
    with engine.begin() as conn, sa.orm.Session(bind=conn) as session, \
            pytest.raises(OrderViolation):
        apply_effect(session, _message("z", 2))


def _message(key: str, seq: int):  # type: ignore[no-untyped-def]
    from outbox import Message

    now = utcnow()
    return Message(message_id=uuid.uuid4(), topic=TOPIC, key=key, seq=seq, payload=b"{}",
                   created_at=now, available_at=now)


def test_effects_row_is_unique_per_key_and_seq(inbox: Inbox, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(effects.insert().values(topic=TOPIC, key="a", seq=1, message_id=uuid.uuid4()))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(effects.insert().values(topic=TOPIC, key="a", seq=1, message_id=uuid.uuid4()))


def test_a_failed_unkeyed_message_parks_alone_and_replays(inbox: Inbox, engine: sa.Engine) -> None:
    broken = [True]

    def handler(session, message):  # type: ignore[no-untyped-def]
        if broken[0] and message.payload == b'{"n":2}':
            raise RuntimeError("unkeyed poison")
        apply_effect(session, message)

    inbox.handler(TOPIC, replace=True)(for_inbox(inbox, handler))
    assert inbox.handle(record(TOPIC, None, None, payload=b'{"n":2}')) is Disposition.PARKED
    assert inbox.handle(record(TOPIC, None, None)) is Disposition.APPLIED  # nothing else blocked
    [alert] = inbox.alert
    assert (alert.kind, alert.key) == ("message_parked", None)
    assert inbox.replay(TOPIC, None).remaining == 1  # still broken: stays parked
    broken[0] = False
    result = inbox.replay(TOPIC, None)
    assert (result.applied, result.remaining, result.unparked) == (1, 0, True)
    assert len(applied(engine)) == 2 and inbox.parked() == []
