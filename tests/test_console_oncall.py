"""The console for on-call: the trace page, navigation counts, refresh, banners, notices, stale relays.

Through Starlette's test client, on rows the real inbox parks and holds
(``console_support``), as the other console tests do.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from outbox import Inbox, Outbox, create_engine
from outbox.console import Operators, create_app
from outbox.core._envelope import utcnow
from tests.console_support import broken_inbox, csrf_of, park
from tests.inbox_support import TOPIC, record

USERS = {"alice": "wonderland-rabbit-hole"}
AUTH = ("alice", USERS["alice"])


def client_for(outbox: Outbox, **kwargs) -> TestClient:  # type: ignore[no-untyped-def]
    kwargs.setdefault("operators", Operators(users=USERS))
    return TestClient(create_app(outbox, **kwargs), base_url="http://127.0.0.1")


def nav_count(html: str, name: str) -> str | None:
    found = re.search(rf'id="nav-{name}">[^<]*<span class="count[^"]*">([^<]+)</span>', html)
    return found[1] if found else None


@pytest.fixture
def consumer_db(tmp_path: Path) -> sa.Engine:
    """A consumer's own database: inbox tables of group ``shipping``, one message held there."""
    engine = create_engine(f"sqlite:///{tmp_path}/shipping.db")
    shipping = Inbox(engine, group="shipping")
    shipping.create_tables()

    @shipping.handler(TOPIC)
    def ship(session, message):  # type: ignore[no-untyped-def]
        pass

    shipping.handle(record(TOPIC, "gap-9", 2))
    return engine


def test_trace_page_follows_a_parked_message_across_both_databases(
        outbox: Outbox, engine: sa.Engine, consumer_db: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1", range(1, 3))
    client = client_for(outbox, inbox_databases=[consumer_db])
    first, second = (p.message_id for p in inbox.parked(TOPIC, "bad-1"))

    page = client.get("/trace", params={"id": str(second)}, auth=AUTH)
    assert page.status_code == 200, page.text
    assert "parked behind seq 1 of its key (never ran)" in page.text
    assert "group billing" in page.text and "group shipping" in page.text and "not seen" in page.text
    assert "attempts 0" not in page.text

    key = client.get("/trace", params={"topic": TOPIC, "key": "bad-1"}, auth=AUTH)
    assert key.status_code == 200 and "2 parked message(s) (seqs 1, 2)" in key.text
    assert f'href="/trace?id={first}"' in key.text

    held = client.get("/trace", params={"topic": TOPIC, "key": "gap-9"}, auth=AUTH)
    assert held.status_code == 200 and "held seqs 2 waiting for seq 1" in held.text

    # the message and key pages link here
    parked_key = client.get("/parked/key", params={"group": "billing", "topic": TOPIC, "key": "bad-1"},
                            auth=AUTH).text
    assert f'href="/trace?id={first}"' in parked_key
    assert 'href="/trace?topic=orders&amp;key=bad-1"' in parked_key
    assert "parked behind seq 1 of its key" in parked_key


@pytest.mark.parametrize(("params", "status", "says"), [
    ({"id": "not-a-uuid"}, 400, "is not a UUID"),
    ({"id": str(uuid.uuid4())}, 404, "in none of the databases"),
    ({"topic": "nope", "key": "k"}, 404, "topic &#39;nope&#39; is in none of the databases"),
    ({"topic": TOPIC}, 400, "needs both the topic and the key"),
    ({"topic": "bad topic", "key": "k"}, 400, "invalid topic"),
    ("topic=orders&key=%ED%B3%BF", 404, "of topic &#39;orders&#39; is in none"),  # a surrogate's bytes
    ({"key": "k" * 1001, "topic": TOPIC}, 400, "at most 1000 characters"),
])
def test_trace_page_says_what_is_wrong_with_the_search(outbox: Outbox, engine: sa.Engine,
                                                       params: dict[str, str] | str, status: int,
                                                       says: str) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1")
    client = client_for(outbox)
    if isinstance(params, str):
        page = client.get("/trace?" + params, auth=AUTH)
    else:
        page = client.get("/trace", params=params, auth=AUTH)
    assert page.status_code == status and says in page.text, page.text
    assert 'id="trace-form"' in page.text


def test_trace_page_is_behind_the_gate_and_counts_never_reach_a_stranger(outbox: Outbox,
                                                                        engine: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1")
    client = client_for(outbox)
    for path in ("/trace", "/", "/failed", "/held?group=billing"):
        stranger = client.get(path)
        assert stranger.status_code == 401 and nav_count(stranger.text, "parked") is None
    token = TestClient(create_app(outbox, operators=Operators(token="a-console-token-for-tests")))
    assert token.get("/trace", follow_redirects=False).headers["location"] == "/login"


def test_navigation_counts_failed_parked_and_held_in_every_database(
        outbox: Outbox, engine: sa.Engine, consumer_db: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1", range(1, 3))
    park(inbox, "bad-2", range(1, 2))
    inbox.handle(record(TOPIC, "gap-1", 5))
    page = client_for(outbox, inbox_databases=[consumer_db]).get("/", auth=AUTH).text
    assert (nav_count(page, "failed"), nav_count(page, "parked"), nav_count(page, "held")) == ("0", "3", "2")


def test_navigation_counts_come_back_with_the_tables_of_a_database_that_had_none(tmp_path: Path) -> None:
    """Attack 38: the tables a database holds were looked up once and kept, also when it held none
    (an empty database, one of the faults a console survives): after ``outbox init-db`` its pages
    came back but the navigation never counted its failed, parked or held rows again until a restart."""
    engine = create_engine(f"sqlite:///{tmp_path}/orders.db")
    sa.create_engine(f"sqlite:///{tmp_path}/orders.db").connect().close()  # the file, no tables
    client = client_for(Outbox(engine))
    assert client.get("/failed", auth=AUTH).status_code == 503  # no tables: its page of its own
    Outbox(engine).create_tables()
    page = client.get("/failed", auth=AUTH).text
    assert (nav_count(page, "failed"), nav_count(page, "parked"), nav_count(page, "held")) == ("0", "0", "0")


def test_pages_refresh_unless_they_hold_action_forms_and_the_toggle_is_remembered(
        outbox: Outbox, engine: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1")
    refresh = '<meta http-equiv="refresh" content="30">'
    client = client_for(outbox, inboxes=[inbox])
    assert refresh in client.get("/", auth=AUTH).text
    assert refresh in client.get("/held?group=billing", auth=AUTH).text
    parked = client.get("/parked?group=billing", auth=AUTH).text
    assert refresh not in parked and "no auto-refresh on a page with actions" in parked
    assert refresh not in client.get("/trace", auth=AUTH).text  # the empty search form
    read_only = client_for(outbox, read_only=True)
    assert refresh in read_only.get("/parked?group=billing", auth=AUTH).text

    off = client.get("/refresh", params={"to": "off", "back": "/held?group=billing"}, auth=AUTH,
                     follow_redirects=False)
    assert off.status_code == 303 and off.headers["location"] == "/held?group=billing"
    assert refresh not in client.get("/", auth=AUTH).text
    assert "auto-refresh off: turn on" in client.get("/", auth=AUTH).text
    away = client.get("/refresh", params={"to": "on", "back": "//evil.example/"}, auth=AUTH,
                      follow_redirects=False)
    assert away.headers["location"] == "/"
    assert client.get("/refresh", params={"to": "off"}, follow_redirects=False).status_code == 401


def test_a_replay_that_left_the_key_parked_is_a_red_banner(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, broken = broken_inbox(engine)
    park(inbox, "bad-1")
    client = client_for(outbox, inboxes=[inbox])
    csrf = csrf_of(client.get("/parked?group=billing", auth=AUTH).text)
    lane = json.dumps([TOPIC, "bad-1"])
    still = client.post("/parked/replay?group=billing", auth=AUTH,
                        data={"csrf": csrf, "lane": lane, "reason": "try"})
    assert still.status_code == 409 and '<div class="stuck" id="result">' in still.text
    broken["on"] = False
    done = client.post("/parked/replay?group=billing", auth=AUTH,
                       data={"csrf": csrf, "lane": lane, "reason": "fixed"})
    assert done.status_code == 200 and '<div class="ok" id="result">' in done.text


def test_a_read_only_console_says_why_and_how_to_enable_actions(outbox: Outbox) -> None:
    without = TestClient(create_app(outbox)).get("/").text
    assert "set OUTBOX_CONSOLE_TOKEN or OUTBOX_CONSOLE_USERS and restart" in without
    flagged = client_for(outbox, read_only=True).get("/", auth=AUTH).text
    assert "started with --read-only (create_app(read_only=True)); start it without to act" in flagged
    assert 'id="read-only"' not in client_for(outbox).get("/", auth=AUTH).text


def test_times_are_relative_with_the_utc_time_in_the_title(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1")
    page = client_for(outbox).get("/parked?group=billing", auth=AUTH).text
    stamp = r'<time datetime="[^"]+\+00:00" title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC">\d+ s ago</time>'
    assert re.search(stamp, page), page


def test_a_relay_without_heartbeat_is_stale_and_a_consumer_database_shows_no_shards(
        outbox: Outbox, engine: sa.Engine) -> None:
    client = client_for(outbox)
    quiet = client.get("/", auth=AUTH).text
    assert "shards owned" not in quiet and "no relay has run on this database" in quiet
    relays = outbox.tables.relays
    with engine.begin() as conn:
        conn.execute(relays.insert(), [
            {"worker_id": "alive", "heartbeat_at": utcnow()},
            {"worker_id": "dead", "heartbeat_at": utcnow() - timedelta(minutes=16)}])
    page = client.get("/", auth=AUTH).text
    assert "shards owned" in page
    marked = re.findall(r'<tr( class="stale-relay")?><td>(alive|dead)</td>', page)
    rows = {name: mark for mark, name in marked}
    assert rows == {"alive": "", "dead": ' class="stale-relay"'}


@pytest.fixture(scope="module")
def trace_client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    """A console over a database holding one parked key, shared by the examples below."""
    engine = create_engine(f"sqlite:///{tmp_path_factory.mktemp('trace')}/console.db")
    outbox = Outbox(engine)
    outbox.create_tables()
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1")
    return client_for(outbox)


@settings(max_examples=60, deadline=None)
@given(id_=st.text(max_size=60), topic=st.text(max_size=60), key=st.text(max_size=60))
def test_any_search_text_gets_a_page_never_a_server_error(trace_client: TestClient, id_: str, topic: str,
                                                         key: str) -> None:
    """What a browser sends is UTF-8: a lone surrogate goes as its bytes, which the server replaces."""
    query = "&".join(f"{name}={quote(value, safe='', errors='surrogatepass')}"
                     for name, value in (("id", id_), ("topic", topic), ("key", key)))
    page = trace_client.get("/trace?" + query, auth=AUTH)
    assert page.status_code in (200, 400, 404), page.text
    assert 'id="trace-form"' in page.text


def _relay_rows(page: str) -> dict[str, str]:
    return {name: mark for mark, name in re.findall(r'<tr( class="stale-relay")?><td>(\w+)</td>', page)}


def test_stale_means_the_heartbeat_stopped_moving_whatever_the_relays_clock_says(
        outbox: Outbox, engine: sa.Engine) -> None:
    """A relay stamps heartbeats with its own clock. One two minutes behind the console's is
    alive while its heartbeat moves; one ten minutes ahead reads as such, not as "-600 s"."""
    client = client_for(outbox)
    relays = outbox.tables.relays
    with engine.begin() as conn:
        conn.execute(relays.insert(), [
            {"worker_id": "behind", "heartbeat_at": utcnow() - timedelta(seconds=120)},
            {"worker_id": "ahead", "heartbeat_at": utcnow() + timedelta(minutes=10)}])
    first = client.get("/", auth=AUTH).text
    assert _relay_rows(first)["behind"]  # at first sight the clocks are all there is
    assert "relay clock 10.0 min ahead" in first and _relay_rows(first)["ahead"] == ""
    with engine.begin() as conn:  # the relay renews: still two minutes behind, but it moved
        conn.execute(relays.update().where(relays.c.worker_id == "behind")
                     .values(heartbeat_at=utcnow() - timedelta(seconds=100)))
    assert _relay_rows(client.get("/", auth=AUTH).text) == {"behind": "", "ahead": ""}


def test_a_heartbeat_that_stands_still_goes_stale_after_the_limit_by_the_consoles_clock() -> None:
    from outbox.console._relays import Heartbeats
    clock = [1000.0]
    beats = Heartbeats(60, clock=lambda: clock[0])
    now = utcnow()

    def stale(age: float, later: float) -> bool:
        [judged] = beats.judge([{"worker_id": "r", "heartbeat_age_s": age, "shards": 1}],
                               now + timedelta(seconds=later))
        return bool(judged["stale"])

    assert not stale(-600, 0)            # ten minutes ahead, just seen
    clock[0] += 59
    assert not stale(-541, 59)           # the same heartbeat, 59 s later
    clock[0] += 2
    assert stale(-539, 61)               # still the same: stopped, whatever its clock says
    clock[0] += 1
    assert not stale(-600, 62)           # it moved: alive again


def test_an_age_in_the_future_reads_as_such_not_as_a_negative_number(outbox: Outbox,
                                                                     engine: sa.Engine) -> None:
    """A row written by a process whose clock is ahead: its age is negative by the console's."""
    from tests._relay_helpers import publish
    publish(outbox, "orders", ["order-1"])
    messages = outbox.tables.messages
    with engine.begin() as conn:
        conn.execute(messages.update().values(created_at=utcnow() + timedelta(minutes=5)))
    page = client_for(outbox).get("/", auth=AUTH).text
    backlog = page[page.index('id="backlog"'):page.index("</table>", page.index('id="backlog"'))]
    assert re.search(r"in </span>(4\.9|5\.0) min", backlog), backlog
    assert "-" not in re.sub(r"<[^>]+>", "", backlog).replace("oldest pending", "")
