"""Alerts say which tenant: the ``tenant`` field, ``alerts_for_tenant``, the log line and the webhook JSON."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import Alert, ConfigurationError, LoggingAlertSink, WebhookAlertSink
from outbox.tenants import MAX_TENANT_NAME, alerts_for_tenant

ALERT = Alert(kind="key_parked", topic="orders", key="k", message_id="m", error="boom", group="billing")
tenant_names = st.from_regex(rf"[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,{MAX_TENANT_NAME - 1}}}", fullmatch=True)


class Hook(BaseHTTPRequestHandler):
    """A webhook receiver that keeps every JSON body and answers ``status``."""

    status = 204
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        Hook.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def hook() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/alerts"
    server.shutdown()
    server.server_close()


@given(tenant=tenant_names)
def test_the_wrapper_stamps_its_tenant_and_changes_nothing_else(tenant: str) -> None:
    seen: list[Alert] = []
    alerts_for_tenant(seen.append, tenant)(ALERT)
    assert seen[0].tenant == tenant
    assert seen[0].to_json() == {**ALERT.to_json(), "tenant": tenant}
    assert ALERT.tenant is None and "tenant" not in ALERT.to_json()  # single-tenant JSON as before


def test_the_log_line_names_the_tenant_only_when_there_is_one(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="outbox.alerts")
    alerts_for_tenant(LoggingAlertSink(), "acme.eu-1")(ALERT)
    LoggingAlertSink()(ALERT)
    stamped, plain = (r.getMessage() for r in caplog.records)
    assert stamped == "ALERT key_parked tenant=acme.eu-1 topic=orders key=k message_id=m group=billing: boom"
    assert plain == "ALERT key_parked topic=orders key=k message_id=m group=billing: boom"


def test_the_webhook_posts_the_tenant_and_its_errors_still_reach_the_caller(hook: str) -> None:
    Hook.status, Hook.bodies = 204, []
    sink = alerts_for_tenant(WebhookAlertSink(hook), "acme")
    sink(ALERT)
    WebhookAlertSink(hook)(ALERT)
    assert Hook.bodies[0]["tenant"] == "acme"
    assert Hook.bodies[0] == {**Hook.bodies[1], "tenant": "acme", "raised_at": Hook.bodies[0]["raised_at"]}
    assert "tenant" not in Hook.bodies[1]
    Hook.status = 500
    with pytest.raises(ConnectionError, match="answered 500"):  # the wrapper hides no failure
        sink(ALERT)


@pytest.mark.parametrize("tenant", ["", "-x", "a b", "a" * (MAX_TENANT_NAME + 1), "é", 7, None])
def test_a_bad_tenant_is_refused_where_it_is_given(tenant: Any) -> None:
    with pytest.raises(ConfigurationError, match="tenant name"):
        alerts_for_tenant(LoggingAlertSink(), tenant)
    if tenant is not None:
        with pytest.raises(ConfigurationError, match="tenant name"):
            Alert(kind="key_parked", topic="t", key=None, message_id=None, error="e", tenant=tenant)
