"""``outbox spark warm-up``: write the driver JVM's class archive once, on purpose.

A small audit of a throwaway SQLite database runs in a driver JVM that
records the classes it loads (see ``_classcache``); the JVM is then stopped,
and the archive moved into place once it has written it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from ..core._errors import ConfigurationError
from ..core._tables import OutboxStatus
from . import _classcache as classcache
from ._session import DRIVER_JAVA_OPTIONS_ENV, FAST_START

MESSAGES = 40


def warm_up(*, force: bool = False, master: str = "local[2]", log_level: str = "WARN",
            progress: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """Write the class archive for this installation; ``(archive, written)``.

    An archive already in place is kept (``written`` False) unless ``force``.
    Run it in a process of its own: it needs to start, and stop, the driver JVM.
    """
    import os

    from pyspark import SparkContext

    from outbox import Outbox, create_engine
    from outbox.inbox import Inbox

    from ._audit import audit
    from ._session import spark_session

    step = progress or (lambda _: None)
    if os.environ.get(DRIVER_JAVA_OPTIONS_ENV) is not None:
        raise ConfigurationError(f"{DRIVER_JAVA_OPTIONS_ENV} is set: the driver JVM maps no class archive")
    archive = classcache.archive_path(FAST_START, {})
    if archive is None:
        raise ConfigurationError(f"{classcache.CACHE_ENV} is empty: class archives are turned off")
    if archive.is_file() and not force:
        return archive, False
    if SparkContext._active_spark_context is not None:
        raise ConfigurationError("a SparkContext is already running in this process")
    with tempfile.TemporaryDirectory(prefix="outbox-warm-up-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'warm-up.db'}"
        engine = create_engine(url)
        outbox = Outbox(engine)
        outbox.create_tables()
        inbox = Inbox(engine, group="warm-up")
        inbox.create_tables()
        step("seeding a throwaway database")
        with outbox.begin() as session:
            for i in range(MESSAGES):
                outbox.publish(session, "warm-up", {"n": i}, key=f"k{i % 4}")
        messages, hour_ago = outbox.tables.messages, datetime.now(UTC) - timedelta(hours=1)
        with engine.begin() as conn:  # as a relay and a consumer would: most published, some consumed
            conn.execute(sa.update(messages).where(messages.c.seq > 2).values(
                status=OutboxStatus.PUBLISHED, published_at=hour_ago))
            rows = conn.execute(sa.select(messages).where(messages.c.status == OutboxStatus.PUBLISHED)).all()
            conn.execute(sa.insert(outbox.tables.inbox_messages), [
                {"consumer_group": "warm-up", "message_id": r.message_id, "topic": r.topic,
                 "key": r.key, "seq": r.seq, "created_at": r.created_at, "received_at": hour_ago,
                 "processed_at": hour_ago} for r in rows[::2]])
        engine.dispose()
        with classcache.writing():
            step("starting Spark (recording its classes)")
            audit(url, out_dir=Path(tmp) / "audit", sla=timedelta(minutes=1), progress=step,
                  spark=lambda: spark_session(master, log_level=log_level, data_source=False,
                                              config={"spark.ui.enabled": "false"}))
    step("writing the class archive")
    written = classcache.finish_pending()
    if archive not in written:
        raise ConfigurationError(f"the driver JVM wrote no class archive to {archive.parent}")
    return archive, True
