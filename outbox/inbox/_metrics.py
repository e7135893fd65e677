"""Prometheus metrics of the inbox, registered on first use and labelled by group.

prometheus-client refuses to register a name twice, so the collectors are
created once per process, when the first ``InboxMetrics`` is built (that is,
when the first ``Inbox`` is), and every ``Inbox`` (several in one test process,
or one per group in a service) takes its labelled children from them. Not at
import: a producer-only service that imports ``outbox`` must not expose nine
inbox metrics it never feeds. Expose them with
``prometheus_client.start_http_server`` or your framework's ``/metrics``.

An inbox serving many tenants takes ``tenant_inbox_metrics(group, labels)``
and, for each message, the ``for_tenant(name)`` of its tenant: the same
``InboxMetrics`` calls, on families named ``outbox_tenant_inbox_*`` with a
leading ``tenant`` label (why the names differ: ``TenantRelayMetrics``).
"""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from ..core._metric_views import GaugeShares
from ..core._tenant import check_tenant_name
from ..core._tenant_labels import TenantLabels
from ._signals import Disposition

_lock = threading.Lock()
# Weak: a registry that is gone must not leave its collectors to a new one that reuses its id().
_created: weakref.WeakKeyDictionary[CollectorRegistry, dict[bool, tuple[SimpleNamespace, GaugeShares]]] = (
    weakref.WeakKeyDictionary())

TENANT_PREFIX = "outbox_tenant_inbox_"
"""The tenant families' names start so: ``outbox_inbox_consumed`` is ``outbox_tenant_inbox_consumed``."""


def _collectors(registry: CollectorRegistry = REGISTRY, tenant_label: bool = False
                ) -> tuple[SimpleNamespace, GaugeShares]:
    """The inbox collectors of ``registry``, created (registered) at the first call only; thread-safe.

    Called when an ``InboxMetrics`` is built, never per record.
    """
    with _lock:
        kinds = _created.setdefault(registry, {})
        found = kinds.get(tenant_label)
        if found is None:
            found = kinds[tenant_label] = (_create(registry, tenant_label), GaugeShares())
        return found


def _create(registry: CollectorRegistry, tenant_label: bool) -> SimpleNamespace:
    def make(kind: type, name: str, text: str, labels: list[str], **extra: Any) -> Any:
        if tenant_label:
            name, text, labels = TENANT_PREFIX + name.removeprefix("outbox_inbox_"), text, ["tenant", *labels]
        return kind(name, text, labels, registry=registry, **extra)

    return SimpleNamespace(
        consumed=make(Counter, "outbox_inbox_consumed", "Records received from the broker.",
                      ["group", "topic"]),
        duplicates=make(Counter, "outbox_inbox_duplicates_dropped",
                        "Deliveries dropped because they were already applied.", ["group", "topic"]),
        handled=make(Counter, "outbox_inbox_handled", "Messages whose handler's writes committed.",
                     ["group", "topic"]),
        failed=make(Counter, "outbox_inbox_failed_attempts", "Handler attempts that raised.",
                    ["group", "topic"]),
        parked=make(Counter, "outbox_inbox_parked", "Messages moved to inbox_parked.",
                    ["group", "topic", "reason"]),
        parked_keys=make(Gauge, "outbox_inbox_parked_keys", "Keys currently parked (read from the database).",
                         ["group"]),
        held=make(Counter, "outbox_inbox_held", "Messages held because they arrived ahead of a gap.",
                  ["group", "topic"]),
        conflicts=make(Counter, "outbox_inbox_seq_conflicts",
                       "New message ids at or below their key's last seq, by verdict: expired, "
                       "restart, new_incarnation, before_start, key_parked, seq_conflict.",
                       ["group", "topic", "verdict"]),
        duration=make(Histogram, "outbox_inbox_handler_seconds",
                      "Handler run time per call (a batch handler's call covers its batch).",
                      ["group", "topic"],
                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)),
        commit_lag=make(Gauge, "outbox_inbox_commit_lag",
                        "Records received but not yet committed back to the broker, per partition.",
                        ["group", "topic", "partition"]),
    )


class InboxMetrics:
    """The collectors bound to one consumer group (and, from ``for_tenant``, one tenant).

    Building one registers the collectors (once per process and registry).
    A tenant's metrics put its label before the group; tenants sharing a
    gauge series (``parked_keys``, ``commit_lag``) show the sum of their values.
    """

    __slots__ = ("_c", "_head", "_shares", "_tenant", "group")

    def __init__(self, group: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.group = group
        self._c, self._shares = _collectors(registry)
        self._head: tuple[str, ...] = (group,)
        self._tenant: str | None = None

    @classmethod
    def _of_tenant(cls, group: str, tenant: str, label: str | None, registry: CollectorRegistry
                   ) -> InboxMetrics:
        self = cls.__new__(cls)
        self.group, self._tenant = group, tenant
        self._c, self._shares = _collectors(registry, tenant_label=label is not None)
        self._head = (group,) if label is None else (label, group)
        return self

    def __repr__(self) -> str:
        return f"InboxMetrics(group={self.group!r}, tenant={self._tenant!r})"

    def consumed(self, topic: str, count: int = 1) -> None:
        self._c.consumed.labels(*self._head, topic).inc(count)

    def ran(self, topic: str, seconds: float, *, failed: bool) -> None:
        """One handler run, committed or not."""
        self._c.duration.labels(*self._head, topic).observe(seconds)
        if failed:
            self._c.failed.labels(*self._head, topic).inc()

    def counted(self, topic: str, disposition: Disposition, count: int = 1) -> None:
        """Committed outcomes (parked messages are counted by reason in ``parked``)."""
        if disposition is Disposition.APPLIED:
            self._c.handled.labels(*self._head, topic).inc(count)
        elif disposition is Disposition.DUPLICATE:
            self._c.duplicates.labels(*self._head, topic).inc(count)
        elif disposition is Disposition.HELD:
            self._c.held.labels(*self._head, topic).inc(count)

    def parked(self, topic: str, reason: str) -> None:
        self._c.parked.labels(*self._head, topic, reason).inc()

    def conflicts(self, topic: str, verdict: str, count: int = 1) -> None:
        """New ids at or below their key's position (``_conflicts.Verdict``), after commit."""
        self._c.conflicts.labels(*self._head, topic, verdict).inc(count)

    def parked_keys(self, count: int) -> None:
        self._set(self._c.parked_keys, self._head, count)

    def commit_lag(self, topic: str, partition: int, lag: int) -> None:
        self._set(self._c.commit_lag, (*self._head, topic, str(partition)), lag)

    def _set(self, gauge: Gauge, key: tuple[str, ...], value: float) -> None:
        child = gauge.labels(*key)
        if self._tenant is None:
            child.set(value)
        else:
            self._shares.set(gauge, key, child, sum, self._tenant, value)


class TenantInboxMetrics:
    """The inbox metrics of one group serving many tenants: ``for_tenant(name)`` per message's tenant.

    With a ``TenantLabels`` policy the families are ``outbox_tenant_inbox_*``
    with a leading ``tenant`` label (``outbox_tenant_inbox_handled_total{tenant,
    group,topic}``); with ``labels=None`` the tenants feed the plain
    ``outbox_inbox_*`` families of the group, adding up. ``for_tenant`` is a
    dictionary look-up once a tenant has been seen. ``forget(name)`` when a
    tenant leaves, so that its parked keys and commit lag stop counting.
    Safe to use from several threads.
    """

    def __init__(self, group: str, labels: TenantLabels | None,
                 registry: CollectorRegistry = REGISTRY) -> None:
        if labels is not None and not isinstance(labels, TenantLabels):
            raise TypeError(f"labels must be a TenantLabels or None, got {type(labels).__name__}")
        self.group, self.labels, self.registry = group, labels, registry
        _, self._shares = _collectors(registry, tenant_label=labels is not None)
        self._views: dict[str, InboxMetrics] = {}
        self._lock = threading.Lock()

    def for_tenant(self, tenant: str) -> InboxMetrics:
        """The ``InboxMetrics`` of ``tenant`` in this group."""
        found = self._views.get(tenant)
        if found is not None:
            return found
        check_tenant_name(tenant)
        label = None if self.labels is None else self.labels(tenant)
        view = InboxMetrics._of_tenant(self.group, tenant, label, self.registry)
        with self._lock:
            return self._views.setdefault(tenant, view)

    def forget(self, tenant: str) -> None:
        """``tenant`` left: its gauge values stop counting (its counters stay, as counters do)."""
        self._shares.forget(tenant)


def tenant_inbox_metrics(group: str, labels: TenantLabels | None,
                         registry: CollectorRegistry = REGISTRY) -> TenantInboxMetrics:
    """The inbox metrics of ``group`` for many tenants: ``TenantInboxMetrics(group, labels, registry)``."""
    return TenantInboxMetrics(group, labels, registry)
