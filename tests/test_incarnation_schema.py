"""The producer side of issue 23's incarnation: minted by init-db, upgraded in, renewed after a
restore, carried in every envelope the relay sends; old envelopes decode as before."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, drain
from typer.testing import CliRunner

from outbox import ForeignRecordError, Inbox, Outbox, Relay, SchemaError, create_engine, record_to_message
from outbox.cli import app
from outbox.core._schema import SCHEMA_VERSION
from outbox.core._wire import INCARNATION, to_record
from tests.inbox_support import record

T = "orders"
BEFORE_INCARNATION = 3  # the schema version the incarnation's upgrade step starts from


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    return proof_db_url


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


def stored_incarnation(url: str) -> str:
    return Outbox(create_engine(url)).load_schema().incarnation


def test_init_db_mints_an_incarnation_and_new_incarnation_replaces_it(db_url: str) -> None:
    cli("init-db", "--db", db_url)
    first = stored_incarnation(db_url)
    assert str(uuid.UUID(first)) == first
    cli("init-db", "--db", db_url)  # a second init-db keeps the identity
    assert stored_incarnation(db_url) == first
    out = cli("init-db", "--db", db_url, "--new-incarnation")
    second = stored_incarnation(db_url)
    assert second != first and first in out and second in out


def test_the_relay_sends_its_databases_incarnation_in_every_envelope(sqlite_db: str) -> None:
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    with outbox.begin() as session:
        outbox.publish(session, T, {"n": 1}, key="a")
        outbox.publish(session, T, {"n": 2})
    relay = Relay(outbox, ScriptedTransport(), worker_id="w")
    drain(relay)
    sent = [record_to_message(r) for r in relay.transport.sent]
    assert [m.incarnation for m in sent] == [outbox.load_schema().incarnation] * 2


def test_an_envelope_round_trips_its_incarnation_and_an_old_one_has_none() -> None:
    now = datetime.now(UTC)
    fields = {"message_id": uuid.uuid4(), "topic": T, "key": "k", "seq": 1, "payload": b"{}",
              "content_type": "application/json", "headers": {"h": "v"}, "created_at": now}
    incarnation = str(uuid.uuid4())
    message = record_to_message(to_record(**fields, incarnation=incarnation))
    assert message.incarnation == incarnation and message.headers == {"h": "v"}
    assert record_to_message(to_record(**fields)).incarnation is None
    broken = to_record(**fields)
    broken.headers.append((INCARNATION, b"not-a-uuid"))  # type: ignore[union-attr]
    with pytest.raises(ForeignRecordError, match="broken outbox envelope"):
        record_to_message(broken)


def previous_version(url: str) -> None:
    """A database as the release before the incarnation left it, with inbox rows."""
    engine = create_engine(url)
    inbox = Inbox(engine, group="g")
    inbox.create_tables()
    inbox.handler(T)(lambda session, message: None)
    inbox.handle(record(T, "k", 1))
    inbox.handle(record(T, "k", 3))  # held
    t = inbox.tables
    with engine.begin() as conn:
        for table in (t.inbox_keys, t.inbox_held, t.inbox_parked):
            conn.execute(sa.text(f"ALTER TABLE {table.name} DROP COLUMN incarnation"))
        conn.execute(sa.delete(t.meta).where(t.meta.c.name == "incarnation"))
        conn.execute(sa.update(t.meta).where(t.meta.c.name == "schema_version")
                     .values(value=str(BEFORE_INCARNATION)))
    engine.dispose()


def test_the_previous_version_upgrades_to_an_identity_and_keeps_its_inbox_state(db_url: str) -> None:
    previous_version(db_url)
    with pytest.raises(SchemaError, match="init-db --upgrade"):
        Outbox(create_engine(db_url)).load_schema()
    out = cli("init-db", "--db", db_url, "--upgrade")
    assert f"upgraded schema version {BEFORE_INCARNATION} to {SCHEMA_VERSION}" in out
    minted = stored_incarnation(db_url)
    assert str(uuid.UUID(minted)) == minted
    cli("init-db", "--db", db_url, "--upgrade")  # idempotent: the identity stays
    assert stored_incarnation(db_url) == minted
    engine = create_engine(db_url)
    inbox = Inbox(engine, group="g")
    seen: list[int] = []
    inbox.handler(T)(lambda session, message: seen.append(message.seq))
    incarnation = str(uuid.uuid4())
    inbox.handle(record(T, "k", 2, incarnation=incarnation))  # the held seq 3 follows
    assert seen == [2, 3]
    k = inbox.tables.inbox_keys
    with engine.connect() as conn:
        assert conn.execute(sa.select(k.c.last_seq, k.c.incarnation)).one() == (3, incarnation)
    engine.dispose()
