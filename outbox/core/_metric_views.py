"""One tenant's view of metric families shared by a fleet: the tenant label bound, gauges combined.

The relay and the inbox call ``family.labels(topic).inc(n)``, ``.set(v)``,
``.observe(s)``. A view answers the same calls on a family that carries a
leading ``tenant`` label (or none, when the policy is no tenant label), with
the tenant's label put first: code written for one tenant runs unchanged for
each tenant of a fleet. The protocols below are what that code may call; the
prometheus_client collectors satisfy them too.

Counters and histograms of tenants that share a series (``"_other"``, a
user's coarser label, or no tenant label at all) simply add up. A gauge
cannot: each tenant would overwrite the others' value. So every tenant's
last value of a gauge series is kept, and the series shows them combined: a
sum (pending rows, shards owned, keys in the wheel) or, for ages, the
maximum. ``forget`` takes a tenant that left out of the combined values.

Cost: a view's ``labels`` is the collector's own ``labels`` with one more
value; a gauge ``set`` adds a lock and a sum over the tenants sharing that
one series. Nothing is done per message. On the shared floor, under the relay's
and the inbox's metrics, which build their views from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

Combine = Callable[[Iterable[float]], float]


class CounterChild(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class CounterFamily(CounterChild, Protocol):
    def labels(self, *values: str) -> CounterChild: ...


class GaugeChild(Protocol):
    def set(self, value: float) -> None: ...


class GaugeFamily(GaugeChild, Protocol):
    def labels(self, *values: str) -> GaugeChild: ...


class HistogramChild(Protocol):
    def observe(self, amount: float) -> None: ...


class HistogramFamily(HistogramChild, Protocol):
    def labels(self, *values: str) -> HistogramChild: ...


class _Series:
    __slots__ = ("child", "combine", "family", "key", "values")

    def __init__(self, family: Gauge, key: tuple[str, ...], child: Gauge, combine: Combine) -> None:
        self.family, self.key, self.child, self.combine = family, key, child, combine
        self.values: dict[str, float] = {}


class GaugeShares:
    """Each tenant's last value of every shared gauge series; one per set of families."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[int, tuple[str, ...]], _Series] = {}

    def set(self, family: Gauge, key: tuple[str, ...], child: Gauge, combine: Combine,
            tenant: str, value: float) -> None:
        with self._lock:
            series = self._series.get((id(family), key))
            if series is None:
                series = self._series[(id(family), key)] = _Series(family, key, child, combine)
            series.values[tenant] = value
            child.set(combine(series.values.values()))

    def forget(self, tenant: str) -> None:
        """Take ``tenant``'s values out; a series no tenant writes any more is removed (or zeroed)."""
        with self._lock:
            for index, series in list(self._series.items()):
                if series.values.pop(tenant, None) is None:
                    continue
                if series.values:
                    series.child.set(series.combine(series.values.values()))
                    continue
                del self._series[index]
                if series.key:
                    series.family.remove(*series.key)
                else:
                    series.child.set(0)


class TenantCounter:
    """A counter family with ``head`` (the tenant's label, or nothing) bound first."""

    __slots__ = ("_family", "_head")

    def __init__(self, family: Counter, head: tuple[str, ...]) -> None:
        self._family, self._head = family, head

    def labels(self, *values: str) -> CounterChild:
        return self._family.labels(*self._head, *values)

    def inc(self, amount: float = 1) -> None:
        (self._family.labels(*self._head) if self._head else self._family).inc(amount)


class TenantHistogram:
    """A histogram family with ``head`` bound first."""

    __slots__ = ("_family", "_head")

    def __init__(self, family: Histogram, head: tuple[str, ...]) -> None:
        self._family, self._head = family, head

    def labels(self, *values: str) -> HistogramChild:
        return self._family.labels(*self._head, *values)

    def observe(self, amount: float) -> None:
        (self._family.labels(*self._head) if self._head else self._family).observe(amount)


class TenantGauge:
    """A gauge family with ``head`` bound first, whose series combine the tenants sharing them."""

    __slots__ = ("_combine", "_family", "_head", "_shares", "_tenant")

    def __init__(self, family: Gauge, head: tuple[str, ...], tenant: str, shares: GaugeShares,
                 combine: Combine) -> None:
        self._family, self._head, self._tenant = family, head, tenant
        self._shares, self._combine = shares, combine

    def labels(self, *values: str) -> GaugeChild:
        key = (*self._head, *values)
        return _GaugeCell(self, key, self._family.labels(*key))  # a wrong label count raises here

    def set(self, value: float) -> None:
        child = self._family.labels(*self._head) if self._head else self._family
        self._shares.set(self._family, self._head, child, self._combine, self._tenant, value)


class _GaugeCell:
    __slots__ = ("_child", "_gauge", "_key")

    def __init__(self, gauge: TenantGauge, key: tuple[str, ...], child: Gauge) -> None:
        self._gauge, self._key, self._child = gauge, key, child

    def set(self, value: float) -> None:
        gauge = self._gauge
        gauge._shares.set(gauge._family, self._key, self._child, gauge._combine, gauge._tenant, value)
