"""The console in a real browser (Debian's chromium + chromium-driver, driven by Selenium).

A key parks through a real inbox; an operator signs in, opens the key and
replays it with a click, and the business table shows it applied. An action
without a credential and one with a forged CSRF token are refused, a
payload holding ``<script>`` shows as text and runs nothing, and a cookie
copied before signing out is refused after. Every page is
photographed: into a temporary folder, or into docs/console/ (the pictures
docs/operations.md shows) with ``UPDATE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Outbox
from tests.conftest import unavailable
from tests.console_support import TOKEN, broken_inbox, park
from tests.inbox_support import TOPIC, applied, record

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture
def browser() -> Iterator[object]:
    try:
        from selenium import webdriver
    except ImportError:
        unavailable("selenium is not installed (pip install -e '.[dev]')")
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_path:
        unavailable("no chromium / chromedriver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def serve(app: object) -> Iterator[str]:
    """Run ``app`` on uvicorn in a thread on a free port of 127.0.0.1; yields its address."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the console did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def still_parked(outbox: Outbox, key: str) -> bool:
    p = outbox.tables.inbox_parked
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        return conn.scalar(sa.select(sa.func.count()).where(p.c.key == key)) > 0


def test_replay_a_parked_key_with_a_click(outbox: Outbox, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    from outbox.console import Operators, create_app

    engine = outbox.engine
    assert isinstance(engine, sa.Engine)
    inbox, broken = broken_inbox(engine)
    park(inbox, "bad-1", range(1, 4), payload=b'{"note": "<script>alert(1)</script>"}')
    park(inbox, "bad-2", range(1, 3))
    park(inbox, "good", range(1, 3))
    inbox.handle(record(TOPIC, "late", 2))  # seq 1 never came: a held gap
    with Session(engine) as session, session.begin():
        for i in range(3):
            outbox.publish(session, "invoices", {"invoice": i}, key=f"inv-{i}")
    m = outbox.tables.messages
    with engine.begin() as conn:
        conn.execute(sa.update(m).where(m.c.key == "inv-0")
                     .values(status="failed", last_error="MSG_SIZE_TOO_LARGE: <b>1.2 MB</b>"))
    shots = ROOT / "docs" / "console" if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    app = create_app(outbox, inboxes=[inbox], operators=Operators(token=TOKEN))
    b = browser

    def shot(name: str) -> None:
        assert b.save_screenshot(str(shots / f"{name}.png")), name
        assert (shots / f"{name}.png").stat().st_size > 5000

    def no_script_ran() -> None:
        with pytest.raises(NoAlertPresentException):
            b.switch_to.alert  # noqa: B018  (an injected <script> would have opened one)

    def after_click(element_id: str) -> str:
        """The text of ``element_id`` on the page a click leads to (a click does not wait for it)."""
        from selenium.webdriver.support import expected_conditions as seen
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(b, 30).until(seen.presence_of_element_located((By.ID, element_id))).text

    def sign_in() -> None:
        b.get(f"{url}/login")
        b.find_element(By.NAME, "name").send_keys("alice")
        b.find_element(By.NAME, "token").send_keys(TOKEN)
        b.find_element(By.CSS_SELECTOR, "#login button").click()
        assert "signed in as alice" in after_click("result")

    with serve(app) as url:
        b.get(f"{url}/")
        assert b.current_url == f"{url}/login"  # a stranger sees nothing
        shot("login")
        sign_in()
        b.get(f"{url}/")
        assert "1 failed outbox row(s)" in b.page_source and "2 parked key(s)" in b.page_source
        counts = {name: b.find_element(By.CSS_SELECTOR, f"#nav-{name} .count").text
                  for name in ("failed", "parked", "held")}
        assert counts == {"failed": "1", "parked": "5", "held": "1"}
        shot("overview")
        b.get(f"{url}/failed")
        assert "MSG_SIZE_TOO_LARGE: <b>1.2 MB</b>" in b.find_element(By.ID, "failed").text
        shot("failed")
        b.get(f"{url}/held?group=billing")
        assert "late" in b.find_element(By.ID, "held").text
        shot("held")
        b.get(f"{url}/parked?group=billing")
        shot("parked")
        b.find_element(By.LINK_TEXT, "bad-1").click()
        payload = b.find_element(By.CSS_SELECTOR, "pre.payload").text
        assert payload == '{"note": "<script>alert(1)</script>"}'
        no_script_ran()
        shot("parked-key")

        broken["on"] = False  # the fix is deployed
        b.find_element(By.CSS_SELECTOR, "#replay-key input[name=reason]").send_keys("fixed in 1.2.3")
        b.find_element(By.ID, "replay").click()
        assert "bad-1: applied 3, key unparked" in after_click("result")
        shot("replayed")
        assert applied(engine, "bad-1") == [("bad-1", 1), ("bad-1", 2), ("bad-1", 3)]

        # Where is bad-2? The trace page from the navigation: the key, then one of its messages.
        b.get(f"{url}/")
        b.find_element(By.ID, "nav-trace").click()
        after_click("trace-form")
        b.find_element(By.NAME, "topic").send_keys(TOPIC)
        b.find_element(By.NAME, "key").send_keys("bad-2")
        b.find_element(By.ID, "trace").click()
        assert "2 parked message(s) (seqs 1, 2)" in after_click("key-position")
        shot("trace-key")
        b.find_elements(By.CSS_SELECTOR, "h3.message-title a")[1].click()
        assert "parked behind seq 1 of its key (never ran)" in after_click("trace-form") + b.page_source
        no_script_ran()
        shot("trace")

        # No credential: the page was open, the sign-in cookie is gone, the click is refused.
        b.get(f"{url}/parked/key?group=billing&topic={TOPIC}&key=bad-2")
        b.delete_cookie("outbox_console_operator")
        form = b.find_elements(By.CSS_SELECTOR, "form.discard")[0]
        form.find_element(By.NAME, "reason").send_keys("no credential")
        form.find_element(By.TAG_NAME, "button").click()
        assert "needs an operator credential" in after_click("error")
        assert still_parked(outbox, "bad-2")

        # A forged CSRF token: refused although the operator is signed in.
        sign_in()
        b.get(f"{url}/parked/key?group=billing&topic={TOPIC}&key=bad-2")
        form = b.find_elements(By.CSS_SELECTOR, "form.discard")[0]
        b.execute_script("arguments[0].querySelector('input[name=csrf]').value = '0'.repeat(64)", form)
        form.find_element(By.NAME, "reason").send_keys("forged")
        form.find_element(By.TAG_NAME, "button").click()
        assert "CSRF token is missing or wrong" in after_click("error")
        assert still_parked(outbox, "bad-2")
        no_script_ran()

        # Signing out ends the session on the server: a copy of the cookie taken before is refused.
        b.get(f"{url}/")
        copied = b.get_cookie("outbox_console_operator")
        assert copied is not None
        b.find_element(By.CSS_SELECTOR, "#logout button").click()
        assert "signed out" in after_click("result")
        b.add_cookie({"name": copied["name"], "value": copied["value"], "path": copied["path"]})
        b.get(f"{url}/failed")
        assert b.current_url == f"{url}/login"
