"""A nightly job: audit yesterday's traffic, then archive what is past retention.

Schedule it with cron, a Kubernetes CronJob or Airflow; it exits non-zero when
anything was lost or reordered, so the scheduler's own alerting fires:

    15 2 * * *  OUTBOX_DB=… OUTBOX_INBOX_DB=… OUTBOX_SPARK_ARCHIVE_DIR=/data/outbox-archive \\
                python examples/nightly_audit_archive.py

Under spark-submit the same file runs on a cluster (the session it builds
keeps the master spark-submit gives it); there OUTBOX_SPARK_OUT and
OUTBOX_SPARK_ARCHIVE_DIR must be mounted at the same path on every node, which
OUTBOX_SPARK_SHARED_STORAGE=1 declares (see docs/spark.md, "Run on a cluster").
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

from outbox.spark import archive, audit, spark_session


def nightly(outbox_db: str, inbox_db: str, archive_dir: Path, reports_dir: Path,
            as_of: datetime | None = None, shared_storage: bool = False) -> int:
    """Audit the last 24 h, archive rows past 7 days; 1 when anything was lost or reordered."""
    spark = spark_session(app_name="outbox-nightly")
    result = audit(outbox_db, inbox_db, window="24h", sla="15m", out_dir=reports_dir,
                   as_of=as_of, spark=spark, shared_storage=shared_storage)
    print(result.path("report.md").read_text())
    moved = archive(outbox_db, archive_dir, retention="7d", inbox_url=inbox_db,
                    dedup_window="30d", as_of=as_of, spark=spark, shared_storage=shared_storage)
    print(f"archived {moved.archived}, deleted {moved.deleted}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(nightly(os.environ["OUTBOX_DB"], os.environ["OUTBOX_INBOX_DB"],
                     Path(os.environ["OUTBOX_SPARK_ARCHIVE_DIR"]),
                     Path(os.environ.get("OUTBOX_SPARK_OUT", "audit")),
                     shared_storage=os.environ.get("OUTBOX_SPARK_SHARED_STORAGE") == "1"))
