"""Prometheus metrics of the relay, defined once per process.

Several ``Relay`` objects in one process (tests, an embedding service) share
the same collectors instead of registering duplicates; their numbers add up.
``serve(port)`` exposes them over HTTP; without it nothing listens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server


@dataclass(frozen=True, slots=True)
class RelayMetrics:
    published: Counter
    failed: Counter
    retried: Counter
    pending: Gauge
    oldest_pending_age: Gauge
    wheel_size: Gauge
    shards_owned: Gauge
    stuck_keys: Gauge
    batch_duration: Histogram
    outages: Counter

    def serve(self, port: int, registry: CollectorRegistry = REGISTRY) -> None:
        """Expose every collector of ``registry`` on ``http://0.0.0.0:port/metrics``."""
        start_http_server(port, registry=registry)


_lock = threading.Lock()
_by_registry: dict[int, RelayMetrics] = {}


# attribute -> (collector, name, help, labels)
_SPEC: dict[str, tuple[type, str, str, tuple[str, ...]]] = {
    "published": (Counter, "outbox_relay_published", "Messages acknowledged and marked published",
                  ("topic",)),
    "failed": (Counter, "outbox_relay_failed", "Messages marked failed (permanent error)", ("topic",)),
    "retried": (Counter, "outbox_relay_retried", "Sends that will be retried", ("topic",)),
    "pending": (Gauge, "outbox_relay_pending", "Pending messages by topic", ("topic",)),
    "oldest_pending_age": (Gauge, "outbox_relay_oldest_pending_age_seconds",
                           "Age of the oldest pending message", ()),
    "wheel_size": (Gauge, "outbox_relay_wheel_size", "Keys waiting for their next attempt", ("worker",)),
    "shards_owned": (Gauge, "outbox_relay_shards_owned", "Shard leases held", ("worker",)),
    "stuck_keys": (Gauge, "outbox_relay_stuck_keys",
                   "Keys of owned shards whose head has been retrying longer than key_stuck_after",
                   ("worker",)),
    "batch_duration": (Histogram, "outbox_relay_batch_seconds", "Fetch, send and mark of one batch", ()),
    "outages": (Counter, "outbox_relay_outages", "Times the database or the broker became unreachable",
                ("dependency",)),
}


def relay_metrics(registry: CollectorRegistry = REGISTRY) -> RelayMetrics:
    """The process-wide relay collectors of ``registry`` (created on first use)."""
    with _lock:
        found = _by_registry.get(id(registry))
        if found is None:
            found = RelayMetrics(**{
                attribute: kind(name, text, list(labels), registry=registry)
                for attribute, (kind, name, text, labels) in _SPEC.items()
            })
            _by_registry[id(registry)] = found
        return found
