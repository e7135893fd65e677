"""Many tenants, one fleet: tenants in schemas or databases of their own (docs/tenants.md).

``_tenant`` says what a tenant is and where a fleet's tenants come from;
``_relay`` is ``TenantRelay``, one relay process for all of them.
"""

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
    "MAX_TENANT_NAME",
    "Tenant",
    "TenantRelay",
    "TenantSource",
    "check_tenant_name",
    "checked_tenants",
    "from_file",
    "from_query",
    "parse_tenants",
    "schemas_like",
    "tenant_source",
]
