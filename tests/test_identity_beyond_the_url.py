"""Two engines whose URLs are spelled alike to the letter can still reach two sets of tables.

An engine's ``connect_args`` (or a ``connect`` event) take part in where its unqualified tables
are: ``connect_args={"options": "-c search_path=acme"}`` puts them in schema ``acme`` while the
URL says nothing of it (docs/tenants.md, "One database, many spellings": a schema given as none
is the connection's ``current_schema()``). The console took an inbox on such an engine for one
using its own tables, and the trace read such an inbox database as the outbox's, because their
URLs matched (found by an attack): the console listed the parked keys of ``public`` and its
replay ran the other schema's, and the trace said a message applied there was never seen. Only
one pool (one engine) is now taken for one set of tables without asking its server.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox import ConfigurationError, Inbox, Outbox, create_engine
from outbox.console import Operators, create_app
from outbox.ops import Database, trace_message
from tests.console_support import broken_inbox, csrf_of, park
from tests.inbox_support import TOPIC, applied, record

USERS = {"alice": "wonderland-rabbit-hole"}
AUTH = ("alice", USERS["alice"])


@pytest.fixture
def acme(pg: sa.Engine, postgres_db: str) -> Iterator[sa.Engine]:
    """An engine on ``pg``'s database, its URL spelled as ``pg``'s, whose unqualified tables are in
    schema ``acme`` (its connections' search path)."""
    with pg.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA acme"))
    engine = create_engine(postgres_db, connect_args={"options": "-c search_path=acme"})
    assert engine.url.render_as_string(hide_password=False) == pg.url.render_as_string(hide_password=False)
    yield engine
    engine.dispose()


def parked_keys(engine: sa.Engine, outbox: Outbox) -> set[str | None]:
    p = outbox.tables.inbox_parked
    with engine.connect() as conn:
        return set(conn.execute(sa.select(p.c.key).where(p.c.consumer_group == "billing")).scalars())


def bad_1_parked_in_both(pg: sa.Engine, acme: sa.Engine) -> tuple[dict[str, bool], Inbox, dict[str, bool]]:
    """Key ``bad-1`` of group ``billing`` parked in ``public`` and in ``acme``: the switch of ``public``'s
    failing handler, ``acme``'s inbox and the switch of its handler."""
    Outbox(pg).create_tables()
    here, here_broken = broken_inbox(pg)
    here.create_tables()
    park(here, "bad-1")
    there, there_broken = broken_inbox(acme)
    there.create_tables()
    park(there, "bad-1")
    return here_broken, there, there_broken


@pytest.mark.postgres
def test_the_console_never_takes_an_inbox_of_another_schema_for_its_own_tables(
        pg: sa.Engine, acme: sa.Engine) -> None:
    """Key ``bad-1`` is parked in ``public`` and in ``acme``. A console of ``public`` given the inbox of
    ``acme`` either refuses it, or its replay of the key it lists unparks that key: never the other's."""
    outbox, (here_broken, there, there_broken) = Outbox(pg), bad_1_parked_in_both(pg, acme)
    assert parked_keys(pg, outbox) == {"bad-1"} and parked_keys(acme, outbox) == {"bad-1"}
    try:
        app = create_app(outbox, inboxes=[there], operators=Operators(users=USERS))
    except ConfigurationError as exc:
        assert "other tables" in str(exc)
        return
    client = TestClient(app, base_url="http://127.0.0.1")
    page = client.get("/parked?group=billing", auth=AUTH)
    assert "bad-1" in page.text  # what the operator sees: public's parked key
    here_broken["on"] = there_broken["on"] = False
    done = client.post("/parked/replay?group=billing", auth=AUTH, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, "bad-1"]), "reason": "fixed"})
    assert done.status_code == 200, done.text
    assert (parked_keys(pg, outbox), parked_keys(acme, outbox)) == (set(), {"bad-1"}), (
        "the console replayed another schema's key than the one it listed")


@pytest.mark.postgres
def test_a_trace_reads_an_inbox_database_of_another_schema_spelled_alike(
        pg: sa.Engine, acme: sa.Engine) -> None:
    """The message was applied by group ``billing`` in ``acme``: the trace says so, not "never seen"."""
    outbox = Outbox(pg)
    outbox.create_tables()
    there, _ = broken_inbox(acme)
    there.create_tables()
    message_id = uuid.uuid4()
    there.handle(record(TOPIC, "k", 1, message_id=message_id))
    assert applied(acme, "k") == [("k", 1)]
    doc = trace_message(Database("outbox", pg, outbox.tables),
                        [Database("acme", acme, there.tables)], message_id)
    [message] = doc["messages"]
    assert [(g["group"], g["state"]) for g in message["groups"]] == [("billing", "applied")]


@pytest.mark.postgres
def test_an_inbox_database_of_another_schema_spelled_alike_is_listed_and_acted_on_there(
        pg: sa.Engine, acme: sa.Engine) -> None:
    """Given as one of the console's inbox databases, the engine of ``acme`` is listed beside ``public``
    (named apart by its schema), and the replay of a key listed there unparks that key, not ``public``'s."""
    outbox, (here_broken, there, there_broken) = Outbox(pg), bad_1_parked_in_both(pg, acme)
    client = TestClient(create_app(outbox, inboxes=[there], inbox_databases=[acme],
                                   operators=Operators(users=USERS)), base_url="http://127.0.0.1")
    overview = client.get("/", auth=AUTH).text
    assert "(schema public)" in overview and "(schema acme)" in overview, overview
    page = client.get("/parked?group=billing&db=1", auth=AUTH)
    assert page.status_code == 200 and "bad-1" in page.text, page.text
    here_broken["on"] = there_broken["on"] = False
    done = client.post("/parked/replay?group=billing&db=1", auth=AUTH, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, "bad-1"]), "reason": "fixed"})
    assert done.status_code == 200 and "key unparked" in done.text, done.text
    assert (parked_keys(pg, outbox), parked_keys(acme, outbox)) == ({"bad-1"}, set())
