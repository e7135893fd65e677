"""The relay: publishes committed outbox rows to a ``Transport`` in per-key order.

Private modules behind the names ``outbox`` exports: ``_step`` (``RelayStep``:
one relay's leases, wheel, batch runner and stuck-key watch, one step at a
time, no thread), ``_relay`` (``Relay``: the loop around one step, its lease
thread, signals and stop), ``_batch`` (one fetch → send → mark cycle),
``_sql`` (every relay statement), ``_leases`` (shard ownership with fencing),
``_wakeup`` (LISTEN/poll), ``_record_limit`` (the producer's
record size against the stored limit), ``_metrics`` and ``_admin`` (the `failed`/`stats`/`status`
commands' queries).
"""

from ._admin import (
    backlog,
    failed_rows,
    retry_failed,
    retrying_heads,
    shard_leases,
    skip_failed,
)
from ._batch import BatchResult
from ._metrics import RelayMetrics, TenantRelayMetrics, relay_metrics, tenant_relay_metrics
from ._record_limit import refuse_smaller_producer
from ._relay import Relay
from ._session import TRANSACTION_POOLED, transaction_pooled_options
from ._settings import RelaySettings
from ._sharing import DEFAULT_MAX_SHARD_PRODUCERS, MOST_SHARD_PRODUCERS
from ._step import RelayOutages, RelayStep, Step

__all__ = [
    "DEFAULT_MAX_SHARD_PRODUCERS",
    "MOST_SHARD_PRODUCERS",
    "TRANSACTION_POOLED",
    "BatchResult",
    "Relay",
    "RelayMetrics",
    "RelayOutages",
    "RelaySettings",
    "RelayStep",
    "Step",
    "TenantRelayMetrics",
    "backlog",
    "failed_rows",
    "refuse_smaller_producer",
    "relay_metrics",
    "retry_failed",
    "retrying_heads",
    "shard_leases",
    "skip_failed",
    "tenant_relay_metrics",
    "transaction_pooled_options",
]
