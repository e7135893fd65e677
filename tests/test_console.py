"""The web console (``outbox.console``): its pages show what ``outbox status`` shows, page through
large tables, escape user data, and refuse every action that lacks a credential, a CSRF token or a
reason. Runs the app in-process (Starlette's TestClient) on SQLite and PostgreSQL; the browser test
is tests/test_console_browser.py."""

from __future__ import annotations

import json
import logging
import re
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from outbox import ConfigurationError, Inbox, Outbox
from outbox.console import Operators, create_app
from outbox.core._wire import EVENT_TYPE
from outbox.ops import gather
from tests.console_support import TOKEN, broken_inbox, csrf_of, form_page, park
from tests.inbox_support import TOPIC, applied, record

USERS = {"alice": "wonderland-rabbit-hole"}


def client_for(outbox: Outbox, *, inboxes=(), **kwargs) -> TestClient:  # type: ignore[no-untyped-def]
    kwargs.setdefault("operators", Operators(users=USERS))
    return TestClient(create_app(outbox, inboxes=inboxes, **kwargs), base_url="http://127.0.0.1")


def keys_parked(outbox: Outbox, group: str = "billing") -> set[str | None]:
    p = outbox.tables.inbox_parked
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        return set(conn.execute(sa.select(p.c.key).where(p.c.consumer_group == group)).scalars())


def test_overview_shows_the_status_numbers_and_user_data_as_text(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad<script>alert(1)</script>", payload=b'{"note": "<script>alert(2)</script>"}')
    park(inbox, "good")
    client = client_for(outbox)
    page = client.get("/", auth=("alice", USERS["alice"]))
    assert page.status_code == 200
    doc = gather(outbox)
    [group] = doc["inbox"]["groups"]
    row = re.search(r'<td>billing</td>\s*<td class="n"><a [^>]*>(\d+)</a></td><td class="n">(\d+)</td>',
                    page.text)
    assert row and (int(row[1]), int(row[2])) == (group["parked_keys"], group["parked_messages"]) == (1, 2)
    assert "1 parked key(s)" in page.text and "signed in as alice" in page.text

    lane = client.get("/parked", params={"group": "billing"}, auth=("alice", USERS["alice"]))
    key = client.get("/parked/key", auth=("alice", USERS["alice"]),
                     params={"group": "billing", "topic": TOPIC, "key": "bad<script>alert(1)</script>"})
    for html in (lane.text, key.text):
        assert "<script>" not in html and "<b>" not in html
        assert "bad&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in key.text  # the payload, as text
    assert "RuntimeError: bug 42 in &lt;b&gt;" in key.text and "Traceback" in key.text


def test_replay_and_discard_through_the_console(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, broken = broken_inbox(engine)
    park(inbox, "bad-1", range(1, 4))
    park(inbox, "bad-2", range(1, 3))
    client = client_for(outbox, inboxes=[inbox])
    auth = ("alice", USERS["alice"])
    csrf = form_page(client, "/parked?group=billing", auth=auth)
    lanes = [json.dumps([TOPIC, "bad-1"])]
    still = client.post("/parked/replay?group=billing", auth=auth,
                        data={"csrf": csrf, "lane": lanes, "reason": "try again"})
    assert still.status_code == 409 and "still parked 3" in still.text and "bug 42" in still.text

    broken["on"] = False
    done = client.post("/parked/replay?group=billing", auth=auth,
                       data={"csrf": csrf, "lane": lanes, "reason": "fixed in 1.2.3"})
    assert done.status_code == 200, done.text
    assert "bad-1: applied 3, key unparked" in done.text and "replayed by alice: fixed in 1.2.3" in done.text
    assert applied(engine, "bad-1") == [("bad-1", 1), ("bad-1", 2), ("bad-1", 3)]

    first, second = (p.message_id for p in inbox.parked(TOPIC, "bad-2"))
    refused = client.post("/parked/discard?group=billing", auth=auth, data={
        "csrf": csrf, "message_id": str(second), "reason": "skip ahead"})
    assert refused.status_code == 409 and "earlier message" in refused.text
    ok = client.post("/parked/discard?group=billing", auth=auth, data={
        "csrf": csrf, "message_id": str(first), "reason": "duplicate order"})
    assert ok.status_code == 200, ok.text
    m = outbox.tables.inbox_messages
    with engine.connect() as conn:
        note = conn.scalar(sa.select(m.c.note).where(m.c.message_id == first))
    assert note is not None and "discarded by alice" in note and "duplicate order" in note


def test_replay_needs_the_groups_inbox(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    park(inbox, "bad-1")
    client = client_for(outbox)  # no inboxes: nothing to run the handlers with
    auth = ("alice", USERS["alice"])
    page = client.get("/parked?group=billing", auth=auth)
    assert "--app MODULE:ATTRIBUTE" in page.text and "replay-selected" not in page.text
    refused = client.post("/parked/replay?group=billing", auth=auth, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, "bad-1"]), "reason": "x"})
    assert refused.status_code == 409 and keys_parked(outbox) == {"bad-1"}


def test_every_action_without_credential_csrf_or_reason_is_refused(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, broken = broken_inbox(engine)
    park(inbox, "bad-1")
    broken["on"] = False
    auth = ("alice", USERS["alice"])
    lane = json.dumps([TOPIC, "bad-1"])
    client = client_for(outbox, inboxes=[inbox])
    csrf = form_page(client, "/parked?group=billing", auth=auth)
    attempts = {
        "no credential": ({}, {"csrf": csrf, "lane": lane, "reason": "r"}, 401),
        "wrong password": ({"auth": ("alice", "nope")}, {"csrf": csrf, "lane": lane, "reason": "r"}, 401),
        "no csrf": ({"auth": auth}, {"lane": lane, "reason": "r"}, 403),
        "bad csrf": ({"auth": auth}, {"csrf": "0" * 64, "lane": lane, "reason": "r"}, 403),
        "no reason": ({"auth": auth}, {"csrf": csrf, "lane": lane, "reason": " "}, 400),
    }
    for what, (kw, data, status) in attempts.items():
        response = client.post("/parked/replay?group=billing", data=data, **kw)
        assert response.status_code == status, (what, response.text)
        assert keys_parked(outbox) == {"bad-1"}, what
    # A CSRF token is bound to the browser's cookie: another browser's token is refused.
    other = client_for(outbox, inboxes=[inbox])
    form_page(other, "/parked?group=billing", auth=auth)
    assert other.post("/parked/replay?group=billing", auth=auth,
                      data={"csrf": csrf, "lane": lane, "reason": "r"}).status_code == 403
    # Read-only, and no credential configured at all: looking works, acting does not.
    for kwargs in ({"read_only": True}, {"operators": None}):
        ro = client_for(outbox, inboxes=[inbox], **kwargs)
        page = ro.get("/parked?group=billing", auth=auth)
        assert page.status_code == 200 and "replay-selected" not in page.text
        refused = ro.post("/parked/replay?group=billing", auth=auth,
                          data={"csrf": csrf_of(page.text), "lane": lane, "reason": "r"})
        assert refused.status_code == 403 and "read-only" in refused.text
    assert keys_parked(outbox) == {"bad-1"}
    done = client.post("/parked/replay?group=billing", auth=auth,
                       data={"csrf": csrf, "lane": lane, "reason": "r"})
    assert done.status_code == 200 and keys_parked(outbox) == set()


def test_a_protected_console_shows_nothing_to_a_stranger(outbox: Outbox) -> None:
    basic = client_for(outbox)
    assert basic.get("/").status_code == 401
    assert basic.get("/").headers["www-authenticate"].startswith("Basic")
    token = client_for(outbox, operators=Operators(token=TOKEN))
    first = token.get("/", follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/login"
    csrf = form_page(token, "/login")
    wrong = token.post("/login", data={"csrf": csrf, "name": "bob", "token": "x" * 20})
    assert wrong.status_code == 401 and token.get("/", follow_redirects=False).status_code == 303
    ok = token.post("/login", data={"csrf": csrf, "name": "bob", "token": TOKEN})
    assert ok.status_code == 200 and "signed in as bob" in token.get("/").text
    forged = client_for(outbox, operators=Operators(token=TOKEN))
    forged.cookies.set("outbox_console_operator", "9999999999:Ym9i:" + "0" * 64)  # an old-style cookie
    assert forged.get("/", follow_redirects=False).status_code == 303
    # Scripts: a bearer token and the operator's name in a header.
    script = client_for(outbox, operators=Operators(token=TOKEN))
    assert script.get("/", headers={"Authorization": f"Bearer {TOKEN}",
                                    "X-Outbox-Operator": "cron"}).status_code == 200


def test_failed_rows_page_retry_and_skip_record_who_and_why(outbox: Outbox, engine: sa.Engine) -> None:
    m = outbox.tables.messages
    with Session(engine) as session, session.begin():
        for i in range(5):
            outbox.publish(session, TOPIC, {"i": i, "html": "<i>x</i>"}, key=f"k{i}")
    with engine.begin() as conn:
        conn.execute(sa.update(m).values(status="failed", last_error="<b>too large</b>"))
        ids = [str(i) for i in conn.execute(sa.select(m.c.message_id).order_by(m.c.id)).scalars()]
    client = client_for(outbox)
    auth = ("alice", USERS["alice"])
    first = client.get("/failed?limit=2", auth=auth)
    assert "&lt;b&gt;too large&lt;/b&gt;" in first.text and "<b>too large" not in first.text
    seen, page = [], first.text
    while True:
        seen += re.findall(r'name="message_id" value="([^"]+)"', page)
        nxt = re.search(r'id="next" href="([^"]+)"', page)
        if not nxt:
            break
        page = client.get(nxt[1].replace("&amp;", "&"), auth=auth).text
    assert seen == ids
    csrf = csrf_of(first.text)
    retry = client.post("/failed/retry", auth=auth,
                        data={"csrf": csrf, "message_id": ids[:2], "reason": "fixed"})
    skip = client.post("/failed/skip", auth=auth,
                       data={"csrf": csrf, "message_id": ids[2], "reason": "stale"})
    assert retry.status_code == 200 and skip.status_code == 200
    unknown = client.post("/failed/skip", auth=auth,
                          data={"csrf": csrf, "message_id": str(uuid.uuid4()), "reason": "x"})
    assert unknown.status_code == 409 and "nothing changed" in unknown.text
    with engine.connect() as conn:
        rows = {str(r.message_id): r
                for r in conn.execute(sa.select(m.c.message_id, m.c.status, m.c.last_error))}
    assert [rows[i].status for i in ids] == ["pending", "pending", "skipped", "failed", "failed"]
    assert "[retried by alice at " in rows[ids[0]].last_error and rows[ids[0]].last_error.endswith(": fixed]")
    assert "[skipped by alice at " in rows[ids[2]].last_error and rows[ids[2]].last_error.endswith(": stale]")


def test_retry_and_skip_audit_lines_name_the_ids_as_listed(outbox: Outbox, engine: sa.Engine,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """An id typed in another spelling (upper case, braces, no hyphens) is the listed id: the audit line
    names it as ``outbox failed list`` and the failed page show it, as the parked discard's line does."""
    m = outbox.tables.messages
    with Session(engine) as session, session.begin():
        for i in range(2):
            outbox.publish(session, TOPIC, {"i": i}, key=f"k{i}")
    with engine.begin() as conn:
        conn.execute(sa.update(m).values(status="failed", last_error="boom"))
        ids = [str(i) for i in conn.execute(sa.select(m.c.message_id).order_by(m.c.id)).scalars()]
    client = client_for(outbox)
    auth = ("alice", USERS["alice"])
    csrf = csrf_of(client.get("/failed", auth=auth).text)
    caplog.set_level(logging.INFO, logger="outbox.console.audit")
    retry = client.post("/failed/retry", auth=auth,
                        data={"csrf": csrf, "message_id": f"{{{ids[0].upper()}}}", "reason": "fixed"})
    skip = client.post("/failed/skip", auth=auth,
                       data={"csrf": csrf, "message_id": uuid.UUID(ids[1]).hex.upper(), "reason": "stale"})
    assert retry.status_code == 200 and skip.status_code == 200
    logged = [r.getMessage() for r in caplog.records if r.name == "outbox.console.audit"]
    assert logged == [f"retry failed rows ['{ids[0]}'] by alice (fixed): 1 changed",
                      f"skip failed rows ['{ids[1]}'] by alice (stale): 1 changed"]


def test_parked_keys_and_held_gaps_page_without_repeats(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, _ = broken_inbox(engine)
    keys = [f"bad-{i:03d}" for i in range(23)]
    for key in keys:
        park(inbox, key, range(1, 2))
    for key in ("gap-a", "gap-b", "gap-c"):
        inbox.handle(record(TOPIC, key, 3))  # seqs 1 and 2 missing: held
    client = client_for(outbox)
    auth = ("alice", USERS["alice"])

    def walk(path: str, pattern: str) -> list[str]:
        found, page = [], client.get(path, auth=auth).text
        while True:
            found += re.findall(pattern, page)
            nxt = re.search(r'id="next" href="([^"]+)"', page)
            if not nxt:
                return found
            page = client.get(nxt[1].replace("&amp;", "&"), auth=auth).text

    parked = walk("/parked?group=billing&limit=5", r'&amp;key=([^"]+)">')
    assert parked == keys
    held = walk("/held?group=billing&limit=2",
                r'<tr><td>orders</td><td><a href="[^"]+" title="trace this key">([^<]+)</a></td>'
                r"<td>0</td><td>3</td>")
    assert held == ["gap-a", "gap-b", "gap-c"]
    assert client.get("/parked?group=billing&after=nonsense", auth=auth).status_code == 400


def test_mounted_in_a_host_app_behind_its_own_guard(outbox: Outbox, engine: sa.Engine) -> None:
    inbox, broken = broken_inbox(engine)
    park(inbox, "bad-1")
    broken["on"] = False

    def guard(request):  # type: ignore[no-untyped-def]
        return request.headers.get("x-host-user")  # the host app's own sign-in, say

    host = Starlette(routes=[Mount("/ops/outbox", app=create_app(
        outbox, inboxes=[inbox], operators=Operators(guard=guard)))])
    client = TestClient(host, base_url="http://127.0.0.1")
    stranger = client.get("/ops/outbox/")
    assert stranger.status_code == 401 and "Path=/ops/outbox/" in stranger.headers["set-cookie"]
    page = client.get("/ops/outbox/parked?group=billing", headers={"x-host-user": "carol"})
    assert page.status_code == 200 and 'action="/ops/outbox/parked/replay?group=billing"' in page.text
    assert 'href="/ops/outbox/failed"' in page.text
    done = client.post("/ops/outbox/parked/replay?group=billing", headers={"x-host-user": "carol"}, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, "bad-1"]), "reason": "r",
        "back": "//evil.example/"})
    assert done.status_code == 200 and "replayed by carol" in done.text
    assert 'href="/ops/outbox/parked?group=billing"' in done.text and "evil" not in done.text
    # A bookmark of an earlier release's page still finds it.
    moved = client.get("/ops/outbox/parked/billing", headers={"x-host-user": "carol"}, follow_redirects=False)
    assert moved.headers["location"] == "/ops/outbox/parked?group=billing"


def test_the_public_names_are_pinned() -> None:
    import outbox.console

    assert outbox.console.__all__ == ["Operators", "create_app", "create_tenants_app"]


def test_bad_configuration_is_refused_when_built(outbox: Outbox) -> None:
    with pytest.raises(ConfigurationError, match="at least 16"):
        Operators(token="short")
    with pytest.raises(ConfigurationError, match="no password"):
        Operators.from_env({"OUTBOX_CONSOLE_USERS": "alice"})
    with pytest.raises(ConfigurationError, match=r"outbox\.Outbox"):
        create_app("sqlite://")  # type: ignore[arg-type]
    users = Operators.from_env({"OUTBOX_CONSOLE_USERS": "a:password-of-user-a, b:password-of-user-b"}).users
    assert users == {"a": "password-of-user-a", "b": "password-of-user-b"}


def test_a_forged_lane_creates_no_key_row_and_pages_forbid_framing_and_scripts(
    outbox: Outbox, engine: sa.Engine
) -> None:
    inbox, _ = broken_inbox(engine)
    client = client_for(outbox, inboxes=[inbox])
    auth = ("alice", USERS["alice"])
    page = client.get("/parked?group=billing", auth=auth)
    assert page.headers["x-frame-options"] == "DENY"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    refused = client.post("/parked/replay?group=billing", auth=auth, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, "never-seen"]), "reason": "r"})
    assert refused.status_code == 409 and "nothing parked" in refused.text
    k = outbox.tables.inbox_keys
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(k)) == 0


def test_a_database_without_tables_is_named_on_the_page(engine: sa.Engine) -> None:
    client = client_for(Outbox(engine))
    page = client.get("/", auth=("alice", USERS["alice"]))
    assert page.status_code == 503 and "no outbox tables and no inbox tables" in page.text  # issue 38


def test_a_new_console_process_signs_everyone_out_and_inboxes_must_share_the_tables(
    outbox: Outbox, engine: sa.Engine
) -> None:
    secret = "a-shared-secret-of-32-bytes-----"
    old = client_for(outbox, operators=Operators(token=TOKEN), secret=secret)
    old.post("/login", data={"csrf": form_page(old, "/login"), "name": "bob", "token": TOKEN})
    assert old.get("/", follow_redirects=False).status_code == 200
    rotated = TestClient(create_app(outbox, operators=Operators(token=TOKEN + "-rotated"), secret=secret),
                         base_url="http://127.0.0.1", cookies=dict(old.cookies))
    assert rotated.get("/", follow_redirects=False).status_code == 303
    # Sessions live on the server: a restart ends them, even with the same token and secret.
    same = TestClient(create_app(outbox, operators=Operators(token=TOKEN), secret=secret),
                      base_url="http://127.0.0.1", cookies=dict(old.cookies))
    assert same.get("/", follow_redirects=False).status_code == 303

    with pytest.raises(ConfigurationError, match="other tables"):
        create_app(outbox, inboxes=[Inbox(engine, group="g", prefix="x_", concurrency=1)])


def test_an_inbox_naming_the_consoles_schema_another_way_uses_the_consoles_tables(
    outbox: Outbox, engine: sa.Engine
) -> None:
    """``schema=None`` and the database's default schema by name (``public``; ``main`` on SQLite) are one
    schema: the console takes that inbox for its own tables, as the server says, not refuses it."""
    default = "main" if engine.dialect.name == "sqlite" else "public"
    create_app(outbox, inboxes=[Inbox(engine, group="g", schema=default, concurrency=1)])
    own = sa.create_engine(engine.url)  # another pool, as an app's Inbox has
    try:
        create_app(outbox, inboxes=[Inbox(own, group="g", schema=default, concurrency=1)])
    finally:
        own.dispose()
    if engine.dialect.name == "sqlite":  # two in-memory databases are spelled alike and are two
        memory = Outbox(sa.create_engine("sqlite://"))
        with pytest.raises(ConfigurationError, match="not the console's outbox database"):
            create_app(memory, inboxes=[Inbox(sa.create_engine("sqlite://"), group="g", concurrency=1)])


def test_an_inbox_whose_prefix_differs_in_case_is_the_consoles_where_the_database_says_so(
    engine: sa.Engine
) -> None:
    """SQLite takes a table name in any case: an inbox of prefix ``OUT_`` uses the tables of a console of
    ``out_`` there, and is taken for them. On PostgreSQL ``OUT_outbox_messages`` (sent quoted) is another
    table: refused."""
    outbox = Outbox(engine, prefix="out_")
    outbox.create_tables()
    inbox = Inbox(engine, group="g", prefix="OUT_", concurrency=1)
    if engine.dialect.name == "sqlite":
        create_app(outbox, inboxes=[inbox])
    else:
        with pytest.raises(ConfigurationError, match="other tables"):
            create_app(outbox, inboxes=[inbox])


def test_unkeyed_parked_messages_are_one_lane_per_topic(outbox: Outbox, engine: sa.Engine) -> None:
    inbox = Inbox(engine, group="billing", retry_backoff=0.001, concurrency=1)
    broken = {"on": True}

    @inbox.handler(TOPIC)
    def handle(session, message):  # type: ignore[no-untyped-def]
        if broken["on"]:
            raise RuntimeError("bug 7")

    for _ in range(3):
        inbox.handle(record(TOPIC, None, None))
    client = client_for(outbox, inboxes=[inbox])
    auth = ("alice", USERS["alice"])
    page = client.get("/parked?group=billing", auth=auth)
    assert page.text.count("(unkeyed)") == 1 and 'value="[&#34;orders&#34;, null]"' in page.text
    lane = client.get("/parked/key", params={"group": "billing", "topic": TOPIC}, auth=auth)
    assert lane.text.count("discard message") == 3
    broken["on"] = False
    done = client.post("/parked/replay?group=billing", auth=auth, data={
        "csrf": csrf_of(page.text), "lane": json.dumps([TOPIC, None]), "reason": "fixed"})
    assert done.status_code == 200 and "orders/(unkeyed): applied 3" in done.text
    assert keys_parked(outbox) == set()


def test_the_event_type_shows_beside_topic_and_key(outbox: Outbox, engine: sa.Engine) -> None:
    """On the failed rows, a key's parked messages (from the parked row) and a traced message;
    an event type is user data: shown as text."""
    m = outbox.tables.messages
    with Session(engine) as session, session.begin():
        failed_id = outbox.publish(session, TOPIC, {"n": 1}, key="k1", event_type="Order<b>Paid</b>")
    with engine.begin() as conn:
        conn.execute(sa.update(m).values(status="failed", last_error="refused"))
    inbox, _ = broken_inbox(engine)
    inbox.create_tables()
    parked = record(TOPIC, "bad-1", 1)
    parked.headers.append((EVENT_TYPE, b"OrderShipped"))
    inbox.handle(parked)
    client = client_for(outbox, inboxes=[inbox])
    auth = ("alice", USERS["alice"])
    failed = client.get("/failed", auth=auth).text
    assert '<td class="event-type">Order&lt;b&gt;Paid&lt;/b&gt;</td>' in failed
    key_page = client.get(f"/parked/key?group=billing&topic={TOPIC}&key=bad-1", auth=auth).text
    assert '<td colspan="3" class="event-type">OrderShipped</td>' in key_page
    traced = client.get(f"/trace?id={failed_id}", auth=auth).text
    assert '· type <span class="event-type">Order&lt;b&gt;Paid&lt;/b&gt;</span>' in traced
