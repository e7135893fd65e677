"""The SparkSession the jobs run in: ``local[*]`` unless something else is configured.

Under ``spark-submit`` the master and resources come from the command line and
are left alone; run as a plain Python program the jobs start a local session.
Either way the session works in UTC, so the timestamps read from the
databases (stored in UTC) are never shifted by the machine's time zone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

from ._source import TableSource

DEFAULT_MASTER = "local[*]"


def spark_session(
    master: str | None = None,
    *,
    app_name: str = "outbox",
    config: Mapping[str, str] | None = None,
) -> SparkSession:
    """Return the active session, or build one, with the outbox data source registered.

    ``master`` overrides the configured master (``spark.master`` from
    ``spark-submit`` or ``SPARK_MASTER``); with neither, ``local[*]`` is used.
    ``config`` adds settings for a new session, e.g. ``spark.ui.enabled``.
    """
    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        spark = active
    else:
        builder = (
            SparkSession.builder.appName(app_name)
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        )
        chosen = master or _configured_master()
        if chosen is not None:
            builder = builder.master(chosen)
        if (chosen or "").startswith("local"):
            # Local workers must run the interpreter that has this package installed,
            # not whatever "python3" is first on PATH.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            # A local session talks only to itself: bind to loopback, not the host's address.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        for name, value in (config or {}).items():
            builder = builder.config(name, value)
        spark = builder.getOrCreate()
    spark.dataSource.register(TableSource)
    return spark


def _configured_master() -> str | None:
    """None under spark-submit (its JVM already knows the master), else SPARK_MASTER or local[*]."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        return None
    return os.environ.get("SPARK_MASTER") or DEFAULT_MASTER
