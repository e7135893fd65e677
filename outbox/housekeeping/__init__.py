"""Housekeeping without Spark: retention of settled rows, and time-partitioned tables on PostgreSQL.

``run_retention`` deletes published outbox rows and inbox dedup records past
their retention in short batches, online (docs/operations.md, "Housekeeping").
``partition_outbox`` makes ``outbox_messages`` partitioned by day on PostgreSQL,
after which a retention pass drops whole settled partitions (``maintain_partitions``);
``partition_inbox`` does the same for ``inbox_messages``, by the day inside each message id
(``maintain_inbox_partitions``), keeping the dedup key the primary key.
``run_retention_for_tenants`` runs retention in many tenants' schemas or databases,
one tenant's failure named and the others cleaned all the same.
"""

from ._durations import parse_period
from ._inbox_partitions import maintain_inbox_partitions, partition_inbox
from ._partitions import PartitionReport, maintain_partitions, partition_outbox
from ._retention import DEFAULT_BATCH_SIZE, DEFAULT_DUTY, RetentionResult, count_settled, run_retention
from ._tenants import TenantProgress, run_retention_for_tenants, tenant_retention_pass

__all__ = [
           "DEFAULT_BATCH_SIZE",
           "DEFAULT_DUTY",
           "PartitionReport",
           "RetentionResult",
           "TenantProgress",
           "count_settled",
           "maintain_inbox_partitions",
           "maintain_partitions",
           "parse_period",
           "partition_inbox",
           "partition_outbox",
           "run_retention",
           "run_retention_for_tenants",
           "tenant_retention_pass",
]
