"""Alerts for what is stuck, not only what failed.

A relay key whose head keeps being retried raises one ``key_stuck`` alert and
counts in ``outbox_relay_stuck_keys``; a broker outage (nothing delivered,
no attempt counted) raises none. A consumer's gap held longer than
``gap_alert_after`` raises one ``gap_held`` alert, before the key parks at
``gap_timeout``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
import tenacity
from _relay_helpers import ScriptedTransport, publish, wait_for
from inbox_support import TOPIC, AlertLog, apply_effect, business, record
from prometheus_client import CollectorRegistry

from outbox import Alert, ConfigurationError, Inbox, Outbox, Relay
from outbox.relay import relay_metrics
from transports import Outcome, Record, SendResult


def gauge(registry: CollectorRegistry, worker: str) -> float | None:
    return registry.get_sample_value("outbox_relay_stuck_keys", {"worker": worker})


@contextmanager
def running(relay: Relay) -> Iterator[None]:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        relay.stop()
        thread.join(20)
        assert not thread.is_alive()


@pytest.mark.slow
def test_a_head_retried_past_the_threshold_alerts_once_and_the_gauge_follows(outbox: Outbox) -> None:
    ids = publish(outbox, "orders", ["a", "a", "b"])
    alerts: list[Alert] = []
    registry = CollectorRegistry()
    # 100 retries 0.05 s apart: stuck for 5 s at least, so a loaded host's second between the alert
    # and the look at the gauge, or in the second below, cannot see the head delivered already.
    transport = ScriptedTransport({str(ids[0]): [Outcome.RETRY] * 100})
    relay = Relay(outbox, transport, alert=alerts.append, backoff=tenacity.wait_fixed(0.05),
                  lease_ttl=0.6, key_stuck_after=0.5, metrics=relay_metrics(registry), worker_id="w")
    stuck = [a for a in alerts if a.kind == "key_stuck"]
    with running(relay):
        wait_for(lambda: [a for a in alerts if a.kind == "key_stuck"], 15, "a key_stuck alert")
        assert gauge(registry, "w") == 1
        time.sleep(1.0)  # five more checks while still stuck: no second alert
        stuck = [a for a in alerts if a.kind == "key_stuck"]
        assert len(stuck) == 1
        wait_for(lambda: len(transport.sent) == 3, 60, "the head to be delivered at last")
        wait_for(lambda: gauge(registry, "w") == 0, 10, "the gauge to drop")
    alert = stuck[0]
    assert (alert.topic, alert.key, alert.message_id) == ("orders", "a", str(ids[0]))
    assert alert.error == "scripted retry"
    assert alert.details["attempts"] >= 1 and alert.details["waiting"] == 1
    assert alert.details["retrying_for_s"] >= 0.5
    assert [a.kind for a in alerts] == ["key_stuck"]


class Unreachable:
    """A broker that never answers: every record is a retry for want of an answer."""

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        return [SendResult(Outcome.RETRY, error="timed out", unreachable=True) for _ in records]

    def close(self, timeout: float = 10.0) -> None:
        pass


def test_a_broker_outage_makes_no_key_stuck(outbox: Outbox) -> None:
    publish(outbox, "orders", ["a", "a", "b"])
    alerts: list[Alert] = []
    registry = CollectorRegistry()
    relay = Relay(outbox, Unreachable(), alert=alerts.append, lease_ttl=0.6, key_stuck_after=0.2,
                  metrics=relay_metrics(registry), worker_id="w")
    with running(relay):
        time.sleep(2.0)
        assert gauge(registry, "w") == 0
    assert alerts == []


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_key_stuck_after_must_be_positive_seconds(outbox: Outbox, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="key_stuck_after"):
        Relay(outbox, ScriptedTransport(), key_stuck_after=bad)  # type: ignore[arg-type]


def test_a_gap_held_past_the_alert_threshold_alerts_once_before_it_parks(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's clock is the test's: a loaded host that takes seconds between two calls
    must not turn "not held for long yet" into an alert (it did, in CI: held for 3.3 s)."""
    alerts = AlertLog()
    inbox = Inbox(engine, group="billing", gap_timeout=60, gap_alert_after=0.2, alert=alerts)
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler(TOPIC)(apply_effect)
    sweep_at = {"now": datetime.now(UTC)}  # before seq 4 arrives: no gap is older than this
    monkeypatch.setattr("outbox.inbox._gaps.utcnow", lambda: sweep_at["now"])
    inbox.handle(record(TOPIC, "a", 1))
    inbox.handle(record(TOPIC, "a", 4))
    inbox.sweep()
    assert list(alerts) == []  # held, but not for long yet
    sweep_at["now"] = datetime.now(UTC) + timedelta(seconds=0.3)  # held at least 0.3 s of a 0.2 s threshold
    inbox.sweep()
    inbox.sweep()
    [alert] = alerts
    assert (alert.kind, alert.topic, alert.key, alert.group) == ("gap_held", TOPIC, "a", "billing")
    assert alert.error.startswith("seq 2 to 3 missing; seq 4 held for")
    assert alert.details["missing_from"] == 2 and alert.details["held_for_s"] >= 0.3
    assert alert.details["parks_in_s"] < 60
    assert inbox.parked() == []  # only a warning: the key parks at gap_timeout
    inbox.handle(record(TOPIC, "a", 2))
    inbox.handle(record(TOPIC, "a", 3))  # fills the gap: 4 is applied right after
    inbox.sweep()
    assert len(alerts) == 1


@pytest.mark.parametrize("kwargs", [{"gap_alert_after": 60}, {"gap_alert_after": 0},
                                    {"gap_timeout": 10, "gap_alert_after": 10}])
def test_gap_alert_after_must_be_below_the_gap_timeout(engine: sa.Engine, kwargs: dict) -> None:
    with pytest.raises(ConfigurationError, match="gap_alert_after"):
        Inbox(engine, group="g", **kwargs)
