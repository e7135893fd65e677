"""Many tenants, one fleet: tenants in schemas or databases of their own (docs/tenants.md).

``_tenant`` says what a tenant is and where a fleet's tenants come from;
``_relay`` is ``TenantRelay``, one relay process for all of them.
``_labels`` bounds the ``tenant`` label of metrics; ``_metric_views`` binds it.
``alerts_for_tenant`` (from ``outbox._alerts``) stamps a tenant's alerts.
``_each`` runs one piece of work for every tenant (one engine per database,
each tenant's failure isolated and named), as the operations commands do.
"""

from .._alerts import TenantAlertSink, alerts_for_tenant
from ._each import DEFAULT_CONCURRENCY, TenantDatabases, TenantOutcome, each_tenant
from ._labels import OTHER_TENANTS, TenantLabels
from ._relay import TenantRelay
from ._tenant import (
    MAX_TENANT_NAME,
    Tenant,
    TenantSource,
    check_tenant_name,
    checked_tenants,
    from_file,
    from_query,
    parse_tenants,
    schemas_like,
    tenant_source,
)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "MAX_TENANT_NAME",
    "OTHER_TENANTS",
    "Tenant",
    "TenantAlertSink",
    "TenantDatabases",
    "TenantLabels",
    "TenantOutcome",
    "TenantRelay",
    "TenantSource",
    "alerts_for_tenant",
    "check_tenant_name",
    "checked_tenants",
    "each_tenant",
    "from_file",
    "from_query",
    "parse_tenants",
    "schemas_like",
    "tenant_source",
]
