"""Prometheus metrics of the inbox, registered on first use and labelled by group.

prometheus-client refuses to register a name twice, so the collectors are
created once per process, when the first ``InboxMetrics`` is built (that is,
when the first ``Inbox`` is), and every ``Inbox`` (several in one test process,
or one per group in a service) takes its labelled children from them. Not at
import: a producer-only service that imports ``outbox`` must not expose nine
inbox metrics it never feeds. Expose them with
``prometheus_client.start_http_server`` or your framework's ``/metrics``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

from prometheus_client import Counter, Gauge, Histogram

from ._signals import Disposition

_lock = threading.Lock()
_created: SimpleNamespace | None = None


def _collectors() -> SimpleNamespace:
    """The process's inbox collectors, created (registered) at the first call only; thread-safe.

    Every record passes here several times, so the created case takes no lock.
    """
    global _created
    if _created is None:
        with _lock:
            if _created is None:
                _created = _create()
    return _created


def _create() -> SimpleNamespace:
    return SimpleNamespace(
        consumed=Counter("outbox_inbox_consumed", "Records received from the broker.",
                         ["group", "topic"]),
        duplicates=Counter("outbox_inbox_duplicates_dropped",
                           "Deliveries dropped because they were already applied.", ["group", "topic"]),
        handled=Counter("outbox_inbox_handled", "Messages whose handler's writes committed.",
                        ["group", "topic"]),
        failed=Counter("outbox_inbox_failed_attempts", "Handler attempts that raised.",
                       ["group", "topic"]),
        parked=Counter("outbox_inbox_parked", "Messages moved to inbox_parked.",
                       ["group", "topic", "reason"]),
        parked_keys=Gauge("outbox_inbox_parked_keys", "Keys currently parked (read from the database).",
                          ["group"]),
        held=Counter("outbox_inbox_held", "Messages held because they arrived ahead of a gap.",
                     ["group", "topic"]),
        conflicts=Counter("outbox_inbox_seq_conflicts",
                          "New message ids at or below their key's last seq, by verdict: expired, "
                          "restart, new_incarnation, before_start, key_parked, seq_conflict.",
                          ["group", "topic", "verdict"]),
        duration=Histogram("outbox_inbox_handler_seconds",
                           "Handler run time per call (a batch handler's call covers its batch).",
                           ["group", "topic"],
                           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)),
        commit_lag=Gauge("outbox_inbox_commit_lag",
                         "Records received but not yet committed back to the broker, per partition.",
                         ["group", "topic", "partition"]),
    )


@dataclass(frozen=True, slots=True)
class InboxMetrics:
    """The collectors bound to one consumer group; building one registers them (once per process)."""

    group: str

    def __post_init__(self) -> None:
        _collectors()

    def consumed(self, topic: str, count: int = 1) -> None:
        _collectors().consumed.labels(self.group, topic).inc(count)

    def ran(self, topic: str, seconds: float, *, failed: bool) -> None:
        """One handler run, committed or not."""
        _collectors().duration.labels(self.group, topic).observe(seconds)
        if failed:
            _collectors().failed.labels(self.group, topic).inc()

    def counted(self, topic: str, disposition: Disposition, count: int = 1) -> None:
        """Committed outcomes (parked messages are counted by reason in ``parked``)."""
        if disposition is Disposition.APPLIED:
            _collectors().handled.labels(self.group, topic).inc(count)
        elif disposition is Disposition.DUPLICATE:
            _collectors().duplicates.labels(self.group, topic).inc(count)
        elif disposition is Disposition.HELD:
            _collectors().held.labels(self.group, topic).inc(count)

    def parked(self, topic: str, reason: str) -> None:
        _collectors().parked.labels(self.group, topic, reason).inc()

    def conflicts(self, topic: str, verdict: str, count: int = 1) -> None:
        """New ids at or below their key's position (``_conflicts.Verdict``), after commit."""
        _collectors().conflicts.labels(self.group, topic, verdict).inc(count)

    def parked_keys(self, count: int) -> None:
        _collectors().parked_keys.labels(self.group).set(count)

    def commit_lag(self, topic: str, partition: int, lag: int) -> None:
        _collectors().commit_lag.labels(self.group, topic, str(partition)).set(lag)
