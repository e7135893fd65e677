"""Alert sinks: where the relay and the inbox report what needs a person.

An alert is raised once per incident (a key parks, a row fails for good), never
per retry. Sinks must not raise into the caller: a failing sink is logged and
the relay or inbox carries on, because losing an alert is better than stopping
every other key.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote

from transports._logsafe import safe_logger

from ._envelope import utcnow
from ._errors import ConfigurationError, OutboxError
from ._secrets import MASK, webhook_url
from ._tenant import check_tenant_name

log = safe_logger("outbox.alerts")


class AlertKind(StrEnum):
    """What an ``Alert`` is about; a ``str`` enum, so JSON and logs carry the same strings as before."""

    MESSAGE_FAILED = "message_failed"
    """The relay can never send an outbox row as it is: it is ``failed`` and blocks its key."""
    KEY_STUCK = "key_stuck"
    """A key's head has been retried by the relay for longer than ``key_stuck_after``."""
    KEY_PARKED = "key_parked"
    """The inbox parked a message and, with it, its key."""
    MESSAGE_PARKED = "message_parked"
    """The inbox parked a message alone; its key goes on."""
    FOREIGN_RECORD = "foreign_record"
    """A record without an outbox envelope arrived on a topic (once per topic and process)."""
    GAP_HELD = "gap_held"
    """The inbox holds a key's messages behind a missing seq."""


@dataclass(frozen=True, slots=True)
class Alert:
    """One incident: ``kind`` says what (``AlertKind``; its string value is accepted too)."""

    kind: AlertKind | str
    topic: str
    key: str | None
    message_id: str | None
    error: str
    group: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    raised_at: datetime = field(default_factory=utcnow)
    tenant: str | None = None
    """The tenant whose row or message this is (``None``: a single-tenant relay or inbox).

    Last, so that alerts built positionally keep their meaning; set by
    ``alerts_for_tenant``. Logs and webhook JSON carry it only when set, so a
    single-tenant deployment's alerts read exactly as before.
    """

    def __post_init__(self) -> None:
        try:
            kind = AlertKind(self.kind)
        except ValueError:
            raise ConfigurationError(f"Alert kind must be one of {', '.join(AlertKind)}, "
                                     f"got {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        if self.tenant is not None:
            check_tenant_name(self.tenant)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["raised_at"] = self.raised_at.isoformat()
        if self.tenant is None:
            del body["tenant"]
        return body


@runtime_checkable
class AlertSink(Protocol):
    """Receives alerts; called from the relay's or inbox's worker thread."""

    def __call__(self, alert: Alert) -> None: ...


class LoggingAlertSink:
    """The default: one ERROR log line per alert, on logger ``outbox.alerts``."""

    def __call__(self, alert: Alert) -> None:
        if alert.tenant is None:
            log.error(
                "ALERT %s topic=%s key=%s message_id=%s group=%s: %s",
                alert.kind, alert.topic, alert.key, alert.message_id, alert.group, alert.error,
            )
        else:
            log.error(
                "ALERT %s tenant=%s topic=%s key=%s message_id=%s group=%s: %s",
                alert.kind, alert.tenant, alert.topic, alert.key, alert.message_id, alert.group, alert.error,
            )


class TenantAlertSink:
    """Passes every alert on to ``sink`` with ``tenant`` set: the alerts of one tenant's relay or inbox.

    Nothing else changes: the wrapped sink's errors reach the caller as they
    would without the wrapper (``deliver`` logs them), and a sink that
    throttles or batches sees the stamped alerts. Build one per tenant, once.
    """

    __slots__ = ("sink", "tenant")

    def __init__(self, sink: AlertSink | Callable[[Alert], None], tenant: str) -> None:
        if not callable(sink):
            raise ConfigurationError(f"alert sink must be callable, got {type(sink).__name__}")
        self.sink = sink
        self.tenant = check_tenant_name(tenant)

    def __call__(self, alert: Alert) -> None:
        self.sink(replace(alert, tenant=self.tenant))

    def __repr__(self) -> str:
        return f"TenantAlertSink({self.sink!r}, tenant={self.tenant!r})"


def alerts_for_tenant(sink: AlertSink | Callable[[Alert], None], tenant: str) -> AlertSink:
    """``sink``, stamping ``tenant`` on every alert it receives (``TenantAlertSink``)."""
    return TenantAlertSink(sink, tenant)


class WebhookAlertSink:
    """POSTs the alert as a JSON body to ``url`` (Slack/PagerDuty bridges, Alertmanager).

    Credentials in the URL (``https://user:password@host/…``) are sent as HTTP
    Basic auth and taken out of the URL: urllib sends no userinfo, so such a
    URL could never authenticate otherwise. Percent-escapes in them are
    decoded (``p%40ss`` is the password ``p@ss``). Giving both them and an
    ``Authorization`` header is a ``ConfigurationError``. Over ``http://`` they
    travel in clear; a warning says so at construction.

    Redirects are not followed: a redirect would turn the POST into a GET and
    carry the ``Authorization`` header to whatever host it names.

    A webhook URL is often a secret as a whole (Slack's key is its path, others
    take a ``?token=``), so logs, ``repr`` and errors show only its scheme, host
    and port (``outbox.core._secrets.webhook_url``); a failed POST raises
    ``WebhookDeliveryError`` with the status or the reason and nothing of the
    URL's rest.
    """

    def __init__(self, url: str, *, timeout: float = 5.0, headers: dict[str, str] | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"webhook url must be http(s), got {_shown(url)}")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 -- a malformed port raises here, not at the first alert
        except ValueError:
            raise ConfigurationError(f"webhook url {webhook_url(url)} is malformed (its host or "
                                     f"port does not parse)") from None
        if not parts.hostname or any(c.isspace() or ord(c) < 32 for c in url):
            raise ConfigurationError(f"webhook url {webhook_url(url)} has no host, or contains "
                                     f"spaces or control characters")
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._secrets = [part for part in (parts.password, parts.username, parts.path, parts.query,
                                           parts.fragment) if part and len(part) > 1]
        if parts.username is not None or parts.password is not None:
            if any(name.lower() == "authorization" for name in self.headers):
                raise ConfigurationError(f"webhook url {webhook_url(url)} has credentials and an "
                                         f"Authorization header is given too: give one of them")
            pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
            if parts.scheme == "http":
                log.warning("webhook %s sends its credentials unencrypted (http://)", webhook_url(url))
            netloc = parts.netloc.rpartition("@")[2]
            url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        self.url = url
        """The URL POSTed to, without credentials; still a secret for many services: never log it."""
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_NoRedirects)

    def __call__(self, alert: Alert) -> None:
        body = json.dumps(alert.to_json()).encode()
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise WebhookDeliveryError(f"webhook {self} answered {exc.code} "
                                       f"{self._scrub(str(exc.reason))}") from None
        except Exception as exc:  # refused, unresolvable, timed out, TLS: the reason, never the URL
            reason = getattr(exc, "reason", None) or exc
            raise WebhookDeliveryError(f"webhook {self} failed: {type(exc).__name__}: "
                                       f"{self._scrub(str(reason))}") from None

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK).replace(unquote(secret), MASK)
        return text

    def __str__(self) -> str:
        return webhook_url(self.url)

    def __repr__(self) -> str:
        return f"WebhookAlertSink({webhook_url(self.url)!r})"


class WebhookDeliveryError(OutboxError, ConnectionError):
    """A webhook did not take an alert; the message names its host, never the rest of its URL."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def _shown(url: object) -> str:
    return webhook_url(url) if isinstance(url, str) else type(url).__name__


def deliver(sink: AlertSink | Callable[[Alert], None], alert: Alert) -> None:
    """Call the sink; log instead of raising if it fails."""
    try:
        sink(alert)
    except Exception:
        log.exception("alert sink %r failed for %s on %s%s/%s", sink, alert.kind,
                      "" if alert.tenant is None else f"tenant {alert.tenant} ", alert.topic, alert.key)
