"""``replay``: put archived messages back into the outbox as new messages (message back-tracking).

Selected rows go through ``Outbox.publish`` like any new event, so they get
new ids and the next seq of their key, and the relay delivers them in that
order. Each key's messages are published in their original seq order; each
carries a ``replay-of`` header naming the message it repeats.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sqlalchemy.orm import Session

from ..core._errors import ConfigurationError
from ..core._validation import folded, normalize_key, validate_topic
from ..producer import Outbox
from ._layout import committed_files, table_dir
from ._session import SessionFactory, session_from
from ._storage import local_path, require_shared, uri
from ._tablemap import check_table, connect, table_for
from ._window import parse_instant

REPLAY_HEADER = "replay-of"
COLUMNS = ["id", "message_id", "key", "seq", "payload", "content_type", "headers", "created_at"]


@dataclass
class ArchiveReplayResult:
    """What ``replay`` wrote back from the archive: how many messages, per key (None for unkeyed ones).

    Not the inbox's ``ParkedReplay`` (what replaying a parked key applied).
    """

    replayed: int = 0
    per_key: Counter[str | None] = field(default_factory=Counter)


def replay(
    archive_dir: str | Path,
    outbox_url: str,
    *,
    topic: str,
    keys: Sequence[str] | None = None,
    since: datetime | str | None = None,
    until: datetime | str | None = None,
    batch: int = 500,
    spark: SparkSession | SessionFactory | None = None,
    prefix: str = "",
    schema: str | None = None,
    progress: Callable[[int], None] | None = None,
    shared_storage: bool = False,
) -> ArchiveReplayResult:
    """Publish archived messages of ``topic`` again: only ``keys``, ``since <= created_at < until``.

    Messages are written ``batch`` per transaction, keys in original seq
    order. A crash part-way leaves the batches already committed in the
    outbox; running again replays the whole selection again (the ``replay-of``
    header lets consumers or a query recognise repeats).

    The executors read the archive: on a master other than ``local``,
    ``archive_dir`` must be storage every node mounts at the same path, which
    ``shared_storage=True`` declares (refused otherwise).
    """
    topic = validate_topic(topic)
    wanted = None if keys is None else [normalize_key(k) for k in keys]
    if wanted is not None and not wanted:
        raise ConfigurationError("keys is empty; pass None to replay every key")
    lower = None if since is None else parse_instant(since, "since")
    upper = None if until is None else parse_instant(until, "until")
    if lower and upper and lower >= upper:
        raise ConfigurationError(f"empty time range: since {lower} is not before until {upper}")
    if not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"batch must be a positive int, got {batch!r}")
    root = local_path(archive_dir, "archive_dir")
    if not root.is_dir():
        raise ConfigurationError(f"archive directory {root} does not exist")
    check_table(outbox_url, table_for("outbox_messages", prefix, schema))
    files = [uri(f) for f in committed_files(root, "outbox_messages")
             if f"topic={topic}" in f.relative_to(root).parts]
    result = ArchiveReplayResult()
    if not files:
        return result

    session = session_from(spark)
    require_shared(session, root, "archive_dir", shared_storage)
    frame = session.read.option("basePath", uri(table_dir(root, "outbox_messages"))).parquet(*files)
    # Archives written before event types (issue 29) have no such column: their messages had none.
    event_type = F.col("event_type") if "event_type" in frame.columns else F.lit(None).cast("string")
    frame = frame.select(*COLUMNS, event_type.alias("event_type"))
    if wanted is not None:
        frame = frame.where(F.col("key").isin(wanted))
    if lower is not None:
        frame = frame.where(F.col("created_at") >= F.lit(lower))
    if upper is not None:
        frame = frame.where(F.col("created_at") < F.lit(upper))
    ordered = frame.orderBy(F.col("key").asc_nulls_first(), "seq", "id")

    engine = connect(outbox_url)
    outbox = Outbox(engine, prefix=prefix, schema=schema)
    pending: list[Any] = []
    try:
        for row in ordered.toLocalIterator():
            pending.append(row)
            if len(pending) >= batch:
                _publish(outbox, engine, topic, pending, result)
                pending = []
                if progress:
                    progress(result.replayed)
        if pending:
            _publish(outbox, engine, topic, pending, result)
            if progress:
                progress(result.replayed)
    finally:
        engine.dispose()
    return result


def _publish(outbox: Outbox, engine: sa.Engine, topic: str, rows: list[Any],
             result: ArchiveReplayResult) -> None:
    """One transaction: publish each row again, under its original content type and event type."""
    with Session(engine) as session, session.begin():
        for row in rows:
            # Header names are one in any case: a user's own ``Replay-Of`` gives way to ours, not
            # beside it as a second header of the same name.
            headers = {name: value for name, value in json.loads(row.headers).items()
                       if folded(name) != REPLAY_HEADER} | {REPLAY_HEADER: row.message_id}
            outbox.publish(session, topic, bytes(row.payload), key=row.key, headers=headers,
                           content_type=row.content_type, event_type=row.event_type)
            result.per_key[row.key] += 1
    result.replayed += len(rows)
