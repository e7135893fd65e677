"""Issue 29's producer interface: the event type stored with the row (upgraded in on every
database), sent as ``outbox-event-type`` and counted in the record size, decoded into
``Message.event_type``; old envelopes decode with None."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pydantic
import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, drain
from typer.testing import CliRunner

import outbox
from outbox import (
    ForeignRecordError,
    Inbox,
    InvalidEventTypeError,
    Outbox,
    RecordTooLargeError,
    Relay,
    SchemaError,
    create_engine,
    record_to_message,
)
from outbox.cli import app
from outbox.core._schema import SCHEMA_VERSION
from outbox.core._wire import EVENT_TYPE, record_size, to_record
from tests.inbox_support import record

T = "orders"
BEFORE_EVENT_TYPE = 4  # the schema version the event type's upgrade step starts from


class OrderPaid(pydantic.BaseModel):
    order_id: str
    amount: int


@outbox.event("shop.OrderShipped", version=3)
class OrderShipped(pydantic.BaseModel):
    order_id: str


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


def test_the_relay_sends_each_rows_event_type_and_none_for_an_untyped_row(sqlite_db: str) -> None:
    ob = Outbox(create_engine(sqlite_db))
    ob.create_tables()
    with ob.begin() as session:
        ob.publish(session, T, OrderPaid(order_id="1", amount=5), key="1")
        ob.publish(session, T, OrderShipped(order_id="1"), key="1")
        ob.publish(session, T, b"\x00raw", key="1", event_type="legacy.Raw")
        ob.publish(session, T, {"n": 1}, key="1")
    relay = Relay(ob, ScriptedTransport(), worker_id="w")
    drain(relay)
    sent = [record_to_message(r) for r in relay.transport.sent]
    assert [m.event_type for m in sent] == ["OrderPaid", "shop.OrderShipped.v3", "legacy.Raw", None]
    assert OrderPaid.model_validate_json(sent[0].payload) == OrderPaid(order_id="1", amount=5)
    assert sent[0].content_type == "application/json"
    assert [name for name, _ in relay.transport.sent[3].headers].count(EVENT_TYPE) == 0


def test_an_envelope_round_trips_its_event_type_and_a_broken_one_is_foreign() -> None:
    now = datetime.now(UTC)
    fields = {"message_id": uuid.uuid4(), "topic": T, "key": "k", "seq": 1, "payload": b"{}",
              "content_type": "application/json", "headers": {"h": "v"}, "created_at": now}
    assert record_to_message(to_record(**fields, event_type="Größe.v2")).event_type == "Größe.v2"
    assert record_to_message(to_record(**fields)).event_type is None  # an older producer's
    for bad in (b"", b"a\nb", b"x" * 256, b"\xff"):
        broken = to_record(**fields)
        broken.headers.append((EVENT_TYPE, bad))  # type: ignore[union-attr]
        with pytest.raises(ForeignRecordError, match="broken outbox envelope"):
            record_to_message(broken)


@pytest.mark.parametrize("bad", ["", "a\x00b", "tab\there", "x" * 256, "\ud800", 7,
                                 # noncharacters: CloudEvents refuses them in ce_type
                                 "Order\ufffe", "\ufdd0Paid", "x\U0010ffff", "\U0001fffe"])
def test_publish_refuses_an_event_type_that_no_consumer_could_read_back(sqlite_db: str, bad: object) -> None:
    ob = Outbox(create_engine(sqlite_db))
    ob.create_tables()
    with ob.begin() as session, pytest.raises(InvalidEventTypeError, match="event_type"):
        ob.publish(session, T, {"n": 1}, event_type=bad)  # type: ignore[arg-type]


def test_a_model_published_under_another_type_name_is_refused(sqlite_db: str) -> None:
    ob = Outbox(create_engine(sqlite_db))
    ob.create_tables()
    with ob.begin() as session:
        with pytest.raises(InvalidEventTypeError, match="contradicts the registered type"):
            ob.publish(session, T, OrderPaid(order_id="1", amount=1), event_type="Other")
        ob.publish(session, T, OrderPaid(order_id="1", amount=1), event_type="OrderPaid")


def test_the_event_type_header_counts_toward_the_record_limit(sqlite_db: str) -> None:
    """A payload that fits exactly without a type is refused with one: the header is counted."""
    ob = Outbox(create_engine(sqlite_db), max_record_bytes=4096)
    ob.create_tables()
    event_type = "t" * 200
    with ob.begin() as session:
        fits = next(n for n in range(4096, 0, -1) if _fits(ob, session, b"x" * n, None))
        with pytest.raises(RecordTooLargeError):
            ob.publish(session, T, b"x" * fits, key="k", event_type=event_type)
        smaller = next(n for n in range(fits, 0, -1) if _fits(ob, session, b"x" * n, event_type))
        session.rollback()
    with ob.begin() as session:
        ob.publish(session, T, b"x" * smaller, key="k", event_type=event_type)
    relay = Relay(ob, ScriptedTransport(), worker_id="w")
    drain(relay)
    [sent] = relay.transport.sent
    assert record_size(sent) <= 4096


def _fits(ob: Outbox, session: sa.orm.Session, payload: bytes, event_type: str | None) -> bool:
    """Whether ``publish()`` takes ``payload``: published in a savepoint, then rolled back."""
    savepoint = session.begin_nested()
    try:
        ob.publish(session, T, payload, key="k", event_type=event_type)
    except RecordTooLargeError:
        return False
    finally:
        savepoint.rollback()
    return True


# -- the schema step ----------------------------------------------------------------------

@pytest.fixture
def db_url(proof_db_url: str) -> str:
    return proof_db_url


def previous_version(url: str) -> None:
    """A database as the release before typed events left it, with a pending row and a held one."""
    engine = create_engine(url)
    inbox = Inbox(engine, group="g")
    inbox.create_tables()
    inbox.handler(T)(lambda session, message: None)
    inbox.handle(record(T, "k", 1))
    inbox.handle(record(T, "k", 3))  # held
    ob = Outbox(engine)
    with ob.begin() as session:
        ob.publish(session, T, {"n": 1}, key="p")
    t = inbox.tables
    with engine.begin() as conn:
        for table in (t.messages, t.inbox_held, t.inbox_parked):
            conn.execute(sa.text(f"ALTER TABLE {table.name} DROP COLUMN event_type"))
        conn.execute(sa.update(t.meta).where(t.meta.c.name == "schema_version")
                     .values(value=str(BEFORE_EVENT_TYPE)))
    engine.dispose()


def test_the_previous_version_upgrades_to_event_types_and_keeps_its_rows(db_url: str) -> None:
    previous_version(db_url)
    with pytest.raises(SchemaError, match="init-db --upgrade"):
        Outbox(create_engine(db_url)).load_schema()
    out = cli("init-db", "--db", db_url, "--upgrade")
    assert f"upgraded schema version {BEFORE_EVENT_TYPE} to {SCHEMA_VERSION}" in out
    cli("init-db", "--db", db_url, "--upgrade")  # idempotent
    engine = create_engine(db_url)
    ob = Outbox(engine)
    with ob.begin() as session:
        ob.publish(session, T, OrderPaid(order_id="2", amount=1), key="p")
    relay = Relay(ob, ScriptedTransport(), worker_id="w")
    drain(relay)
    assert [record_to_message(r).event_type for r in relay.transport.sent] == [None, "OrderPaid"]
    inbox = Inbox(engine, group="g")
    seen: list[int | None] = []
    inbox.handler(T)(lambda session, message: seen.append(message.seq))
    inbox.handle(record(T, "k", 2))  # the held seq 3, stored before the upgrade, follows
    assert seen == [2, 3]
    engine.dispose()


def test_an_async_outbox_stores_a_models_type_and_an_explicit_one(sqlite_db: str) -> None:
    import asyncio

    from outbox import AsyncOutbox, create_async_engine

    async def publish() -> None:
        engine = create_async_engine(sqlite_db.replace("sqlite://", "sqlite+aiosqlite://"))
        ob = AsyncOutbox(engine)
        await ob.create_tables()
        async with ob.begin() as session:
            await ob.publish(session, T, OrderShipped(order_id="1"), key="1")
            await ob.publish(session, T, b"raw", key="1", event_type="legacy.Raw")
            with pytest.raises(InvalidEventTypeError):
                await ob.publish(session, T, OrderShipped(order_id="1"), event_type="x")
        await engine.dispose()

    asyncio.run(publish())
    engine = create_engine(sqlite_db)
    with engine.connect() as conn:
        m = Outbox(engine).tables.messages
        assert list(conn.scalars(sa.select(m.c.event_type).order_by(m.c.id))) == [
            "shop.OrderShipped.v3", "legacy.Raw"]
    engine.dispose()
