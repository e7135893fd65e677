"""Spark jobs over the outbox and inbox tables: audit, archive, replay.

They read the tables through a Python data source (SQLAlchemy on the
executors, one id range per partition), so nothing but the ``spark`` extra
and a JVM is needed: no JDBC jar to download. Each job is a plain function
here and a command under ``outbox spark``.
"""

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"outbox.spark needs PySpark and pyarrow ({exc.name} is missing): "
        'pip install "transactional-outbox[spark]"'
    ) from exc

from ._archive import ArchiveBusyError, ArchiveResult, archive
from ._audit import AuditResult, audit
from ._replay import REPLAY_HEADER, ArchiveReplayResult, replay
from ._session import spark_session
from ._source import read_table
from ._window import Window
from ._wire import Wire, WireUnreachableError

ReplayResult = ArchiveReplayResult
"""The name of earlier releases for ``ArchiveReplayResult``, kept for one release.

(The inbox's replay result is ``outbox.ParkedReplay``.)
"""

__all__ = [
    "REPLAY_HEADER",
    "ArchiveBusyError",
    "ArchiveReplayResult",
    "ArchiveResult",
    "AuditResult",
    "ReplayResult",
    "Window",
    "Wire",
    "WireUnreachableError",
    "archive",
    "audit",
    "read_table",
    "replay",
    "spark_session",
]
