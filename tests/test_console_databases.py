"""One console over an outbox database and its inbox databases: the overview lists every
database's groups, and the parked and held pages and their actions work on the database that
holds the group (``?db=N``), with the same checks and records as on the outbox's own.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox import ConfigurationError, Outbox, create_engine
from outbox.console import Operators, create_app
from tests.console_support import broken_inbox, csrf_of, form_page, park
from tests.inbox_support import TOPIC, record

USERS = {"alice": "wonderland-rabbit-hole"}
AUTH = ("alice", USERS["alice"])


def client_for(outbox: Outbox, **kwargs) -> TestClient:  # type: ignore[no-untyped-def]
    return TestClient(create_app(outbox, operators=Operators(users=USERS), **kwargs),
                      base_url="http://127.0.0.1")


@pytest.fixture
def shipping_db(tmp_path: Path) -> sa.Engine:
    return create_engine(f"sqlite:///{tmp_path}/shipping.db")


def parked_keys(engine: sa.Engine, group: str) -> set[str]:
    with engine.connect() as conn:
        return {k for (k,) in conn.execute(sa.text(
            "SELECT DISTINCT key FROM inbox_parked WHERE consumer_group = :g"), {"g": group})}


def test_overview_lists_every_databases_groups_and_their_pages_act_there(
        outbox: Outbox, engine: sa.Engine, shipping_db: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    billing, _ = broken_inbox(engine)
    park(billing, "bad-main", range(1, 2))
    shipping, broken = broken_inbox(shipping_db, group="shipping")
    shipping.create_tables()
    park(shipping, "bad-ship", range(1, 3))
    park(shipping, "bad-two", range(1, 2))
    shipping.handle(record(TOPIC, "gap-ship", 2))

    # Without the shipping inbox: listed and paged, replay disabled with the reason, discard works.
    client = client_for(outbox, inbox_databases=[shipping_db])
    overview = client.get("/", auth=AUTH)
    assert overview.status_code == 200, overview.text
    assert 'href="/parked?group=shipping&amp;db=1"' in overview.text
    assert 'href="/held?group=shipping&amp;db=1"' in overview.text
    assert 'href="/parked?group=billing"' in overview.text
    assert "shipping.db" in overview.text and "parked key(s)" in overview.text
    assert "group shipping: 2 parked key(s)" in overview.text  # its stuck reason, beside billing's

    page = client.get("/parked", params={"group": "shipping", "db": "1"}, auth=AUTH)
    assert page.status_code == 200 and "bad-ship" in page.text and "in sqlite:///" in page.text
    assert "--app MODULE:ATTRIBUTE" in page.text and "replay-selected" not in page.text
    assert "bad-ship" not in client.get("/parked", params={"group": "shipping"}, auth=AUTH).text
    held = client.get("/held", params={"group": "shipping", "db": "1"}, auth=AUTH)
    assert held.status_code == 200 and "gap-ship" in held.text
    key = client.get("/parked/key", params={"group": "shipping", "db": "1", "topic": TOPIC,
                                             "key": "bad-ship"}, auth=AUTH)
    assert key.status_code == 200 and "/parked/discard?group=shipping&amp;db=1" in key.text
    trace = client.get("/trace", params={"topic": TOPIC, "key": "bad-ship"}, auth=AUTH).text
    assert "/parked/key?group=shipping&amp;db=1&amp;topic=orders&amp;key=bad-ship" in trace
    refused = client.post("/parked/replay?group=shipping&db=1", auth=AUTH, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, "bad-ship"]), "reason": "x"})
    assert refused.status_code == 409 and parked_keys(shipping_db, "shipping") == {"bad-ship", "bad-two"}

    # With it: replay and discard reach the consumer's database, recorded with who, why and where.
    client = client_for(outbox, inbox_databases=[shipping_db], inboxes=[shipping])
    caplog.set_level(logging.INFO, logger="outbox.console.audit")
    csrf = form_page(client, "/parked?group=shipping&db=1", auth=AUTH)
    still = client.post("/parked/replay?group=shipping&db=1", auth=AUTH, data={
        "csrf": csrf, "lane": json.dumps([TOPIC, "bad-ship"]), "reason": "try again"})
    assert still.status_code == 409 and "still parked 2" in still.text
    first = next(p.message_id for p in shipping.parked(TOPIC, "bad-two"))
    gone = client.post("/parked/discard?group=shipping&db=1", auth=AUTH, data={
        "csrf": csrf, "message_id": str(first), "reason": "duplicate"})
    assert gone.status_code == 200, gone.text
    broken["on"] = False
    done = client.post("/parked/replay?group=shipping&db=1", auth=AUTH, data={
        "csrf": csrf, "lane": json.dumps([TOPIC, "bad-ship"]), "reason": "fixed"})
    assert done.status_code == 200 and "key unparked" in done.text, done.text
    assert parked_keys(shipping_db, "shipping") == set() and parked_keys(engine, "billing") == {"bad-main"}
    logged = [r.getMessage() for r in caplog.records if r.name == "outbox.console.audit"]
    assert any("discard" in m and "by alice (duplicate)" in m and "shipping.db" in m for m in logged)
    assert any("replay" in m and "by alice (fixed)" in m and "shipping.db" in m for m in logged)


@pytest.mark.parametrize("db", ["2", "-1", "x", "1.0", "٣", "9" * 400])
def test_a_database_index_not_of_this_console_is_refused(outbox: Outbox, shipping_db: sa.Engine,
                                                         db: str) -> None:
    client = client_for(outbox, inbox_databases=[shipping_db])
    for path in ("/parked", "/held", "/parked/key"):
        page = client.get(path, params={"group": "g", "db": db, "topic": TOPIC, "key": "k"}, auth=AUTH)
        assert page.status_code == 400 and "db must name one of this console&#39;s databases" in page.text


def test_an_inbox_of_another_database_is_refused(outbox: Outbox, shipping_db: sa.Engine) -> None:
    stranger, _ = broken_inbox(shipping_db, group="shipping")
    with pytest.raises(ConfigurationError, match="not the console's outbox database"):
        create_app(outbox, inboxes=[stranger])


def test_an_inbox_database_that_is_down_is_one_line_and_hides_nothing_else(
        outbox: Outbox, engine: sa.Engine) -> None:
    billing, _ = broken_inbox(engine)
    park(billing, "bad-main", range(1, 2))
    down = sa.create_engine("postgresql+psycopg://ops:pw-s3cr3t-9@127.0.0.1:1/shipping?connect_timeout=2")
    page = client_for(outbox, inbox_databases=[down]).get("/", auth=AUTH)
    assert page.status_code == 200, page.text
    assert "127.0.0.1:1/shipping" in page.text and "could not be read" in page.text
    assert "pw-s3cr3t-9" not in page.text
    assert 'href="/parked?group=billing"' in page.text


def test_the_navigation_still_counts_the_databases_that_answer(outbox: Outbox, engine: sa.Engine) -> None:
    billing, _ = broken_inbox(engine)
    park(billing, "bad-main", range(1, 3))
    down = sa.create_engine("postgresql+psycopg://ops:pw-s3cr3t-9@127.0.0.1:1/shipping?connect_timeout=2")
    page = client_for(outbox, inbox_databases=[down]).get("/", auth=AUTH).text
    assert re.search(r'id="nav-parked">parked<span class="count[^"]*">2</span>', page), page


def test_a_database_given_twice_is_listed_and_counted_once(outbox: Outbox, engine: sa.Engine) -> None:
    billing, _ = broken_inbox(engine)
    park(billing, "bad-main", range(1, 3))
    again = sa.create_engine(engine.url)
    page = client_for(outbox, inbox_databases=[again, again]).get("/", auth=AUTH).text
    assert re.search(r'id="nav-parked">parked<span class="count[^"]*">2</span>', page), page
    assert page.count('href="/parked?group=billing') == 1


def respelled(engine: sa.Engine) -> sa.Engine:
    """Another engine on ``engine``'s database, through another spelling of its URL."""
    url = engine.url
    if url.get_backend_name() == "sqlite":
        folder, _, file = str(url.database).rpartition("/")
        return create_engine(url.set(database=f"{folder}/./{file}").render_as_string(hide_password=False))
    return create_engine(url.set(host="localhost").render_as_string(hide_password=False))


def test_a_database_given_in_two_spellings_is_one_database(outbox: Outbox, engine: sa.Engine) -> None:
    """Named by what its server says: listed and counted once, and an inbox on either spelling
    lists, replays and discards there (not refused as "another database")."""
    billing, broken = broken_inbox(respelled(engine))
    park(billing, "bad-main", range(1, 3))
    again = respelled(engine)
    page = client_for(outbox, inbox_databases=[again, respelled(engine)]).get("/", auth=AUTH).text
    assert re.search(r'id="nav-parked">parked<span class="count[^"]*">2</span>', page), page
    assert page.count('href="/parked?group=billing') == 1
    client = client_for(outbox, inbox_databases=[again], inboxes=[billing])
    csrf = form_page(client, "/parked?group=billing", auth=AUTH)
    broken["on"] = False
    done = client.post("/parked/replay?group=billing", auth=AUTH, data={
        "csrf": csrf, "lane": json.dumps([TOPIC, "bad-main"]), "reason": "fixed"})
    assert done.status_code == 200 and "key unparked" in done.text, done.text
    assert parked_keys(engine, "billing") == set()
