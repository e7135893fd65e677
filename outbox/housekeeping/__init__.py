"""Housekeeping without Spark: retention of settled rows, and time-partitioned tables on PostgreSQL.

``run_retention`` deletes published outbox rows and inbox dedup records past
their retention in short batches, online (docs/operations.md, "Housekeeping").
"""

from ._durations import parse_period
from ._retention import DEFAULT_BATCH_SIZE, RetentionResult, count_settled, run_retention

__all__ = ["DEFAULT_BATCH_SIZE", "RetentionResult", "count_settled", "parse_period", "run_retention"]
