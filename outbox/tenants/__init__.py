"""Many tenants, one fleet: tenants in schemas or databases of their own (docs/tenants.md).

The public face of the tenant dimension. What a tenant is and where a fleet's
tenants come from (``outbox.core._tenant``), the bound on the ``tenant`` label of
metrics (``outbox.core._tenant_labels``) and ``alerts_for_tenant`` (``outbox.core._alerts``)
live on the shared floor, under the relay and the inbox, which use them; this
package re-exports them. Its own modules stand above the relay: ``_relay`` is
``TenantRelay``, one relay process for all the tenants (a scheduler over their
``RelayStep``s: ``_schedule``, ``_databases``, ``_transport``); ``_each`` runs one
piece of work for every tenant (one engine per database, each tenant's failure
isolated and named), as the operations commands do.
"""

from ..core._alerts import TenantAlertSink, alerts_for_tenant
from ..core._tenant import (
    MAX_TENANT_NAME,
    Tenant,
    TenantShare,
    TenantSource,
    check_tenant_name,
    checked_tenants,
    from_file,
    from_query,
    parse_tenants,
    schemas_like,
    share_of,
    shared,
    tenant_source,
)
from ..core._tenant_labels import OTHER_TENANTS, TenantLabels
from ._each import DEFAULT_CONCURRENCY, TenantDatabases, TenantOutcome, each_tenant
from ._relay import TenantRelay
from ._switching import FLEET_LINGER_MS, fleet_kafka_settings, tune_switch_interval

__all__ = [
    "DEFAULT_CONCURRENCY",
    "FLEET_LINGER_MS",
    "MAX_TENANT_NAME",
    "OTHER_TENANTS",
    "Tenant",
    "TenantAlertSink",
    "TenantDatabases",
    "TenantLabels",
    "TenantOutcome",
    "TenantRelay",
    "TenantShare",
    "TenantSource",
    "alerts_for_tenant",
    "check_tenant_name",
    "checked_tenants",
    "each_tenant",
    "fleet_kafka_settings",
    "from_file",
    "from_query",
    "parse_tenants",
    "schemas_like",
    "share_of",
    "shared",
    "tenant_source",
    "tune_switch_interval",
]
