"""What operators and platforms read: the report of everything stuck, and the health endpoints.

``gather`` is the document behind ``outbox status`` (and the console);
``serve_health`` puts ``/healthz`` and ``/readyz`` beside ``/metrics`` for a
worker, with ``relay_readiness`` or ``inbox_readiness`` saying what "ready"
means for it; ``trace_message``/``trace_key`` follow one message or key
across an outbox database and its inbox databases (``outbox trace``);
``gather_tenants`` is ``gather`` over many tenants, each finding naming its tenant. This
package sits above ``relay`` and ``inbox`` (it reads both) and below ``cli``
and ``console``, which only present it.
"""

from ._health import (
    DatabaseCheck,
    Readiness,
    inbox_readiness,
    relay_readiness,
    serve_health,
    tenant_relay_readiness,
)
from ._stuck import VERSION, gather
from ._tenants import DEFAULT_TENANT_TIMEOUT, gather_tenants, tenant_statuses, tenants_document

__all__ = [
    "VERSION",
    "DatabaseCheck",
    "Readiness",
    "gather",
    "inbox_readiness",
    "relay_readiness",
    "serve_health",
    "tenant_relay_readiness",
]
from ._trace import Database, trace_key, trace_message  # ``outbox trace``, the console's trace page

__all__ += ["Database", "trace_key", "trace_message"]
__all__ += ["DEFAULT_TENANT_TIMEOUT", "gather_tenants", "tenant_statuses", "tenants_document"]
