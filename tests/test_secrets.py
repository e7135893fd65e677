"""No credential the library is given appears in a log line, a repr, an error or CLI output.

A recognisable secret (Hypothesis draws it, with characters that URLs must
escape) is put wherever a credential can go: a database URL's password or
``?password=``, a webhook URL's userinfo, path and ``?token=``, Kafka's SASL
and SSL-key passwords. Then the constructors, their error paths, failed
deliveries and failed CLI commands run with every logger at DEBUG, and the
secret, raw or percent-encoded, must be absent from everything they print.
The webhook's credentials are sent as HTTP Basic auth (the documented
choice): a local server checks that they arrive, and arrive only that way.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from _relay_helpers import wait_for
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from outbox import Alert, ConfigurationError, WebhookAlertSink
from outbox.cli import app
from outbox.core._alerts import deliver
from outbox.core._secrets import database_secrets
from outbox.testing import free_port

secrets = st.builds(lambda middle: f"S3cr3t{middle}Zz9q", st.text(
    st.sampled_from("abcXYZ019@:/?#%&+= -_.~!$'()*,;[]é"), min_size=2, max_size=12))
"""A credential: recognisable, and full of what a URL must percent-encode."""

SWEEP = settings(max_examples=15, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def leaks(secret: str, *texts: str) -> list[str]:
    """The texts that show ``secret``, as given, as a URL carries it, or a piece of it (its ends).

    A password that URL parsing cut apart (an unescaped ``@``) leaks by pieces: its
    start and its end are recognisable, so they must not show either.
    """
    forms = {secret, quote(secret, safe=""), quote(secret), secret[:6], secret[-4:]}
    return [text for text in texts if any(form in text for form in forms)]


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog


ALERT = Alert(kind="key_parked", topic="orders", key="k", message_id="m", error="boom")


class Hook(BaseHTTPRequestHandler):
    """A webhook receiver: answers ``status`` (a redirect to ``location`` for 3xx) and records the request."""

    status = 204
    location = ""
    seen: list[tuple[str, str | None]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Hook.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(self.status)
        if self.location:
            self.send_header("Location", self.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def hook() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@SWEEP
@given(secret=secrets, status=st.sampled_from([204, 500, 302, 307]))
def test_webhook_credentials_go_as_basic_auth_and_are_never_shown(
    debug_logs: pytest.LogCaptureFixture, hook: int, secret: str, status: int
) -> None:
    debug_logs.clear()
    Hook.status, Hook.location, Hook.seen = status, f"http://127.0.0.1:{hook}/elsewhere", []
    encoded = quote(secret, safe="")
    url = f"http://ops:{encoded}@127.0.0.1:{hook}/hooks/{encoded}?token={encoded}"
    sink = WebhookAlertSink(url)
    deliver(sink, ALERT)
    path, authorization = Hook.seen[0]
    assert len(Hook.seen) == 1  # a redirect is not followed: it would carry Authorization along
    assert authorization == "Basic " + base64.b64encode(f"ops:{secret}".encode()).decode()
    assert path == f"/hooks/{encoded}?token={encoded}"
    failed = [r for r in debug_logs.records if r.name == "outbox.alerts" and r.levelno == logging.ERROR]
    assert bool(failed) == (status != 204)
    assert not leaks(secret, repr(sink), str(sink), debug_logs.text)


@SWEEP
@given(secret=secrets)
def test_a_webhook_that_cannot_be_reached_fails_without_showing_its_url(
    debug_logs: pytest.LogCaptureFixture, secret: str
) -> None:
    debug_logs.clear()
    encoded = quote(secret, safe="")
    sink = WebhookAlertSink(f"https://{encoded}:{encoded}@127.0.0.1:{free_port()}/{encoded}?token={encoded}",
                            timeout=2)
    with pytest.raises(ConnectionError) as failure:
        sink(ALERT)
    deliver(sink, ALERT)
    assert "127.0.0.1" in str(failure.value)  # it names where it went, not how
    assert not leaks(secret, str(failure.value), repr(failure.value), debug_logs.text)


@SWEEP
@given(secret=secrets, shape=st.sampled_from([
    "ftp://ops:{s}@host/x", "https://ops:{s}@host:port{s}/x", "https://ops:{s}@/x",
    "https://host/a b?token={s}", "https://host/x\n?token={s}", "ops:{s}@host/x",
]))
def test_a_malformed_webhook_url_is_refused_without_showing_it(secret: str, shape: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        WebhookAlertSink(shape.format(s=quote(secret, safe="")))
    assert not leaks(secret, str(refused.value))


def test_credentials_in_the_url_and_an_authorization_header_are_refused_together() -> None:
    with pytest.raises(ConfigurationError, match="Authorization"):
        WebhookAlertSink("https://ops:pw@host/x", headers={"authorization": "Bearer t"})


DATABASE_URLS = [
    "postgresql+psycopg://ops:{s}@127.0.0.1:{port}/db",     # the server does not answer
    "postgresql+psycopg://ops@127.0.0.1:{port}/db?password={s}",
    "postgresql+psycopg://ops:{s}@127.0.0.1:notaport/db",   # the port does not parse
    "postgresql+psycopg://ops:{raw}@127.0.0.1:{port}/db",   # unescaped: parsing cuts it apart
    "postgresql+psycopg://ops:S3cr3t/ab@{raw}@127.0.0.1:{port}/db",  # surely cut: an @ and a /
    "ops:{s}@127.0.0.1/db",                                  # not a URL at all
    "nosuchdialect://ops:{s}@127.0.0.1/db",
    "postgresql+asyncpg://ops:{s}@127.0.0.1:{port}/db",     # refused: an asyncio driver
]


@pytest.mark.parametrize("shape", DATABASE_URLS)
@settings(SWEEP, max_examples=8)
@given(secret=secrets, command=st.sampled_from([["stats"], ["failed", "list"], ["status"]]))
def test_a_failed_command_never_shows_the_database_password(
    debug_logs: pytest.LogCaptureFixture, secret: str, shape: str, command: list[str]
) -> None:
    debug_logs.clear()
    url = shape.format(s=quote(secret, safe=""), raw=secret, port=free_port())
    result = CliRunner().invoke(app, [*command, "--db", url])
    assert result.exit_code in (1, 2), result.output
    assert "error:" in result.output
    assert not leaks(secret, result.output, debug_logs.text)


@SWEEP
@given(secret=secrets)
def test_kafka_passwords_stay_out_of_reprs_errors_and_librdkafka_logs(
    debug_logs: pytest.LogCaptureFixture, secret: str
) -> None:
    from transports.kafka import KafkaSource, KafkaTransport

    debug_logs.clear()
    credentials: dict[str, Any] = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
                   "sasl_plain_username": "svc", "sasl_plain_password": secret,
                   "ssl_password": secret, "sasl.oauthbearer.client.secret": secret}
    shown: list[str] = []
    transport = KafkaTransport(bootstrap_servers="127.0.0.1:9", debug="conf", **credentials)
    shown.append(repr(transport))
    transport.close(0.1)
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                         settings={"debug": "conf", **credentials})
    shown.append(repr(source))
    source.poll(1, 0.1)
    source.close()
    bad: list[Callable[[], object]] = [
        lambda: KafkaTransport(bootstrap_servers="127.0.0.1:9", **{**credentials,
                                                                  "security_protocol": secret}),
        lambda: KafkaTransport(bootstrap_servers="127.0.0.1:9", **credentials, no_such_setting=1),
        lambda: KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                            settings={**credentials, "sasl.mechanism": secret}),
    ]
    for build in bad:
        with pytest.raises(ConfigurationError) as refused:
            build()
        shown.append(str(refused.value))
    assert any("CONF" in r.getMessage() for r in debug_logs.records)  # librdkafka did talk
    assert not leaks(secret, *shown, debug_logs.text)


@pytest.mark.parametrize("pair", ["sasl.password:{s}", "sasl.password {s}", "{s}"])
def test_a_malformed_kafka_setting_is_not_echoed_with_its_value(pair: str) -> None:
    secret = "S3cr3t:pw"
    result = CliRunner().invoke(app, ["relay", "--db", "sqlite:///nowhere.db", "--bootstrap-servers",
                                      "127.0.0.1:9", "-X", pair.format(s=secret)])
    assert result.exit_code == 2 and "KEY=VALUE" in result.output, result.output
    assert not leaks(secret, result.output)


@pytest.mark.slow
def test_a_relay_waiting_for_its_database_logs_no_credential_at_debug(tmp_path: Path) -> None:
    secret = "S3cr3t-relay-pw"
    log = tmp_path / "relay.log"
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox", "relay", "--log-level", "DEBUG",
         "--db", f"postgresql+psycopg://ops:{secret}@127.0.0.1:{free_port()}/db?password={secret}",
         "--bootstrap-servers", "127.0.0.1:9", "-X", f"sasl.password={secret}",
         "--webhook", f"https://ops:{secret}@hooks.example/{secret}?token={secret}"],
        env={**os.environ}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "unreachable" in log.read_text() or relay.poll() is not None, 30,
                 "the relay to report its database")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    output = log.read_text()
    assert "ops:***@127.0.0.1" in output, output  # it names the database it waits for
    assert not leaks(secret, output)


@SWEEP
@given(secret=secrets)
@example(secret="S3cr3t/ab@cdZz9q")  # the host becomes "cdZz9q@127.0.0.1"
@example(secret="S3cr3t@ab/cdZz9q")  # the host becomes "ab", the database "cdZz9q@…"
def test_readyz_never_serves_a_piece_of_the_database_password(secret: str) -> None:
    from sqlalchemy.exc import ArgumentError

    from outbox import create_engine
    from outbox.ops import DatabaseCheck

    port = free_port()
    for url in (f"postgresql+psycopg://ops:{quote(secret, safe='')}@127.0.0.1:{port}/db",
                f"postgresql+psycopg://ops:{secret}@127.0.0.1:{port}/db"):  # unescaped: cut apart
        try:
            engine = create_engine(url)
        except (ArgumentError, ValueError):
            continue  # refused before any connection: nothing to serve
        reason = DatabaseCheck(engine, timeout=5)()
        assert reason is not None and reason.startswith("database")
        assert not leaks(secret, reason), reason


@settings(max_examples=200, deadline=None)
@example("Pg@Secret:99")
@given(st.text(alphabet="abcdefXYZ0123456789@:/", min_size=8, max_size=24).filter(
    lambda p: any(c in p for c in "@:/")))
def test_an_unencoded_password_that_breaks_the_url_is_a_clear_error_without_it(password: str) -> None:
    """``create_engine`` with ``@``, ``:`` or ``/`` left in the password: it parses, or it refuses
    with a ``ConfigurationError`` that says to percent-encode and quotes no piece of the password
    (SQLAlchemy's own ``invalid literal for int() … '99@127.0.0.1'`` names neither)."""
    from outbox import create_engine

    url = f"postgresql+psycopg://app:{password}@db.example:5432/app"
    try:
        create_engine(url).dispose()
    except ConfigurationError as exc:
        assert "percent-encode" in str(exc)
        for piece in database_secrets(url):
            assert piece not in str(exc), (piece, str(exc))


@pytest.mark.parametrize("key", ["sasl.oauthbearer.assertion.private.key.passphrase",
                                 "sasl.oauthbearer.assertion.private.key.pem"])
def test_the_oauth_assertion_key_and_its_passphrase_stay_out_of_reprs(key: str) -> None:
    """librdkafka 2.10+ signs OAUTHBEARER assertions with a private key given in the settings;
    neither "password" nor "secret" is in these names, and their values were shown in reprs."""
    from transports.kafka import KafkaSource, KafkaTransport

    secret = "S3cr3t-assertion-key-Zz9q"
    transport = KafkaTransport(bootstrap_servers="127.0.0.1:9", **{key: secret})
    shown = repr(transport)
    transport.close(0.1)
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], settings={key: secret})
    shown += repr(source)
    source.close()
    assert secret not in shown and key in shown
