"""The console under attack: guessing sign-ins, reusing a signed-out cookie, huge bodies, secrets in logs.

Each test plays the attack of issue 24 against the real app (Starlette's
TestClient, a real database), with the clocks of the throttle and the
sessions moved by hand instead of waited for.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from typer.testing import CliRunner

from outbox import ConfigurationError, Outbox, create_engine
from outbox.cli import app as cli
from outbox.console import Operators, create_app
from tests.console_support import TOKEN, Clock, form_page, moved_clock  # noqa: F401 (fixture)

USERS = {"alice": "wonderland-rabbit-hole", "bob": "builder-of-bridges"}


@pytest.fixture
def sqlite_outbox(sqlite_db: str) -> Outbox:
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    return outbox


def browser(app: Any, address: str = "203.0.113.7") -> TestClient:
    return TestClient(app, base_url="http://127.0.0.1", client=(address, 50000))


def sign_in(client: TestClient, token: str, name: str = "bob") -> Any:
    return client.post("/login", data={"csrf": form_page(client, "/login"), "name": name, "token": token})


def basic(name: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{name}:{password}".encode()).decode()}


# -- 1. sign-in that withstands guessing ------------------------------------------------------


def test_guessing_the_token_locks_the_client_out_the_right_token_included(
    sqlite_outbox: Outbox, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN))
    guesser = browser(app)
    caplog.set_level(logging.INFO, logger="outbox.console")
    csrf = form_page(guesser, "/login")
    answers = [guesser.post("/login", data={"csrf": csrf, "name": "x", "token": f"guess-{i:04d}-of-it"}
                            ).status_code for i in range(300)]
    assert answers[:5] == [401] * 5 and set(answers[6:]) == {429}
    right = sign_in(guesser, TOKEN)
    assert right.status_code == 429 and int(right.headers["retry-after"]) >= 1
    assert guesser.get("/", follow_redirects=False).status_code == 303  # no session was made
    bearer = {"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "cron"}
    assert guesser.get("/", headers=bearer).status_code == 429  # the script's way is locked too
    locks = [r for r in caplog.records if r.levelno == logging.WARNING and "sign-in locked" in r.getMessage()]
    assert locks and "client 203.0.113.7" in locks[0].getMessage()
    # The token is locked with the address (issue 38): another address that never signed in here
    # waits too. The lock runs out; each further wrong guess doubles the next (1 s, 2 s, ... 15 min).
    assert sign_in(browser(app, "198.51.100.1"), TOKEN).status_code == 429
    clock.now += 1.5
    assert sign_in(guesser, "another-wrong-guess-0000").status_code == 401
    assert sign_in(guesser, TOKEN).status_code == 429
    clock.now += 2.5
    assert sign_in(guesser, TOKEN).status_code == 200


def test_an_ipv6_guesser_cannot_rotate_addresses_within_its_own_network(
    sqlite_outbox: Outbox, clock: Clock
) -> None:
    """Anyone given an IPv6 /64 (every home line, every cloud VM) holds 2**64 addresses.

    Counted per address, each new one would bring 5 free guesses: unlimited guessing.
    Counted per /64, the whole network shares one count; another network is not affected.
    """
    app = create_app(sqlite_outbox, operators=Operators(users=USERS))
    answers = []
    for i in range(12):  # a user name that is not configured: only the address counts (and the day's budget)
        guesser = browser(app, f"2001:db8:1:2::{i + 1:x}")
        answers.append(guesser.get("/", headers=basic("mallory", f"guess-{i:04d}-of-it")).status_code)
    assert answers[:5] == [401] * 5 and set(answers[6:]) == {429}, answers
    alice = basic("alice", USERS["alice"])
    assert browser(app, "2001:db8:1:2::99").get("/", headers=alice).status_code == 429
    assert browser(app, "2001:db8:1:3::1").get("/", headers=alice).status_code == 200
    assert browser(app, "::ffff:203.0.113.9").get("/", headers=alice).status_code == 200


def test_guessing_a_users_password_locks_that_user_from_every_address(
    sqlite_outbox: Outbox, clock: Clock
) -> None:
    app = create_app(sqlite_outbox, operators=Operators(users=USERS))
    answers = [browser(app, f"198.51.100.{i}").get("/", headers=basic("alice", f"guess-{i}")).status_code
               for i in range(1, 12)]
    assert answers[:5] == [401] * 5 and set(answers[6:]) == {429}
    elsewhere = browser(app, "192.0.2.99")
    assert elsewhere.get("/", headers=basic("alice", USERS["alice"])).status_code == 429
    assert elsewhere.get("/", headers=basic("bob", USERS["bob"])).status_code == 200  # only alice is locked
    clock.now += 3600.0
    assert elsewhere.get("/", headers=basic("alice", USERS["alice"])).status_code == 200


@settings(max_examples=200, deadline=None)
@given(sent=st.text(max_size=200))
def test_credentials_are_compared_as_fixed_length_digests(sent: str) -> None:
    """``hmac.compare_digest`` leaks the length of its arguments: it must only ever see 32-byte digests."""
    import outbox.console._auth as auth

    seen: list[tuple[int, int]] = []

    original = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return original(a, b)

    operators = Operators(token=TOKEN, users=USERS)
    auth.hmac.compare_digest = spy
    try:
        assert operators.token_matches(sent) is (sent == TOKEN)
        assert operators.password_matches("alice", sent) is (sent == USERS["alice"])
        assert operators.password_matches(sent, USERS["alice"]) is (sent == "alice")
    finally:
        auth.hmac.compare_digest = original
    assert seen and set(seen) == {(32, 32)}, seen
    assert hashlib.sha256(b"").digest_size == 32


@pytest.mark.parametrize("variable, value, secrets, why", [
    ("OUTBOX_CONSOLE_USERS", "alice:pw1,bob:pw2", ["pw1", "pw2"],
     "OUTBOX_CONSOLE_USERS: console user 'alice': the password has 3 characters, needs at least 16"),
    ("OUTBOX_CONSOLE_USERS", "alice:aaaaaaaaaaaaaaaaaaaaaa", ["aaaaaaaaaaaaaaaaaaaaaa"],
     "uses 1 different characters, needs at least 8"),
    ("OUTBOX_CONSOLE_TOKEN", "0123012301230123", ["0123012301230123"],
     "OUTBOX_CONSOLE_TOKEN: the console token uses 4 different characters"),
])
def test_a_weak_credential_stops_the_console_at_start_in_one_line(
    sqlite_outbox: Outbox, sqlite_db: str, monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
    secrets: list[str], why: str
) -> None:
    import uvicorn

    monkeypatch.delenv("OUTBOX_CONSOLE_TOKEN", raising=False)
    monkeypatch.delenv("OUTBOX_CONSOLE_USERS", raising=False)
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the console started"))
    result = CliRunner().invoke(cli, ["console", "--db", sqlite_db])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and why in output, result.output
    assert output.startswith("error: ") and output.count("error: ") == 1, result.output
    for secret in secrets:
        assert secret not in result.output


@settings(max_examples=300, deadline=None)
@given(secret=st.text(max_size=40))
def test_an_accepted_secret_has_16_characters_of_which_8_differ(secret: str) -> None:
    try:
        Operators(token=secret)
    except ConfigurationError as exc:  # the message says why in numbers, never quoting the secret
        assert re.fullmatch(r"the console token (has \d+ characters, needs at least 16|uses \d+ different "
                            r"characters, needs at least 8) \(make one with `[^`]+`\)", str(exc)), str(exc)
        assert len(secret) < 16 or len(set(secret)) < 8
    else:
        assert len(secret) >= 16 and len(set(secret)) >= 8


# -- 2. sessions that logout really ends ----------------------------------------------------


def test_a_cookie_copied_before_logout_is_worthless_after(sqlite_outbox: Outbox, clock: Clock) -> None:
    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN))
    operator = browser(app)
    assert sign_in(operator, TOKEN).status_code == 200
    thief = browser(app, "192.0.2.66")
    thief.cookies.update(dict(operator.cookies))
    assert thief.get("/failed", follow_redirects=False).status_code == 200  # the copy works while signed in
    out = operator.post("/logout", data={"csrf": form_page(operator, "/login")})
    assert out.status_code == 200 and "signed out" in out.text
    for client in (thief, operator):
        client.cookies.update({"outbox_console_operator": thief.cookies["outbox_console_operator"]})
        assert client.get("/failed", follow_redirects=False).status_code == 303


def test_a_session_ends_after_its_idle_time_and_lives_while_used(sqlite_outbox: Outbox, clock: Clock) -> None:
    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN), session_idle=600)
    operator = browser(app)
    sign_in(operator, TOKEN)
    for _ in range(5):  # used every 9 minutes: still signed in after 45
        clock.now += 540
        assert operator.get("/", follow_redirects=False).status_code == 200
    clock.now += 601
    assert operator.get("/", follow_redirects=False).status_code == 303
    with pytest.raises(ConfigurationError, match="session_idle"):
        create_app(sqlite_outbox, session_idle=0)


def test_a_session_ends_after_twelve_hours_however_busy(sqlite_outbox: Outbox, clock: Clock) -> None:
    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN))
    operator = browser(app)
    sign_in(operator, TOKEN)
    for _ in range(24):  # 11.6 hours, never idle for 30 minutes
        clock.now += 29 * 60
        assert operator.get("/ping", follow_redirects=False).status_code == 200
    clock.now += 25 * 60
    assert operator.get("/ping", follow_redirects=False).status_code == 303


# -- 5. bounded requests --------------------------------------------------------------------


def test_a_huge_sign_in_form_is_refused_before_it_is_read(sqlite_outbox: Outbox) -> None:
    """The issue's 400 fields of 1 MB, streamed (no Content-Length): the app stops reading at the limit."""
    import anyio

    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN), max_body=64 * 1024)
    field = b"f=" + b"x" * (1024 * 1024 - 3) + b"&"
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": field, "more_body": pulled < 400}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/login", "raw_path": b"/login", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/x-www-form-urlencoded")],
             "client": ("203.0.113.7", 5000), "server": ("127.0.0.1", 8470)}
    anyio.run(app, scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert pulled == 1  # one chunk over the limit, and not one more read


def test_every_route_refuses_a_declared_oversized_body_and_too_many_fields(sqlite_outbox: Outbox) -> None:
    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN), max_body=64 * 1024)
    client = browser(app)
    for path in ("/login", "/logout", "/failed/retry", "/failed/skip", "/parked/replay?group=g",
                 "/parked/discard?group=g", "/", "/parked?group=g"):
        answer = client.post(path, content=b"a=" + b"x" * (64 * 1024))
        assert answer.status_code == 413, (path, answer.status_code)
    csrf = form_page(client, "/login")
    many = client.post("/login", data={"csrf": csrf, "name": "bob", "token": TOKEN,
                                       **{f"f{i}": "x" for i in range(100)}})
    assert many.status_code == 400 and "Too many fields" in many.text
    assert sign_in(client, TOKEN).status_code == 200  # a normal sign-in is well inside both limits


# -- 6. no secret in any log, repr or error ---------------------------------------------------


@pytest.fixture
def every_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog


def test_no_secret_reaches_a_log_a_repr_or_a_page(sqlite_outbox: Outbox, clock: Clock,
                                                   every_log: pytest.LogCaptureFixture) -> None:
    secret = "the-csrf-secret-of-this-console"
    operators = Operators(token=TOKEN, users=USERS)
    app = create_app(sqlite_outbox, operators=operators, secret=secret)
    client = browser(app)
    for i in range(8):
        sign_in(client, TOKEN[:-1] + str(i))
        client.get("/", headers=basic("alice", USERS["alice"] + str(i)))
        client.get("/", headers={"Authorization": f"Bearer {TOKEN}x", "X-Outbox-Operator": "cron"})
    clock.now += 3600
    signed_in = sign_in(client, TOKEN)
    cookie = client.cookies["outbox_console_operator"]
    pages = signed_in.text + client.get("/").text
    client.post("/logout", data={"csrf": form_page(client, "/login")})
    words = [repr(operators), str(operators), pages, every_log.text,
             *(repr(r.args) for r in every_log.records)]
    for text in words:
        for value in (TOKEN, *USERS.values(), cookie, secret):
            assert value not in text, (value, text[:300])
    assert "sign-in locked" in every_log.text and "bearer token refused" in every_log.text  # yet logged
    assert "alice" in repr(operators) and "token" in repr(operators)


def test_a_database_outage_shows_and_logs_no_database_password(every_log: pytest.LogCaptureFixture) -> None:
    outbox = Outbox(create_engine("postgresql+psycopg://console:s3cret-db-pw@127.0.0.1:1/orders"))
    client = TestClient(create_app(outbox, operators=Operators(token=TOKEN)), base_url="http://127.0.0.1",
                        raise_server_exceptions=False)
    page = client.get("/", headers={"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "cron"})
    assert page.status_code == 503 and "could not be read" in page.text
    assert "s3cret-db-pw" not in page.text + every_log.text
    assert "s3cret-db-pw" not in repr(outbox.engine)


def test_a_client_gone_before_its_body_ended_is_no_error(sqlite_outbox: Outbox) -> None:
    """A POST whose client hangs up mid-body (or is cut off by the request deadline) ended in an
    unhandled ``ClientDisconnect``: an ERROR traceback in the log per anonymous request."""
    import asyncio

    app = create_app(sqlite_outbox, operators=Operators(token=TOKEN))
    messages = [{"type": "http.request", "body": b"csrf=x&name=", "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/login", "raw_path": b"/login", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/x-www-form-urlencoded"),
                         (b"content-length", b"100")],
             "client": ("203.0.113.7", 5000), "server": ("127.0.0.1", 8470)}
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect
    assert sent and sent[0]["status"] == 400


@pytest.mark.parametrize("path", ["/parked?group=g&db=" + "1" * 5000,
                                  "/parked?group=g&after=" + "[" * 5000,
                                  "/held?group=g&after=" + "[" * 5000,
                                  "/parked/replay?group=g"])
def test_a_query_or_form_field_too_long_or_too_deep_to_parse_is_a_400(sqlite_outbox: Outbox,
                                                                        path: str) -> None:
    """Attack 38: ``db=`` of 5000 digits passed ``isdigit`` and then broke ``int()`` (Python's limit
    of 4300 digits), and an ``after=`` or a form's ``lane`` nested 5000 lists deep broke
    ``json.loads`` (``RecursionError``): a 500 with a traceback per request (from anyone, on a
    console without credentials)."""
    from outbox import Inbox
    from outbox.console import _csrf

    inbox = Inbox(sqlite_outbox.engine, group="g")
    inbox.handler("orders")(lambda session, message: None)
    secret = b"the-console-secret-of-this-test"
    app = create_app(sqlite_outbox, operators=Operators(users=USERS), inboxes=[inbox], secret=secret)
    client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    alice = basic("alice", USERS["alice"])
    if path.startswith("/parked/replay"):
        client.cookies.set(_csrf.COOKIE, "a-form-cookie")
        page = client.post(path, headers=alice, data={"csrf": _csrf.form_token(secret, "a-form-cookie"),
                                                      "reason": "attack", "lane": "[" * 5000})
    else:
        page = client.get(path, headers=alice)
    assert page.status_code == 400, page.text[-500:]


@pytest.mark.parametrize("path", ["/login", "/logout", "/failed/retry"])
def test_a_form_token_that_is_not_ascii_is_refused_not_an_error(sqlite_outbox: Outbox, path: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Attack 38: ``hmac.compare_digest`` of two ``str`` raises TypeError when one is not ASCII, so
    ``csrf=é`` on ``/login`` — checked before any credential, by anyone — was a 500 and an ERROR
    traceback per request, outside the sign-in throttle."""
    client = TestClient(create_app(sqlite_outbox, operators=Operators(token=TOKEN)),
                        base_url="http://127.0.0.1", raise_server_exceptions=False)
    form_page(client, "/login")  # the form cookie
    bearer = {"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "mallory"}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    for sent in (b"%C3%A9", b"%E2%98%83", b"%FF%FE"):  # é, a snowman, bytes that are no UTF-8
        page = client.post(path, headers={**form, **(bearer if path == "/failed/retry" else {})},
                           content=b"csrf=" + sent + b"&name=mallory&token=x&reason=attack")
        assert page.status_code == 403 and "CSRF token is missing or wrong" in page.text, page.text[-300:]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_sign_in_name_with_control_characters_is_refused_at_sign_in(sqlite_outbox: Outbox) -> None:
    """Attack 38: ``/login`` took any name of 1 to 100 characters, NUL and line breaks too; every
    action records the name in the database, and PostgreSQL refuses NUL in text: an operator
    signed in as ``al\\x00ice`` had every action refused, long after the sign-in that caused it."""
    client = browser(create_app(sqlite_outbox, operators=Operators(token=TOKEN)))
    for name in ("al\x00ice", "alice\nbob", "\x1b[31malice"):
        page = sign_in(client, TOKEN, name)
        assert page.status_code == 400 and "give your name" in page.text, (name, page.status_code)
    assert sign_in(client, TOKEN, "Zoë Ünal 名前").status_code == 200
