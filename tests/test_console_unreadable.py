"""Every page of every database degrades when that database cannot be read (issue 38).

A console over an outbox database (PostgreSQL) and a consumer's inbox database
(MariaDB), each a server of the test's own, served by uvicorn as ``outbox
console`` serves it. Each database is broken in turn — stopped, frozen
(SIGSTOP), a password it refuses, a database without the tables — and every
route of the app (read from the app itself, so a route added tomorrow is
walked too) is asked about the broken one over one kept-alive connection. A
route that reads the broken database answers a 503 page of its own naming it,
a page of several databases names it in one line; nothing answers 500, no
traceback and no password reaches a page or a log, and the next request on the
same connection is served.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _in_process import outbox_in_process
from starlette.routing import Route
from starlette.testclient import TestClient

from outbox import Inbox, Outbox, create_engine
from outbox.console import Operators, _csrf, _serve, create_app
from outbox.testing import LocalMariaDB, LocalPostgres
from tests.console_support import park
from tests.inbox_support import TOPIC, apply_effect, business
from tests.test_console_cli import free_port

USERS = {"alice": "wonderland-rabbit-hole"}
AUTH = "Basic " + base64.b64encode(b"alice:wonderland-rabbit-hole").decode()
PASSWORDS = {0: "pg-pass-8e1f-secret", 1: "maria-pass-5c2d-secret"}
SECRET = b"the-console-secret-of-the-walk"
TIMEOUT = 1.0
"""The console's database deadline in this test (``create_app(database_timeout=)``; 10 s by default)."""

READS: dict[str, str | None] = {
    "/": "every", "/ping": "outbox-connection", "/failed": "outbox", "/failed/retry": "outbox",
    "/failed/skip": "outbox", "/parked": "db", "/parked/key": "db", "/parked/replay": "db",
    "/parked/discard": "db", "/held": "db", "/trace": "every", "/refresh": None, "/login": None,
    "/logout": None, "/parked/{group}": None, "/held/{group}": None,
}
"""Which database each route reads: the outbox's (its tables, or only a connection), the one
``?db=`` names, every one, or none.
A route missing here fails the test: say what it reads, and it is walked like the others."""
GROUPS = {0: "billing", 1: "shipping"}


@dataclass
class Databases:
    pg: LocalPostgres
    maria: LocalMariaDB
    urls: dict[int, str]
    empty: dict[int, str]
    parked: dict[int, str]  # a parked message id in each database

    def server(self, index: int) -> LocalPostgres | LocalMariaDB:
        return self.pg if index == 0 else self.maria


def seed(url: str, index: int) -> str:
    """Tables and one parked message of group ``GROUPS[index]`` in the database at ``url``; its id."""
    engine = create_engine(url)
    Outbox(engine).create_tables()
    business.create_all(engine)
    inbox = Inbox(engine, group=GROUPS[index], retry_backoff=0.001)

    @inbox.handler(TOPIC)
    def fail(session: Any, message: Any) -> None:
        raise RuntimeError("parked for the walk")

    park(inbox, "bad-1", range(1, 2))
    with engine.connect() as conn:
        parked = str(conn.scalar(sa.text("SELECT message_id FROM inbox_parked")))
    engine.dispose()
    return parked


@pytest.fixture
def databases(own_postgres: LocalPostgres, own_mariadb: LocalMariaDB) -> Databases:
    urls = {0: own_postgres.add_login("console", PASSWORDS[0]),
            1: own_mariadb.add_login("console", PASSWORDS[1])}
    empty = {}
    for index, url in urls.items():
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with admin.connect() as conn:
            conn.execute(sa.text("CREATE DATABASE empty"))
        admin.dispose()
        empty[index] = sa.make_url(url).set(database="empty").render_as_string(hide_password=False)
    parked = {index: seed(url, index) for index, url in urls.items()}
    return Databases(own_postgres, own_mariadb, urls, empty, parked)


class Connection:
    """One kept-alive HTTP/1.1 connection, as a browser keeps it; says if the server dropped it."""

    def __init__(self, port: int) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.cookies: dict[str, str] = {}
        self.socket: Any = None

    def ask(self, method: str, path: str, form: dict[str, Any] | None = None) -> tuple[int, str]:
        headers = {"Authorization": AUTH, "Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        body = None
        if form is not None:
            body = urllib.parse.urlencode(form, doseq=True)
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        self.http.request(method, path, body=body, headers=headers)
        if self.socket is None:
            self.socket = self.http.sock
        assert self.http.sock is self.socket, f"{method} {path}: a new connection was opened"
        response = self.http.getresponse()
        text = response.read().decode()
        assert not response.will_close, f"{method} {path}: the server closed the connection " \
                                        f"({response.status})"
        for header in response.headers.get_all("set-cookie") or []:
            name, _, rest = header.partition("=")
            self.cookies[name] = rest.split(";", 1)[0]
        return response.status, text


@contextmanager
def served(app: Any) -> Iterator[int]:
    """``app`` on uvicorn as ``outbox console`` configures it; logs reach pytest (no log config)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, proxy_headers=False, http=_serve.BoundedH11,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the console did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(20)


def console(urls: dict[int, str]) -> tuple[Any, list[sa.Engine]]:
    engines = [create_engine(urls[0]), create_engine(urls[1])]
    inboxes = []
    for index, engine in enumerate(engines):
        inbox = Inbox(engine, group=GROUPS[index])
        inbox.handler(TOPIC)(apply_effect)
        inboxes.append(inbox)
    app = create_app(Outbox(engines[0]), inboxes=inboxes, operators=Operators(users=USERS), secret=SECRET,
                     inbox_databases=[engines[1]], database_timeout=TIMEOUT)
    return app, engines


def walk(app: Any, connection: Connection, broken: int, how: str, parked: str) -> list[str]:
    """Every route of ``app`` asked about database ``broken``; what went wrong, as lines."""
    problems = []
    connection.cookies[_csrf.COOKIE] = "a-form-cookie-of-the-walk"
    csrf = _csrf.form_token(SECRET, "a-form-cookie-of-the-walk")
    for route in app.routes:
        assert isinstance(route, Route), route
        assert route.path in READS, f"a new route {route.path}: say in READS which database it reads"
        reads = READS[route.path]
        path = route.path.replace("{group}", GROUPS[broken])
        query = urllib.parse.urlencode({"group": GROUPS[broken], "db": broken, "topic": TOPIC, "key": "bad-1",
                                        "id": parked, "to": "on", "back": "/"})
        for method in sorted((route.methods or set()) - {"HEAD"}):
            form = {"csrf": csrf, "reason": "walking the routes", "message_id": parked,
                    "lane": json.dumps([TOPIC, "bad-1"]), "name": "alice", "token": "x"}
            status, page = connection.ask(method, f"{path}?{query}", form if method == "POST" else None)
            said = f"{how} database {broken}: {method} {path} answered {status}"
            reads_it = (reads == "db" or (reads == "outbox" and broken == 0)
                        or (reads == "outbox-connection" and broken == 0 and how != "missing tables"))
            if status >= 500 and status != 503:
                problems.append(f"{said}: {page[-300:]}")
            elif reads_it and (status != 503 or "could not be read" not in page):
                problems.append(f"{said}, not its 503 page: {page[-300:]}")
            elif reads == "every" and how != "missing tables" and (
                    status not in (200, 404, 503) or "could not be read" not in page):
                problems.append(f"{said}, without a line for it: {page[-300:]}")
            elif reads is None and status >= 500:
                problems.append(f"{said} (it reads no database): {page[-300:]}")
            if any(password in page for password in PASSWORDS.values()):
                problems.append(f"{said} with a database password in it")
            again, _ = connection.ask("GET", "/login")  # the next request, on the same connection
            if again != 200:
                problems.append(f"{said}; the next request answered {again}")
    return problems


def warmed_up(connection: Connection, within: float = 30.0) -> None:
    """``GET /`` asked until it answers 200, so every pool holds a connection before the break.

    Asked again because the walk's 1 s deadline (``TIMEOUT``) also bounds the console's first
    connection to a server the walk before just restarted: on a loaded host that connection alone
    has taken longer, and the page then (rightly) says the database could not be read. The walk
    proves what a broken database does; a healthy one that is slow to its first answer is not it.
    """
    deadline = time.monotonic() + within
    while True:
        status, page = connection.ask("GET", "/")
        if status == 200:
            return
        assert time.monotonic() < deadline, f"no 200 within {within:.0f} s: {page[-300:]}"
        time.sleep(0.5)


def walked(urls: dict[int, str], broken: int, how: str, parked: str,
           brk: Callable[[], None] = lambda: None, mend: Callable[[], None] = lambda: None) -> list[str]:
    """A console on ``urls`` served, warmed up, ``brk()`` done, every route walked; the problems."""
    app, engines = console(urls)
    try:
        with served(app) as port:
            connection = Connection(port)
            warmed_up(connection)
            brk()
            started = time.monotonic()
            try:
                problems = walk(app, connection, broken, how, parked)
            finally:
                mend()
            took = time.monotonic() - started
            assert took < 60, f"{how}: the walk took {took:.0f} s"
            connection.http.close()
            return problems
    finally:
        for engine in engines:
            engine.dispose()


def no_traceback_nor_password(caplog: pytest.LogCaptureFixture) -> None:
    logged = caplog.text
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks and "Traceback" not in logged, logged[-3000:]
    for password in PASSWORDS.values():
        assert password not in logged


@pytest.mark.parametrize("broken", [0, 1], ids=["outbox-database-postgres", "inbox-database-mariadb"])
def test_every_route_degrades_when_a_database_cannot_be_read(
        databases: Databases, broken: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    server = databases.server(broken)
    problems = walked(databases.urls, broken, "down", databases.parked[broken], server.stop, server.start)
    problems += walked(databases.urls, broken, "frozen", databases.parked[broken], server.freeze, server.thaw)
    for how, url in [("wrong password", databases.urls[broken].replace(PASSWORDS[broken], "not-it")),
                     ("missing tables", databases.empty[broken])]:
        problems += walked({**databases.urls, broken: url}, broken, how, databases.parked[broken])
    assert not problems, "\n".join(problems)
    no_traceback_nor_password(caplog)


@pytest.mark.parametrize("broken", [0, 1], ids=["outbox-database", "inbox-database"])
def test_every_route_degrades_without_a_server_of_its_own(
        tmp_path: Path, broken: int, caplog: pytest.LogCaptureFixture) -> None:
    """The same walk where no server can be started: SQLite files, and a PostgreSQL URL whose port
    nobody listens on (down) or an empty SQLite file (no tables), given from the start."""
    caplog.set_level(logging.INFO)
    urls = {index: f"sqlite:///{tmp_path}/db{index}.db" for index in (0, 1)}
    parked = {index: seed(url, index) for index, url in urls.items()}
    caplog.clear()  # parking logged its alerts
    down = f"postgresql+psycopg://console:{PASSWORDS[broken]}@127.0.0.1:1/orders"
    empty = f"sqlite:///{tmp_path}/empty.db"
    sa.create_engine(empty).connect().close()
    problems = []
    for how, url in [("down", down), ("missing tables", empty)]:
        app, engines = console({**urls, broken: url})
        try:
            with served(app) as port:
                problems += walk(app, Connection(port), broken, how, parked[broken])
        finally:
            for engine in engines:
                engine.dispose()
    assert not problems, "\n".join(problems)
    no_traceback_nor_password(caplog)


# -- the reader: few threads in a frozen database, errors named without secrets -----------------


def test_a_frozen_database_holds_few_threads_and_its_pages_answer_at_once_after_one_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox import OutboxTables
    from outbox.console import _reads
    from outbox.ops import Database

    monkeypatch.setattr(_reads, "MAX_CALLS", 3)
    reader = _reads.Reader(Database("db-x", sa.create_engine("sqlite://"), OutboxTables()), timeout=0.2)
    release = threading.Event()
    entered: list[int] = []

    def frozen() -> str:
        entered.append(1)
        release.wait(30)
        return "late"

    async def scenario() -> None:
        with pytest.raises(_reads.Unreadable, match=r"did not answer within 0.2 s\)") as first:
            await reader.run(frozen)
        assert first.value.late and not reader.answering

        async def refreshed() -> None:  # a page refreshed, many browsers: no thread sent after the first
            for _ in range(20):
                with pytest.raises(_reads.Unreadable, match="still waiting for an earlier read"):
                    await reader.run(frozen)

        # "At once" is "without waiting out a deadline": with the deadline a minute, a refusal that
        # waited would take that long. (Checked as 20 refusals within 0.5 s of wall time, it would fail
        # whenever the loaded host stalled the test for half a second.)
        reader.timeout = 60.0
        await asyncio.wait_for(refreshed(), 30)
        assert len(entered) == 1
        reader.timeout = 0.2
        # An action is not refused for a slow read; it is bounded by the deadline, and by MAX_CALLS.
        for _ in range(2):
            with pytest.raises(_reads.Unreadable, match="did not answer"):
                await reader.run(frozen, write=True)
        with pytest.raises(_reads.Unreadable, match="3 calls to it are still waiting"):
            await reader.run(frozen, write=True)
        assert len(entered) == 3
        release.set()
        deadline = time.monotonic() + 10
        while not reader.answering:
            assert time.monotonic() < deadline, "the frozen calls never came back"
            await asyncio.sleep(0.01)
        assert await reader.run(lambda: 42) == 42

    asyncio.run(scenario())


def test_a_database_error_is_named_without_its_password_and_other_errors_are_left_alone() -> None:
    from outbox import OutboxTables
    from outbox.console import _reads
    from outbox.ops import Database

    engine = sa.create_engine("postgresql+psycopg://ops:pw-s3cr3t-77@db.example:5432/orders")
    reader = _reads.Reader(Database("orders at db.example", engine, OutboxTables()))

    def refused() -> None:
        raise sa.exc.OperationalError("connect", {}, Exception(
            'password authentication failed for user "ops" (pw-s3cr3t-77)\nDETAIL: more'))

    def mistaken() -> None:
        raise ValueError("not a message id")

    async def scenario() -> None:
        with pytest.raises(_reads.Unreadable) as unread:
            await reader.run(refused)
        assert str(unread.value) == ('orders at db.example: could not be read (password authentication '
                                     'failed for user "ops" (***))') and not unread.value.late
        with pytest.raises(ValueError, match="not a message id"):
            await reader.run(mistaken)
        assert reader.answering

    asyncio.run(scenario())


def test_outbox_console_gives_every_page_a_database_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    import uvicorn
    from typer.testing import CliRunner

    import outbox.console
    from outbox.cli import app as cli

    url = f"sqlite:///{tmp_path}/orders.db"
    Outbox(create_engine(url)).create_tables()
    monkeypatch.delenv("OUTBOX_CONSOLE_TOKEN", raising=False)
    monkeypatch.delenv("OUTBOX_CONSOLE_USERS", raising=False)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    given: list[Any] = []
    made = outbox.console.create_app
    monkeypatch.setattr(outbox.console, "create_app",
                        lambda *a, **k: given.append(k.get("database_timeout")) or made(*a, **k))
    assert CliRunner().invoke(cli, ["console", "--db", url]).exit_code == 0
    assert CliRunner().invoke(cli, ["console", "--db", url, "--database-timeout", "2.5"]).exit_code == 0
    assert given == [10.0, 2.5]
    # python -m outbox in this process; the stubs stay (a console that failed to refuse returns 0)
    for wrong, why in ((["--database-timeout", "0"], "greater than or equal to 0.1"),
                       (["--database-timeout", "2", "--tenants", "schema:a"], "--tenant-timeout")):
        result = outbox_in_process(capfd, "console", "--db", url, *wrong, cwd=tmp_path)
        (line,) = result.stderr.splitlines()
        assert result.returncode == 2 and line.startswith("error:") and "--database-timeout" in line, line
        assert why in line, line


def test_a_value_the_database_refuses_is_a_400_not_the_database_unreadable(
        postgres_db: str, caplog: pytest.LogCaptureFixture) -> None:
    """Attack 38: a NUL in a query field (``?group=%00``, a topic, a key, a page's ``after``) reached
    PostgreSQL, which refuses NUL in text (a ``DataError``): the reader took it for a database that
    cannot be read, a 503 saying so about a healthy database, the client's fault shown as an outage."""
    caplog.set_level(logging.INFO)
    engine = create_engine(postgres_db)
    Outbox(engine).create_tables()
    # A generous bound: what is proved is the kind of error, not its speed, and the first page's
    # connection on a loaded CI host took more than TIMEOUT (a 503 "did not answer within 1 s").
    client = TestClient(create_app(Outbox(engine), database_timeout=30.0), base_url="http://127.0.0.1",
                        raise_server_exceptions=False)
    try:
        for path in ["/parked?group=a%00b", "/held?group=%00", "/failed?topic=%00",
                     "/parked/key?group=g&topic=t&key=%00",
                     "/parked?group=g&after=%5B%22%5Cu0000%22,%22k%22%5D"]:  # ["\u0000","k"]
            page = client.get(path)
            assert page.status_code == 400 and "could not be read" not in page.text, (path, page.text[-300:])
            assert "refused a value of this request" in page.text and "NUL" in page.text, page.text[-300:]
            assert client.get("/failed").status_code == 200  # the database is fine, and so are its pages
    finally:
        engine.dispose()
    no_traceback_nor_password(caplog)
