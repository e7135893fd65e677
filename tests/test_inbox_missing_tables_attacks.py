"""Attacks on 'the inbox's own tables missing count no attempt': a handler's missing table must still
count as the handler's failure and park the key after max_attempts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import Disposition, Inbox
from tests.inbox_support import (
    INBOX_KINDS,
    TEST_BUDGET,
    TOPIC,
    AlertLog,
    apply_effect,
    business,
    dispose,
    for_inbox,
    inbox_bind,
    record,
)


class _Base(DeclarativeBase):
    pass


class NeverMade(_Base):
    """A handler's own model whose table nobody created."""
    __tablename__ = "attack_never_made"
    id: Mapped[int] = mapped_column(primary_key=True)


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    return proof_db_url


@pytest.fixture(params=INBOX_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def inbox(engine: sa.Engine, kind: str) -> Iterator[Inbox]:
    box = Inbox(inbox_bind(engine, kind), group="g", retry_backoff=0.001, retry_backoff_max=0.01,
                alert=AlertLog(), batch_budget=TEST_BUDGET)
    box.create_tables()
    business.create_all(engine)
    box.handler(TOPIC)(for_inbox(box, apply_effect))
    yield box
    dispose(box)


def _settle_or_raise(inbox: Inbox, n: int = 6) -> list[object]:
    """Deliver the record again each time handle raises (as its caller would), at most n times."""
    outcomes: list[object] = []
    for _ in range(n):
        try:
            outcomes.append(inbox.handle(record("other", "a", 1)))
            break
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


def test_a_handlers_pending_orm_object_on_a_missing_table_parks(inbox: Inbox) -> None:
    """The handler only session.add()s: the INSERT on ITS missing table runs at the inbox's flush /
    autoflush / commit, i.e. as a statement 'of the inbox's transaction'. It is still the handler's
    failure: it must count attempts and park after 3, not be raised forever as a setup failure."""
    def handler(session, message):  # type: ignore[no-untyped-def]
        session.add(NeverMade(id=1))

    inbox.handler("other")(for_inbox(inbox, handler))
    outcomes = _settle_or_raise(inbox)
    assert outcomes[-1] is Disposition.PARKED, outcomes
    [parked] = inbox.parked()
    assert parked.attempts == 3


def test_a_handler_that_swallows_its_missing_table_error_parks(inbox: Inbox) -> None:
    """The handler catches its own UndefinedTable and returns; on PostgreSQL the transaction stays
    failed, so the inbox's next statement fails. Not the inbox's tables: must not loop forever."""
    def handler(session, message):  # type: ignore[no-untyped-def]
        with contextlib.suppress(sa.exc.DBAPIError):
            session.execute(sa.text("SELECT * FROM attack_no_such_table"))

    inbox.handler("other")(for_inbox(inbox, handler))
    outcomes = _settle_or_raise(inbox)
    assert outcomes[-1] in (Disposition.PARKED, Disposition.APPLIED), outcomes


def test_a_handlers_deferred_trigger_meeting_a_missing_table_at_commit_parks(
        inbox: Inbox, engine: sa.Engine) -> None:
    """PostgreSQL: the handler's INSERT fires a DEFERRED constraint trigger that reads a table that is
    not there. The 42P01 comes at the inbox's COMMIT, yet it is the handler's write's failure (the
    module doc itself says a deferred constraint failing at COMMIT belongs to one message)."""
    if engine.dialect.name != "postgresql":
        pytest.skip("deferred constraint triggers are PostgreSQL's")
    with engine.begin() as c:
        c.execute(sa.text("DROP TABLE IF EXISTS attack_trig"))
        c.execute(sa.text("CREATE TABLE attack_trig (id int)"))
        c.execute(sa.text(
            "CREATE OR REPLACE FUNCTION attack_trig_f() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM 1 FROM attack_trig_missing; RETURN NULL; END $$"))
        c.execute(sa.text(
            "CREATE CONSTRAINT TRIGGER attack_trig_t AFTER INSERT ON attack_trig "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION attack_trig_f()"))

    def handler(session, message):  # type: ignore[no-untyped-def]
        session.execute(sa.text("INSERT INTO attack_trig VALUES (1)"))

    inbox.handler("other")(for_inbox(inbox, handler))
    try:
        outcomes = _settle_or_raise(inbox)
        assert outcomes[-1] is Disposition.PARKED, outcomes
    finally:
        with engine.begin() as c:
            c.execute(sa.text("DROP TABLE IF EXISTS attack_trig"))
