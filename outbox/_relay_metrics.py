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
    batch_duration: Histogram

    def serve(self, port: int, registry: CollectorRegistry = REGISTRY) -> None:
        """Expose every collector of ``registry`` on ``http://0.0.0.0:port/metrics``."""
        start_http_server(port, registry=registry)


_lock = threading.Lock()
_by_registry: dict[int, RelayMetrics] = {}


def relay_metrics(registry: CollectorRegistry = REGISTRY) -> RelayMetrics:
    """The process-wide relay collectors of ``registry`` (created on first use)."""
    with _lock:
        found = _by_registry.get(id(registry))
        if found is None:
            found = RelayMetrics(
                published=Counter("outbox_relay_published", "Messages acknowledged and marked published",
                                  ["topic"], registry=registry),
                failed=Counter("outbox_relay_failed", "Messages marked failed (permanent error)",
                               ["topic"], registry=registry),
                retried=Counter("outbox_relay_retried", "Sends that will be retried",
                                ["topic"], registry=registry),
                pending=Gauge("outbox_relay_pending", "Pending messages by topic",
                              ["topic"], registry=registry),
                oldest_pending_age=Gauge("outbox_relay_oldest_pending_age_seconds",
                                         "Age of the oldest pending message", registry=registry),
                wheel_size=Gauge("outbox_relay_wheel_size", "Keys waiting for their next attempt",
                                 ["worker"], registry=registry),
                shards_owned=Gauge("outbox_relay_shards_owned", "Shard leases held",
                                   ["worker"], registry=registry),
                batch_duration=Histogram("outbox_relay_batch_seconds",
                                         "Fetch, send and mark of one batch", registry=registry),
            )
            _by_registry[id(registry)] = found
        return found
