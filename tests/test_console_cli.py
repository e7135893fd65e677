"""``outbox console`` as an operator starts it, and ``outbox demo --console``'s consoles."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from outbox import Inbox, Outbox, create_engine
from outbox.cli import app
from outbox.testing import free_port, wait_until_bound
from tests.console_support import TOKEN
from tests.inbox_support import record


def outside_addresses() -> list[str]:
    """This host's address on its default route, if it has one besides loopback (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            address = s.getsockname()[0]
    except OSError:
        return []
    return [] if address.startswith("127.") else [address]


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_outbox_console_serves_on_localhost_until_interrupted(sqlite_db: str, tmp_path: Path) -> None:
    Outbox(create_engine(sqlite_db)).create_tables()
    inbox_db = f"sqlite:///{tmp_path / 'shipping.db'}"
    shipping = Inbox(create_engine(inbox_db), group="shipping")
    shipping.create_tables()
    shipping.handler("orders")(lambda session, message: None)
    shipping.handle(record("orders", "gap-1", 2))  # held in the consumer's own database
    port = free_port()
    env = {**os.environ, "OUTBOX_CONSOLE_TOKEN": TOKEN}
    command = [sys.executable, "-m", "outbox", "console", "--db", sqlite_db, "--port", str(port),
               "--inbox-db", inbox_db]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_bound(proc.pid, port, "the console", alive=lambda: proc.poll() is None)
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _ = get(f"http://127.0.0.1:{port}/login")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, "the console did not start"
                time.sleep(0.2)
        assert status == 200
        ok, page = get(f"http://127.0.0.1:{port}/",
                       {"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "probe"})
        assert ok == 200 and "nothing stuck" in page
        ok, page = get(f"http://127.0.0.1:{port}/trace?topic=orders&key=gap-1",
                       {"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "probe"})
        assert ok == 200 and "group shipping" in page and "waiting for seq 1" in page, page
        for address in outside_addresses()[:1]:  # bound to 127.0.0.1: the host's other address refuses
            with pytest.raises(urllib.error.URLError):
                get(f"http://{address}:{port}/login")
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    # Ctrl-C is how an operator stops it: a clean shutdown, exit 0, no traceback.
    assert proc.returncode == 0 and "Application shutdown complete" in out, out
    assert "Traceback" not in out, out
    assert f"outbox console on http://127.0.0.1:{port}/" in out


def test_outbox_console_names_a_missing_database_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["console", "--db", f"sqlite:///{tmp_path / 'nope.db'}"])
    assert result.exit_code != 0 and "does not exist" in result.output
    ready = f"sqlite:///{tmp_path / 'ready.db'}"
    Outbox(create_engine(ready)).create_tables()
    gone = f"sqlite:///{tmp_path / 'gone.db'}"
    result = CliRunner().invoke(app, ["console", "--db", ready, "--inbox-db", gone])
    assert result.exit_code != 0 and "gone.db does not exist" in result.output


def test_demo_console_mounts_orders_and_billing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox.console import Operators
    from outbox.demo._console import demo_console

    Outbox(create_engine(f"sqlite:///{tmp_path / 'orders.db'}")).create_tables()
    client = TestClient(demo_console(tmp_path, Operators(token=TOKEN)), base_url="http://127.0.0.1")
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Outbox-Operator": "demo"}
    for path in ("/orders/", "/billing/", "/billing/parked?group=billing", "/billing/parked/billing"):
        page = client.get(path, headers=auth)
        assert page.status_code == 200, (path, page.text)
    assert "replay enabled for: billing" in client.get("/billing/", headers=auth).text

    served: list[tuple[Path, int]] = []
    monkeypatch.setattr("outbox.demo.run_demo", lambda orders, workdir: 0)
    monkeypatch.setattr("outbox.demo._console.serve_console",
                        lambda workdir, port: served.append((workdir, port)))
    result = CliRunner().invoke(app, ["demo", "--console", "--port", "9999", "--workdir", str(tmp_path)])
    assert result.exit_code == 0 and served == [(tmp_path, 9999)]


def test_an_app_on_another_database_than_db_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    listed, other = (f"sqlite:///{tmp_path / name}" for name in ("listed.db", "other.db"))
    for url in (listed, other):
        Outbox(create_engine(url)).create_tables()
    (tmp_path / "elsewhere_app.py").write_text(
        f"from outbox import Inbox, create_engine\ninbox = Inbox(create_engine({other!r}), group='g')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the console started"))
    result = CliRunner().invoke(app, ["console", "--db", listed, "--app", "elsewhere_app:inbox"])
    assert result.exit_code == 2 and "another database than --db" in result.output


def test_a_network_address_without_a_credential_is_refused(
    sqlite_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    Outbox(create_engine(sqlite_db)).create_tables()
    monkeypatch.delenv("OUTBOX_CONSOLE_TOKEN", raising=False)
    monkeypatch.delenv("OUTBOX_CONSOLE_USERS", raising=False)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("the console started"))
    result = CliRunner().invoke(app, ["console", "--db", sqlite_db, "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "needs OUTBOX_CONSOLE_TOKEN" in result.output


def test_ctrl_c_stops_the_console_quietly_even_after_pyspark_took_sigint() -> None:
    """PySpark's SparkContext replaces the SIGINT handler with one that raises (the demo's audit
    runs before its console); uvicorn re-raises the signal it caught when it stops."""
    import os
    import threading

    import uvicorn

    from outbox.console._serve import serve_until_stopped

    def pyspark_like(*_: object) -> None:
        raise KeyboardInterrupt

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    previous = signal.signal(signal.SIGINT, pyspark_like)
    try:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        def interrupt() -> None:
            deadline = time.monotonic() + 60
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        serve_until_stopped(server)  # returns; a KeyboardInterrupt would fail the test
        assert signal.getsignal(signal.SIGINT) is pyspark_like  # put back as it was
    finally:
        signal.signal(signal.SIGINT, previous)


def test_behind_a_trusted_proxy_cookies_are_secure_and_guesses_count_per_real_client(
    sqlite_db: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The reverse-proxy setup of docs/security.md: X-Forwarded-* believed from the proxy named only."""
    import logging

    import uvicorn

    from tests.console_support import csrf_of

    Outbox(create_engine(sqlite_db)).create_tables()
    monkeypatch.setenv("OUTBOX_CONSOLE_TOKEN", TOKEN)
    monkeypatch.delenv("OUTBOX_CONSOLE_USERS", raising=False)
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: configs.append(self.config))
    result = CliRunner().invoke(app, ["console", "--db", sqlite_db, "--forwarded-allow-ips", "10.0.0.5",
                                      "--max-body", "2048", "--session-idle", "60"])
    assert result.exit_code == 0, result.output
    [config] = configs
    config.load()
    forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "198.51.100.9"}
    proxy = TestClient(config.loaded_app, base_url="http://127.0.0.1", client=("10.0.0.5", 4000),
                       headers=forwarded)
    caplog.set_level(logging.INFO, logger="outbox.console.audit")

    def sign_in(client: TestClient, token: str) -> Any:
        page = client.get("/login")  # its CSRF cookie is Secure when the request counts as https:
        cookie = (page.headers.get("set-cookie", "").split(";")[0]  # sent back by hand, as https would
                  or f"outbox_console_csrf={client.cookies['outbox_console_csrf']}")
        return client.post("/login", data={"csrf": csrf_of(page.text), "name": "bob", "token": token},
                           headers={"Cookie": cookie})

    signed = sign_in(proxy, TOKEN)
    assert signed.status_code == 200 and "; secure" in signed.headers["set-cookie"].lower()
    assert sign_in(proxy, "w" * 20).status_code == 401
    assert "from client 198.51.100.9" in caplog.text
    assert proxy.post("/login", content=b"x" * 4096).status_code == 413  # --max-body reached the app
    # Any other peer's forwarded headers are not believed: its own address counts, the cookie is plain.
    stranger = TestClient(config.loaded_app, base_url="http://127.0.0.1", client=("10.0.0.6", 4000),
                          headers=forwarded)
    plain = sign_in(stranger, TOKEN)
    assert plain.status_code == 200 and "secure" not in plain.headers["set-cookie"].lower()
    assert sign_in(stranger, "w" * 20).status_code == 401 and "from client 10.0.0.6" in caplog.text


def test_a_client_that_never_finishes_its_request_is_cut_off(
    sqlite_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slowloris: uvicorn alone kept a silent connection, a half-sent header or a half-sent body
    open for good (a file descriptor each, anonymous). As ``outbox console`` serves it, each
    request must arrive whole within ``REQUEST_TIMEOUT``; a complete one is answered as before."""
    import threading

    import uvicorn

    from outbox.console import _serve

    Outbox(create_engine(sqlite_db)).create_tables()
    monkeypatch.delenv("OUTBOX_CONSOLE_TOKEN", raising=False)
    monkeypatch.delenv("OUTBOX_CONSOLE_USERS", raising=False)
    monkeypatch.setattr(_serve, "REQUEST_TIMEOUT", 0.5)
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: configs.append(self.config))
    assert CliRunner().invoke(app, ["console", "--db", sqlite_db]).exit_code == 0
    monkeypatch.undo()
    monkeypatch.setattr(_serve, "REQUEST_TIMEOUT", 0.5)
    [config] = configs
    config.port = port = free_port()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "the console did not start"
            time.sleep(0.02)
        slow = [b"", b"GET / HTTP/1.1\r\nHost: x\r\nX-a: b",
                b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab"]
        sockets = []
        for first in slow:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(first)
            s.settimeout(10)
            sockets.append(s)
        for first, s in zip(slow, sockets, strict=True):
            started = time.monotonic()
            try:
                while s.recv(4096):  # an early answer (a refusal) may come first; then the close
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                pytest.fail(f"{first!r} still held its connection after 10 s")
            assert time.monotonic() - started < 5, f"{first!r} held its connection"
            s.close()
        assert get(f"http://127.0.0.1:{port}/ping")[0] == 200
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_app_on_db_spelled_otherwise_is_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One database in two spellings is one (its file says so): not "another database"."""
    import uvicorn

    listed = f"sqlite:///{tmp_path / 'listed.db'}"
    Outbox(create_engine(listed)).create_tables()
    respelled = f"sqlite:///{tmp_path}/./listed.db"
    (tmp_path / "respelled_app.py").write_text(
        f"from outbox import Inbox, create_engine\ninbox = Inbox(create_engine({respelled!r}), group='g')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    started: list[bool] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: started.append(True))
    result = CliRunner().invoke(app, ["console", "--db", listed, "--app", "respelled_app:inbox"])
    assert result.exit_code == 0, result.output
    assert started == [True]
