"""Prometheus metrics of the inbox, defined once per process and labelled by group.

prometheus-client refuses to register a name twice, so the collectors live at
module level and every ``Inbox`` (several in one test process, or one per
group in a service) takes its labelled children from here. Expose them with
``prometheus_client.start_http_server`` or your framework's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from ._signals import Disposition

_CONSUMED = Counter("outbox_inbox_consumed", "Records received from the broker.",
                    ["group", "topic"])
_DUPLICATES = Counter("outbox_inbox_duplicates_dropped",
                      "Deliveries dropped because they were already applied.", ["group", "topic"])
_HANDLED = Counter("outbox_inbox_handled", "Messages whose handler's writes committed.",
                   ["group", "topic"])
_FAILED = Counter("outbox_inbox_failed_attempts", "Handler attempts that raised.",
                  ["group", "topic"])
_PARKED = Counter("outbox_inbox_parked", "Messages moved to inbox_parked.",
                  ["group", "topic", "reason"])
_PARKED_KEYS = Gauge("outbox_inbox_parked_keys", "Keys currently parked (read from the database).",
                     ["group"])
_HELD = Counter("outbox_inbox_held", "Messages held because they arrived ahead of a gap.",
                ["group", "topic"])
_CONFLICTS = Counter("outbox_inbox_seq_conflicts",
                     "New message ids at or below their key's last seq, by verdict: expired, "
                     "restart, new_incarnation, before_start, key_parked, seq_conflict.",
                     ["group", "topic", "verdict"])
_DURATION = Histogram("outbox_inbox_handler_seconds",
                      "Handler run time per call (a batch handler's call covers its batch).",
                      ["group", "topic"],
                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
_COMMIT_LAG = Gauge("outbox_inbox_commit_lag",
                    "Records received but not yet committed back to the broker, per partition.",
                    ["group", "topic", "partition"])


@dataclass(frozen=True, slots=True)
class InboxMetrics:
    """The collectors bound to one consumer group."""

    group: str

    def consumed(self, topic: str, count: int = 1) -> None:
        _CONSUMED.labels(self.group, topic).inc(count)

    def ran(self, topic: str, seconds: float, *, failed: bool) -> None:
        """One handler run, committed or not."""
        _DURATION.labels(self.group, topic).observe(seconds)
        if failed:
            _FAILED.labels(self.group, topic).inc()

    def counted(self, topic: str, disposition: Disposition, count: int = 1) -> None:
        """Committed outcomes (parked messages are counted by reason in ``parked``)."""
        if disposition is Disposition.APPLIED:
            _HANDLED.labels(self.group, topic).inc(count)
        elif disposition is Disposition.DUPLICATE:
            _DUPLICATES.labels(self.group, topic).inc(count)
        elif disposition is Disposition.HELD:
            _HELD.labels(self.group, topic).inc(count)

    def parked(self, topic: str, reason: str) -> None:
        _PARKED.labels(self.group, topic, reason).inc()

    def conflicts(self, topic: str, verdict: str, count: int = 1) -> None:
        """New ids at or below their key's position (``_conflicts.Verdict``), after commit."""
        _CONFLICTS.labels(self.group, topic, verdict).inc(count)

    def parked_keys(self, count: int) -> None:
        _PARKED_KEYS.labels(self.group).set(count)

    def commit_lag(self, topic: str, partition: int, lag: int) -> None:
        _COMMIT_LAG.labels(self.group, topic, str(partition)).set(lag)
