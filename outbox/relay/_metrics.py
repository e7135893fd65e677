"""Prometheus metrics of the relay, defined once per process.

Several ``Relay`` objects in one process (tests, an embedding service) share
the same collectors instead of registering duplicates; their numbers add up.
``serve(port)`` exposes them over HTTP; without it nothing listens.

A fleet serving many tenants takes ``tenant_relay_metrics(labels)`` and hands
each tenant's ``Relay`` its ``for_tenant(name)``: a ``RelayMetrics`` whose
families carry a leading ``tenant`` label (``outbox_tenant_relay_*``, see
``TenantRelayMetrics`` for why the names differ) bound to that tenant.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..core._metric_views import (
    Combine,
    CounterFamily,
    GaugeFamily,
    GaugeShares,
    HistogramFamily,
    TenantCounter,
    TenantGauge,
    TenantHistogram,
)
from ..core._tenant import check_tenant_name
from ..core._tenant_labels import TenantLabels


@dataclass(frozen=True, slots=True)
class RelayMetrics:
    """The families a ``Relay`` feeds: prometheus_client collectors, or one tenant's view of them."""

    published: CounterFamily
    failed: CounterFamily
    retried: CounterFamily
    pending: GaugeFamily
    oldest_pending_age: GaugeFamily
    wheel_size: GaugeFamily
    shards_owned: GaugeFamily
    stuck_keys: GaugeFamily
    batch_duration: HistogramFamily
    outages: CounterFamily

    def serve(self, port: int, registry: CollectorRegistry = REGISTRY) -> None:
        """Expose every collector of ``registry`` on ``http://0.0.0.0:port/metrics``."""
        start_http_server(port, registry=registry)


_lock = threading.Lock()
# Weak: a registry that is gone must not leave its collectors to a new one that reuses its id().
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, RelayMetrics] = weakref.WeakKeyDictionary()
_families: weakref.WeakKeyDictionary[CollectorRegistry, dict[bool, tuple[dict[str, Any], GaugeShares]]] = (
    weakref.WeakKeyDictionary())

TENANT_PREFIX = "outbox_tenant_relay_"
"""The tenant families' names start so: ``outbox_relay_published``: ``outbox_tenant_relay_published``."""

# attribute -> (collector, name, help, labels, how tenants sharing a gauge series combine)
_SPEC: dict[str, tuple[type, str, str, tuple[str, ...], Combine]] = {
    "published": (Counter, "outbox_relay_published", "Messages acknowledged and marked published",
                  ("topic",), sum),
    "failed": (Counter, "outbox_relay_failed", "Messages marked failed (permanent error)", ("topic",), sum),
    "retried": (Counter, "outbox_relay_retried", "Sends that will be retried", ("topic",), sum),
    "pending": (Gauge, "outbox_relay_pending", "Pending messages by topic", ("topic",), sum),
    "oldest_pending_age": (Gauge, "outbox_relay_oldest_pending_age_seconds",
                           "Age of the oldest pending message", (), max),
    "wheel_size": (Gauge, "outbox_relay_wheel_size", "Keys waiting for their next attempt", ("worker",),
                   sum),
    "shards_owned": (Gauge, "outbox_relay_shards_owned", "Shard leases held", ("worker",), sum),
    "stuck_keys": (Gauge, "outbox_relay_stuck_keys",
                   "Keys of owned shards whose head has been retrying longer than key_stuck_after",
                   ("worker",), sum),
    "batch_duration": (Histogram, "outbox_relay_batch_seconds", "Fetch, send and mark of one batch", (),
                       sum),
    "outages": (Counter, "outbox_relay_outages", "Times the database or the broker became unreachable",
                ("dependency",), sum),
}


def _collectors(registry: CollectorRegistry, tenant_label: bool) -> tuple[dict[str, Any], GaugeShares]:
    """The families of ``registry``, plain or with a leading ``tenant`` label; created on first use."""
    with _lock:
        kinds = _families.setdefault(registry, {})
        found = kinds.get(tenant_label)
        if found is None:
            found = ({
                attribute: kind(TENANT_PREFIX + name.removeprefix("outbox_relay_") if tenant_label else name,
                                text + (", by tenant" if tenant_label else ""),
                                ["tenant", *labels] if tenant_label else list(labels), registry=registry)
                for attribute, (kind, name, text, labels, _) in _SPEC.items()
            }, GaugeShares())
            kinds[tenant_label] = found
        return found


def relay_metrics(registry: CollectorRegistry = REGISTRY) -> RelayMetrics:
    """The process-wide relay collectors of ``registry`` (created on first use)."""
    collectors, _ = _collectors(registry, tenant_label=False)
    with _lock:
        found = _by_registry.get(registry)
        if found is None:
            found = _by_registry[registry] = RelayMetrics(**collectors)
        return found


class TenantRelayMetrics:
    """The relay metrics of a fleet of tenants: ``for_tenant(name)`` is what one tenant's ``Relay`` takes.

    With a ``TenantLabels`` policy every family is a separate family named
    ``outbox_tenant_relay_*`` with a leading ``tenant`` label
    (``outbox_tenant_relay_published_total{tenant,topic}``), whose value is
    the policy's label for the tenant. The names differ from the plain
    families' because prometheus_client cannot register one name with two
    label sets in one registry, and a process may run a single-tenant
    ``Relay`` beside a fleet (an embedding service, the tests); PromQL joins
    both with ``{__name__=~"outbox_(tenant_)?relay_published_total"}``.

    With ``labels=None`` the tenants feed the plain ``outbox_relay_*``
    families without a tenant label: counters add up and gauges combine, as
    they do for tenants sharing ``"_other"`` (``_metric_views``).

    ``for_tenant`` is cheap and cached; call it once per tenant and keep the
    answer. ``forget(name)`` when a tenant leaves the fleet, so that its last
    gauge values (pending rows, shards owned) stop counting. Safe to use from
    several threads.
    """

    def __init__(self, labels: TenantLabels | None, registry: CollectorRegistry = REGISTRY) -> None:
        if labels is not None and not isinstance(labels, TenantLabels):
            raise TypeError(f"labels must be a TenantLabels or None, got {type(labels).__name__}")
        self.labels = labels
        self.registry = registry
        self._collectors, self._shares = _collectors(registry, tenant_label=labels is not None)
        self._views: dict[str, RelayMetrics] = {}
        self._lock = threading.Lock()

    def for_tenant(self, tenant: str) -> RelayMetrics:
        """The ``RelayMetrics`` of ``tenant``: its families answer ``labels(...)`` with the tenant first."""
        found = self._views.get(tenant)
        if found is not None:
            return found
        check_tenant_name(tenant)
        head = () if self.labels is None else (self.labels(tenant),)
        views: dict[str, Any] = {}
        for attribute, (kind, _, _, _, combine) in _SPEC.items():
            family = self._collectors[attribute]
            if kind is Counter:
                views[attribute] = TenantCounter(family, head)
            elif kind is Histogram:
                views[attribute] = TenantHistogram(family, head)
            else:
                views[attribute] = TenantGauge(family, head, tenant, self._shares, combine)
        with self._lock:
            return self._views.setdefault(tenant, RelayMetrics(**views))

    def forget(self, tenant: str) -> None:
        """``tenant`` left: its gauge values stop counting (its counters stay, as counters do)."""
        self._shares.forget(tenant)

    def serve(self, port: int) -> None:
        """Expose every collector of this registry on ``http://0.0.0.0:port/metrics``."""
        start_http_server(port, registry=self.registry)


def tenant_relay_metrics(labels: TenantLabels | None, registry: CollectorRegistry = REGISTRY
                         ) -> TenantRelayMetrics:
    """The fleet's relay metrics: ``TenantRelayMetrics(labels, registry)``."""
    return TenantRelayMetrics(labels, registry)
