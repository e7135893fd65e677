"""The console's links: every page reachable for every name, and a back link that stays home.

A consumer group or key may hold ``/``, ``%``, ``?``, ``#``, spaces, any
Unicode, or be ``..`` (a topic is Kafka's: ``...`` at worst): each is drawn by
Hypothesis and driven through the real app (Starlette's TestClient) on a real
database — linked from the overview, opened, replayed and discarded by
submitting the forms the pages render.

A ``back`` value sent with an action is accepted only when a browser would
resolve it to a page of this console: checked against the WHATWG URL parser
itself (Node's ``URL``, the standard browsers implement), over arbitrary text.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html import unescape
from html.parser import HTMLParser

import pytest
import sqlalchemy as sa
from httpx import Response
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from markupsafe import escape
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

from outbox import Inbox, Outbox
from outbox.console import Operators, create_app
from tests.conftest import unavailable
from tests.inbox_support import record

USERS = {"alice": "wonderland-rabbit-hole"}
AUTH = ("alice", USERS["alice"])
HOSTILE = ["team/billing", "a%2Fb", "100%", "?x=1&y=2", "#frag", "with space", "ünïcødé ✓ 日本", "..", ".",
           "../..", "\\evil", "key&group=x", "+plus+", "//evil.example", "tab\there", "new\nline"]
# Any text a database stores: no NUL (PostgreSQL refuses it), no lone surrogate (not UTF-8).
name_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                    min_size=1, max_size=30)
names = st.one_of(st.sampled_from(HOSTILE), name_text).filter(lambda s: s.strip() != "")
# Topics are Kafka's: letters, digits, '.', '_', '-' (the inbox refuses others), '...' included.
topics = st.from_regex(r"[a-zA-Z0-9._-]{1,40}", fullmatch=True).filter(lambda s: s not in {".", ".."})


@dataclass
class Form:
    action: str
    id: str
    cls: str
    fields: list[tuple[str, str]] = field(default_factory=list)


class Page(HTMLParser):
    """The forms and links of a page, as a browser reads them (entities decoded)."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.forms: list[Form] = []
        self.links: dict[str, str] = {}  # href -> id
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append(Form(a.get("action", ""), a.get("id", ""), a.get("class", "")))
        elif tag == "input" and self.forms and "name" in a:
            self.forms[-1].fields.append((a["name"], a.get("value", "")))
        elif tag == "a" and "href" in a:
            self.links[a["href"]] = a.get("id", "")


def submit(client: TestClient, form: Form, action: str = "", **extra: str) -> Response:
    """POST ``form`` as a browser would (every field, each checkbox ticked), ``extra`` filled in."""
    fields: dict[str, list[str]] = {}
    for name, value in form.fields:
        fields.setdefault(name, []).append(value)
    for name, value in extra.items():
        fields[name] = [value]
    return client.post(action or form.action, data=fields, auth=AUTH)


def only(links: Iterable[str], prefix: str) -> list[str]:
    return [link for link in links if link.startswith(prefix)]


def clean(outbox: Outbox, engine: sa.Engine) -> None:
    t = outbox.tables
    with engine.begin() as conn:
        for table in (t.inbox_held, t.inbox_parked, t.inbox_messages, t.inbox_keys):
            conn.execute(sa.delete(table))


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(group=names, topic=topics, keys=st.lists(names, min_size=2, max_size=2, unique=True))
@example(group="team/billing", topic="orders.eu_1-x", keys=["a/b?c=d#e", ".."])
@example(group="..", topic="...", keys=["100% ✓", "//evil.example"])
def test_every_name_routes_links_and_acts(outbox: Outbox, engine: sa.Engine, group: str, topic: str,
                                          keys: list[str]) -> None:
    clean(outbox, engine)
    inbox = Inbox(engine, group=group, retry_backoff=0.001, concurrency=1)
    broken = {"on": True}

    @inbox.handler(topic)
    def handle(session: Session, message: object) -> None:
        if broken["on"]:
            raise RuntimeError("bug 9")

    replayed, discarded = keys
    for key in keys:
        for seq in (1, 2):
            inbox.handle(record(topic, key, seq))
    client = TestClient(create_app(outbox, inboxes=[inbox], operators=Operators(users=USERS)),
                        base_url="http://127.0.0.1")

    overview = Page(client.get("/", auth=AUTH).text)
    [to_parked] = only(overview.links, "/parked?")
    [to_held] = only(overview.links, "/held?")
    assert client.get(to_held, auth=AUTH).status_code == 200
    parked = client.get(to_parked, auth=AUTH)
    assert parked.status_code == 200 and str(escape(group)) in parked.text
    key_links = only(Page(parked.text).links, "/parked/key?")
    assert len(key_links) == 2
    pages = {}
    for link in key_links:
        page = client.get(link, auth=AUTH)
        assert page.status_code == 200 and page.text.count("discard message") == 2, link
        shown = re.search(r"parked messages of .*? / (.*?)</h2>", page.text, re.S)
        assert shown is not None
        pages[unescape(shown[1])] = page.text
    assert set(pages) == set(keys)

    broken["on"] = False
    [replay_form] = [f for f in Page(pages[replayed]).forms if f.id == "replay-key"]
    done = submit(client, replay_form, reason="fixed")
    assert done.status_code == 200 and "key unparked" in done.text, done.text
    discard_form = next(f for f in Page(pages[discarded]).forms if f.cls == "discard")
    gone = submit(client, discard_form, reason="not needed")
    assert gone.status_code == 200 and "discarded by alice" in gone.text, gone.text

    p = outbox.tables.inbox_parked
    with engine.connect() as conn:
        left = conn.execute(sa.select(p.c.consumer_group, p.c.topic, p.c.key, p.c.seq)).all()
    assert [tuple(r) for r in left] == [(group, topic, discarded, 2)]
    [back] = only(Page(gone.text).links, "/parked?")
    again = client.get(back, auth=AUTH)
    assert again.status_code == 200 and again.text.count("/parked/key?") == 1


# -- the back link ---------------------------------------------------------------------------


class WhatwgUrl:
    """Node's ``URL`` (the WHATWG URL Standard browsers follow), one resolution per line."""

    SCRIPT = r"""
    const rl = require('readline').createInterface({input: process.stdin});
    rl.on('line', line => {
      const [href, base] = JSON.parse(line);
      let out;
      try { const u = new URL(href, base); out = {origin: u.origin, pathname: u.pathname}; }
      catch (e) { out = {error: String(e)}; }
      process.stdout.write(JSON.stringify(out) + '\n');
    });
    """

    def __init__(self, node: str) -> None:
        self.proc = subprocess.Popen([node, "-e", self.SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, encoding="utf-8", bufsize=1)

    def resolve(self, href: str, base: str) -> dict[str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([href, base]) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, str] = json.loads(self.proc.stdout.readline())
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def whatwg() -> Iterator[WhatwgUrl]:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        unavailable("no node: the WHATWG URL oracle is Node's URL (apt-get install nodejs)")
    parser = WhatwgUrl(node)
    try:
        yield parser
    finally:
        parser.close()


ORIGIN = "http://console.test"
PIECES = ["/", "//", "\\", "\t", "\n", "\r", " ", "\x00", "\x1f", "\x7f", "\x85", "\u2028", ".", "..", "%2e",
          "%2E", "%2f", "%5c", "%09", "%0a", "evil.example", "javascript:", "data:", "http:", ":", "@", "?",
          "#", "ops", "outbox", "parked", "\u3002", "\uff0f", "\uff3c", "é"]
bases = st.sampled_from(["", "/ops/outbox"])
crafted = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)


def back_values(base: str) -> st.SearchStrategy[str]:
    return st.one_of(st.text(), crafted, crafted.map(lambda s: base + "/" + s),
                     crafted.map(lambda s: base + s))


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(data=st.data(), base=bases)
def test_an_accepted_back_link_is_a_page_of_this_console_for_a_browser(
    whatwg: WhatwgUrl, data: st.DataObject, base: str
) -> None:
    from outbox.console._links import console_path

    back = data.draw(back_values(base))
    if console_path(back, base) is None:
        return
    resolved = whatwg.resolve(back, f"{ORIGIN}{base}/parked/replay?group=g")
    assert resolved.get("origin") == ORIGIN, (back, resolved)
    assert resolved["pathname"].startswith(base + "/"), (back, resolved)
    # Exactly where the console meant: the browser changed nothing on the way.
    assert resolved["pathname"] == back.split("?", 1)[0].split("#", 1)[0], (back, resolved)


@settings(max_examples=300, deadline=None)
@given(base=bases, path=st.sampled_from(["/", "/failed", "/parked", "/parked/key", "/held"]),
       params=st.dictionaries(st.sampled_from(["group", "topic", "key", "after"]), names, max_size=4))
def test_every_link_the_console_makes_is_accepted_back(base: str, path: str, params: dict[str, str]) -> None:
    from outbox.console._links import console_path, link

    made = link(base, path, **params)
    assert console_path(made, base) == made


@pytest.mark.parametrize("back", [
    "/\t/evil.example/", "//evil.example/", "/\\evil.example/", "\\/evil.example", "javascript:alert(1)",
    "JaVaScRiPt:alert(1)", " /parked", "/%2e%2e/evil", "/%2F%2Fevil.example", "/%5Cevil.example",
    "/\r\n/evil.example", "/\x00/evil.example", "/parked/../../evil", "http://evil.example/",
    "/\u3002/evil.example", "%2F%2Fevil.example", "/ops/outbox/../evil",
])
def test_the_back_links_of_the_issue_fall_back_to_the_console(outbox: Outbox, engine: sa.Engine,
                                                               back: str) -> None:
    with Session(engine) as session, session.begin():
        outbox.publish(session, "invoices", {"n": 1}, key="k")
    with engine.begin() as conn:
        conn.execute(sa.update(outbox.tables.messages).values(status="failed", last_error="too large"))
    client = TestClient(create_app(outbox, operators=Operators(users=USERS)), base_url="http://127.0.0.1")
    [form] = Page(client.get("/failed", auth=AUTH).text).forms
    done = submit(client, form, "/failed/skip", back=back, reason="stale")
    assert done.status_code == 200 and "skipped" in done.text, done.text
    [href] = [h for h, i in Page(done.text).links.items() if i == "back"]
    assert href == "/failed", (back, href)
