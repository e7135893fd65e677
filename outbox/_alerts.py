"""Alert sinks: where the relay and the inbox report what needs a person.

An alert is raised once per incident (a key parks, a row fails for good), never
per retry. Sinks must not raise into the caller: a failing sink is logged and
the relay or inbox carries on, because losing an alert is better than stopping
every other key.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from transports._logsafe import safe_logger

from ._envelope import utcnow

log = safe_logger("outbox.alerts")


@dataclass(frozen=True, slots=True)
class Alert:
    """One incident: ``kind`` is e.g. ``"key_parked"`` or ``"message_failed"``."""

    kind: str
    topic: str
    key: str | None
    message_id: str | None
    error: str
    group: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    raised_at: datetime = field(default_factory=utcnow)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["raised_at"] = self.raised_at.isoformat()
        return body


@runtime_checkable
class AlertSink(Protocol):
    """Receives alerts; called from the relay's or inbox's worker thread."""

    def __call__(self, alert: Alert) -> None: ...


class LoggingAlertSink:
    """The default: one ERROR log line per alert, on logger ``outbox.alerts``."""

    def __call__(self, alert: Alert) -> None:
        log.error(
            "ALERT %s topic=%s key=%s message_id=%s group=%s: %s",
            alert.kind, alert.topic, alert.key, alert.message_id, alert.group, alert.error,
        )


class WebhookAlertSink:
    """POSTs the alert as a JSON body to ``url`` (Slack/PagerDuty bridges, Alertmanager)."""

    def __init__(self, url: str, *, timeout: float = 5.0, headers: dict[str, str] | None = None):
        if not url.startswith(("http://", "https://")):
            from ._errors import ConfigurationError

            raise ConfigurationError(f"webhook url must be http(s), got {url!r}")
        self.url = url
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def __call__(self, alert: Alert) -> None:
        body = json.dumps(alert.to_json()).encode()
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            response.read()

    def __repr__(self) -> str:
        return f"WebhookAlertSink({self.url.split('?')[0]!r})"


def deliver(sink: AlertSink | Callable[[Alert], None], alert: Alert) -> None:
    """Call the sink; log instead of raising if it fails."""
    try:
        sink(alert)
    except Exception:
        log.exception("alert sink %r failed for %s on %s/%s", sink, alert.kind, alert.topic, alert.key)
