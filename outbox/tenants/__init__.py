"""Many tenants, one fleet: tenants in schemas or databases of their own (docs/tenants.md).

``_tenant`` says what a tenant is and where a fleet's tenants come from;
``_each`` runs one piece of work for every tenant (one engine per database,
each tenant's failure isolated and named), as the operations commands do.
"""

from ._each import DEFAULT_CONCURRENCY, TenantDatabases, TenantOutcome, each_tenant
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
    "Tenant",
    "TenantDatabases",
    "TenantOutcome",
    "TenantSource",
    "check_tenant_name",
    "checked_tenants",
    "each_tenant",
    "from_file",
    "from_query",
    "parse_tenants",
    "schemas_like",
    "tenant_source",
]
