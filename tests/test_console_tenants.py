"""One console over many tenants (``create_tenants_app``, ``outbox console --tenants``).

The fleet of ``tenant_support``: the root page names every tenant with what is stuck in it
or why it cannot be read; each tenant's pages and actions work on its own schema or
database and say which tenant they are; one tenant's database down is that tenant's error
page; the sign-in throttle and the session are one for the whole console, never one per
tenant; and no page or log line shows a database's password.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient
from typer.testing import CliRunner

from outbox.cli import app as cli_app
from outbox.console import Operators, create_tenants_app
from outbox.tenants import TenantDatabases, parse_tenants
from outbox.testing import free_port, wait_until_bound
from tests._retention_rows import outbox_row
from tests.console_support import csrf_of
from tests.tenant_support import SECRET, Fleet, tenant_fleet  # noqa: F401 (fixtures)
from tests.test_console_cli import get

USERS = {"alice": "wonderland-rabbit-hole"}
AUTH = ("alice", USERS["alice"])
TOKEN = "a-console-token-0123456789"


def console(fleet: Fleet, **kwargs: Any) -> tuple[TestClient, TenantDatabases]:
    databases = TenantDatabases(fleet.engine)
    tenants = parse_tenants(fleet.spec, fleet.engine)()
    app = create_tenants_app(tenants, databases, **{"operators": Operators(users=USERS), **kwargs})
    return TestClient(app, base_url="http://127.0.0.1"), databases


def failed_ids(fleet: Fleet, name: str) -> list[str]:
    table = fleet.outbox(name).tables.messages
    with fleet.engine.connect() as conn:
        return [str(i) for i in conn.execute(
            sa.select(table.c.message_id).where(table.c.status == "failed")).scalars()]


def test_the_root_names_every_tenants_findings_and_each_tenants_pages_are_its_own(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    fleet.create("a", "b", "second")
    with fleet.engine.begin() as conn:
        conn.execute(fleet.outbox("b").tables.messages.insert(), [outbox_row("failed", datetime.now(UTC))])
    client, databases = console(fleet)
    try:
        assert client.get("/").status_code == 401  # nothing without an operator
        root = client.get("/", auth=AUTH)
        assert root.status_code == 200, root.text
        page = root.text
        assert re.search(r'tenant <a href="/t/b/">b</a>: 1 failed outbox row', page)
        assert re.search(r'tenant <a href="/t/broken/">broken</a>: cannot read its status: no outbox tables',
                         page)
        assert re.search(r'tenant <a href="/t/down/">down</a>: cannot read its status: cannot reach', page)
        assert re.search(r'id="tenant-a">.*?<td>ok</td>', page, re.S)
        assert re.search(r'id="tenant-second">.*?<td>ok</td>', page, re.S)
        assert SECRET not in page
        with fleet.engine.begin() as conn:  # the root's report is reused, not read again per request
            conn.execute(fleet.outbox("a").tables.messages.insert(),
                         [outbox_row("failed", datetime.now(UTC))])
        assert client.get("/", auth=AUTH).text.count("failed outbox row") == 1

        (row,) = failed_ids(fleet, "b")
        b_failed = client.get("/t/b/failed", auth=AUTH)
        assert b_failed.status_code == 200 and 'id="tenant">tenant <strong>b</strong>' in b_failed.text
        assert f'value="{row}"' in b_failed.text
        assert f'value="{row}"' not in client.get("/t/a/failed", auth=AUTH).text
        assert client.get("/t/nobody/", auth=AUTH).status_code == 404
        down = client.get("/t/down/", auth=AUTH)
        assert down.status_code == 503 and "tenant down: " in down.text and "could not be read" in down.text
        assert SECRET not in down.text
        assert client.get("/t/second/", auth=AUTH).status_code == 200

        caplog.set_level(logging.INFO, logger="outbox.console.audit")
        done = client.post("/t/b/failed/retry", auth=AUTH, data={
            "csrf": csrf_of(b_failed.text), "message_id": str(row), "reason": "fixed upstream"})
        assert done.status_code in (200, 303), done.text
        assert failed_ids(fleet, "b") == []
        assert any("of tenant b by alice" in r.getMessage() for r in caplog.records)
    finally:
        databases.dispose()


def test_one_throttle_and_one_sign_in_for_every_tenant(fleet: Fleet) -> None:
    fleet.create("a", "b", "second")
    client, databases = console(fleet)
    try:
        # Five wrong passwords are free per client: spread over tenants, they still count as one.
        for name in ("a", "b", "second", "a", "b", "second"):
            assert client.get(f"/t/{name}/", auth=("alice", "wrong-password-here")).status_code == 401
        assert client.get("/t/broken/", auth=AUTH).status_code == 429
        assert client.get("/", auth=AUTH).status_code == 429
    finally:
        databases.dispose()

    token_client, databases = console(fleet, operators=Operators(token=TOKEN))
    try:
        login = token_client.get("/login")
        signed = token_client.post("/login", data={"csrf": csrf_of(login.text), "name": "bob",
                                                   "token": TOKEN})
        assert signed.status_code == 200, signed.text
        for path in ("/", "/t/a/", "/t/second/failed"):  # one sign-in, every tenant
            page = token_client.get(path, follow_redirects=False)
            assert page.status_code == 200 and "signed in as bob" in page.text, path
    finally:
        databases.dispose()


def test_outbox_console_tenants_serves_every_tenant_from_the_command_line(fleet: Fleet) -> None:
    fleet.create("a", "second")
    refused = CliRunner().invoke(cli_app, ["console", "--db", fleet.first, "--tenants", fleet.spec,
                                           "--inbox-db", fleet.second])
    assert refused.exit_code == 2 and "--inbox-db" in refused.output
    port = free_port()
    env = {**os.environ, "OUTBOX_CONSOLE_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "outbox", "console", "--db", fleet.first,
                             "--port", str(port), "--tenants", fleet.spec, "--tenant-timeout", "5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bearer = {"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "probe"}
    try:
        wait_until_bound(proc.pid, port, "the console", alive=lambda: proc.poll() is None)
        deadline = time.monotonic() + 60
        while True:
            try:
                status, page = get(f"http://127.0.0.1:{port}/", bearer)
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, "the console did not start"
                time.sleep(0.2)
        assert status == 200, page
        for name, state in (("a", "ok"), ("second", "ok"), ("broken", "unreadable"), ("down", "unreadable")):
            assert re.search(rf'id="tenant-{name}">.*?<td>(<span class="bad">)?{state}', page, re.S), name
        status, page = get(f"http://127.0.0.1:{port}/t/second/failed", bearer)
        assert status == 200 and "tenant <strong>second</strong>" in page
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
    assert SECRET not in output


def test_every_route_of_a_tenant_that_cannot_be_read_is_its_503_page(fleet: Fleet) -> None:
    """Issue 38 for the console of many tenants: each route of a tenant's console (the routes of
    ``create_app``, read from an app, so a new route is asked too) about a tenant whose schema has
    no tables or whose database refuses connections: its 503 page, or what the route does without a
    database; never a 500, and the other tenants' pages are served meanwhile."""
    import json
    import uuid

    from outbox import Outbox, create_engine
    from outbox.console import _csrf, create_app
    from tests.test_console_unreadable import READS

    fleet.create("a")  # "broken" keeps its schema without tables
    key = b"a-tenant-console-secret-0123"
    client, databases = console(fleet, secret=key)
    client.cookies.set(_csrf.COOKIE, "a-form-cookie")
    routes = create_app(Outbox(create_engine("sqlite://"))).routes
    problems = []
    try:
        for tenant in ("broken", "down"):
            for route in routes:
                reads = READS[route.path]  # a new route: say in READS what it reads
                path = f"/t/{tenant}" + route.path.replace("{group}", "g")
                query = {"group": "g", "topic": "orders", "key": "k", "id": str(uuid.uuid4()), "to": "on"}
                for method in sorted((getattr(route, "methods", None) or {"GET"}) - {"HEAD"}):
                    form = {"csrf": _csrf.form_token(key, "a-form-cookie"), "reason": "walk",
                            "message_id": query["id"], "lane": json.dumps(["orders", "k"]), "name": "x",
                            "token": "x"} if method == "POST" else None
                    answer = client.request(method, path, params=query, data=form, auth=AUTH,
                                            follow_redirects=False)
                    said = f"{method} {path} of tenant {tenant}: {answer.status_code}"
                    touches = reads in ("outbox", "db", "every") or (reads == "outbox-connection"
                                                                       and tenant == "down")
                    refused_first = (answer.status_code == 409  # replay: no --app inbox, no read
                                     and "start the console with --app" in answer.text)
                    if answer.status_code >= 500 and answer.status_code != 503:
                        problems.append(f"{said}: {answer.text[-300:]}")
                    elif touches and not refused_first and (
                            answer.status_code != 503 or f"tenant {tenant}: " not in answer.text
                            or not re.search("could not be read|no outbox or inbox tables", answer.text)):
                        problems.append(f"{said}, not its 503 page: {answer.text[-300:]}")
                    assert SECRET not in answer.text
                assert client.get("/t/a/", auth=AUTH).status_code == 200
    finally:
        databases.dispose()
    assert not problems, "\n".join(problems)
