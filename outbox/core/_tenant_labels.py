"""``TenantLabels``: what the ``tenant`` label of a metric says, with the label count bounded.

Prometheus keeps one time series per distinct label set, and every series
costs memory and scrape time on the server for as long as it is retained. A
fleet's families multiply: about ten relay families x their topics (or
workers) x tenants series. 500 tenants x 10 families x 5 topics is 25,000
series from one process, and tenants come and go, so the count only grows.
``TenantLabels`` keeps it bounded: the first ``max_tenants`` labels seen keep
their name; every later tenant shares the label ``"_other"`` (its counters add
up there; its gauges are combined with the other tenants' there, see
``_metric_views``). A ``label`` function maps a tenant to a coarser label of
the user's choosing (a tier, a region, a hash bucket) before the bound
applies. No tenant label at all is the policy ``None`` where a policy is taken.
On the shared floor, under the relay's and the inbox's metrics; ``outbox.tenants``
re-exports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ._errors import ConfigurationError
from ._tenant import check_tenant_name

OTHER_TENANTS = "_other"
"""The label shared by the tenants past ``max_tenants`` (a tenant named ``_other`` counts there too)."""


class TenantLabels:
    """Maps tenant names to metric labels: the first ``max_tenants`` labels seen, then ``"_other"``.

    ``label`` (default: the tenant's name) maps a tenant to its label; its
    answer must be a valid tenant name (1-63 of ``A-Z a-z 0-9 _ . -``), since
    it is exposed unescaped. A tenant keeps the label it was first given for
    the life of the object, also after it leaves the fleet, so its counters
    never jump between series. Share one object between the relay's and the
    inbox's metrics of a process so that both label a tenant alike. Safe to
    call from several threads.
    """

    def __init__(self, max_tenants: int = 100, *, label: Callable[[str], str] | None = None) -> None:
        if isinstance(max_tenants, bool) or not isinstance(max_tenants, int) or max_tenants < 1:
            raise ConfigurationError(f"max_tenants must be an int of at least 1, got {max_tenants!r}")
        if label is not None and not callable(label):
            raise ConfigurationError(f"label must be a function of a tenant name, got {type(label).__name__}")
        self.max_tenants = max_tenants
        self._label = label
        self._lock = threading.Lock()
        self._given: dict[str, str] = {}
        self._kept: set[str] = set()

    def __call__(self, tenant: str) -> str:
        """The label of ``tenant``: the same answer every time for one tenant."""
        given = self._given.get(tenant)
        if given is not None:
            return given
        check_tenant_name(tenant)
        label = self._labelled(tenant)
        with self._lock:
            given = self._given.get(tenant)
            if given is None:
                if label != OTHER_TENANTS and label not in self._kept:
                    if len(self._kept) < self.max_tenants:
                        self._kept.add(label)
                    else:
                        label = OTHER_TENANTS
                given = self._given[tenant] = label
            return given

    @property
    def kept(self) -> frozenset[str]:
        """The labels given out besides ``"_other"`` (at most ``max_tenants``)."""
        with self._lock:
            return frozenset(self._kept)

    def _labelled(self, tenant: str) -> str:
        if self._label is None:
            return tenant
        label = self._label(tenant)
        try:
            return check_tenant_name(label)
        except ConfigurationError:
            raise ConfigurationError(f"TenantLabels' label function gave {label!r:.80} for tenant "
                                     f"{tenant!r}: a label must be 1 to 63 letters, digits, '_', "
                                     f"'.' or '-', not starting with '.' or '-'") from None

    def __repr__(self) -> str:
        return f"TenantLabels(max_tenants={self.max_tenants}, label={self._label!r})"
