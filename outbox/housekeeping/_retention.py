"""Delete settled rows past their retention, in short batches that never wait on the hot path.

Each batch is its own transaction: it picks up to ``batch_size`` settled rows
past the cutoff in primary-key order, after the last key the previous batch
reached, and deletes exactly those (the delete checks the same conditions
again). On PostgreSQL a published outbox row is final, so its batch is one
statement that locks no row before deleting it (``_pg_batches``); a row someone
else holds is waited for briefly, then passed over. Inbox records (an inbox
counting a redelivery locks its record), and every table on MySQL and MariaDB,
are picked ``FOR UPDATE SKIP LOCKED``: a row another retention run or an inbox
has locked is passed over, never waited for; the next run takes it. Publishers
insert new rows, the relay updates pending ones and the inbox inserts new
records, none of which a batch selects, so none of them waits on it. MySQL
runs the batch at READ COMMITTED (no gap locks, locks only on matched rows).
On SQLite a batch is one short write transaction, as every writer's is there.

A killed run loses at most its open batch, which rolls back; running again
continues. Several runs at once split the rows between them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Engine, delete, func, literal, literal_column, select
from sqlalchemy.exc import DBAPIError

from ..core._engine import worker_engine
from ..core._envelope import utcnow
from ..core._errors import ConfigurationError
from ..core._outage import OutageBackoff, is_database_outage
from ..core._tables import MYSQL_FAMILY, OutboxTables
from ..producer import Outbox
from ._durations import parse_period
from ._inbox_partitions import maintain_inbox_partitions
from ._partitions import PartitionReport, is_partitioned, maintain_partitions
from ._pg_batches import Batch, key_of, pg_batch, values_of
from ._targets import Target, inbox_target, outbox_target

DEFAULT_BATCH_SIZE = 1000
"""Rows per delete transaction. A transaction's WAL is what a relay's commit may have to flush
behind its own: a published outbox row deleted costs about 290 bytes of it on PostgreSQL (its
delete and its heap page's first image since the last checkpoint; 340 with the row lock the pick
took before ``_pg_batches``), so 1,000 rows are about 290 kB against 1.7 MB for 5,000, and a batch
holds a core a fifth as long. Alone (duty 1) it deletes about a
third slower, still over ten times the Spark archive's rate (docs/operations.md, "Housekeeping")."""
MAX_BATCH_SIZE = 100_000
BATCH_ATTEMPTS = 5
DEFAULT_DUTY = 0.15
"""The share of a pass's time spent deleting: after a batch that took t seconds it rests
t * (1 - duty) / duty, so the relay and the inbox beside it keep the rest of the database's CPU
and WAL (docs/operations.md, "Housekeeping"). 0.15: on PostgreSQL an outbox batch without a row
lock (``_pg_batches``) deletes a row for 30% less CPU and 16% less WAL, so at 0.15 a pass deletes
as many rows a second as it did at 0.25 with the lock (median 16,300 against 15,600 beside a
relay-like probe under other sessions' load; 390,000 rows/s alone on a quiet machine at duty 1),
and the probe's median p99 was 12.1 ms against 21.5 (14.6 with no pass). ``duty=1`` for a
clean-up on a database nothing else uses."""
BATCH_RETRY = OutageBackoff(first=0.05)
"""A batch rolled back by a deadlock or a lost connection runs again after 0.05 s, 0.1 s, 0.2 s …"""

Progress = Callable[[str, int], None]
"""Called after each batch with the table's name and the rows deleted from it so far."""


@dataclass
class RetentionResult:
    """Rows deleted per table (or, with ``dry_run``, rows that would be), and the cutoffs used."""

    deleted: dict[str, int] = field(default_factory=dict)
    cutoffs: dict[str, datetime] = field(default_factory=dict)
    dry_run: bool = False
    stopped: bool = False
    """True when ``stop`` was set before every table was done."""
    partitions: PartitionReport | None = None
    """On a partitioned outbox table: the partitions made, dropped (estimated rows, not in
    ``deleted``) and kept (why)."""
    inbox_partitions: PartitionReport | None = None
    """The same for a partitioned ``inbox_messages`` (``_inbox_partitions``); days are dropped only
    by a pass over every group (no ``group``), whose ``dedup_window`` covers all of them."""

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


def run_retention(
    bind: Outbox | Engine,
    *,
    older_than: timedelta | str | float | None = None,
    dedup_window: timedelta | str | float | None = None,
    tables: OutboxTables | None = None,
    group: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    now: datetime | None = None,
    duty: float = DEFAULT_DUTY,
) -> RetentionResult:
    """Delete published outbox rows created more than ``older_than`` ago, and inbox dedup
    records whose message is older than ``dedup_window``; returns what was deleted.

    Give at least one of the two. ``dedup_window`` must be at least the
    ``Inbox(dedup_window=)`` of every group using these tables, which must be
    set: a redelivery older than the window is then counted as expired, not
    parked as a conflict (docs/consumer.md). Safe to call from a scheduler,
    from several processes at once, and to kill at any point. ``bind`` is an
    ``Outbox`` (its engine and tables) or an engine with ``tables``.
    ``group`` limits the inbox records to one consumer group's. ``stop`` ends
    the run between batches. ``duty`` (0 < duty <= 1) is the share of the time the pass
    deletes; it rests between batches for the remainder, so that it never takes more than that
    share of the database from the relay and the inbox beside it (1: no rest, for a database
    nothing else uses).
    """
    engine, tables = _bound(bind, tables)
    if older_than is None and dedup_window is None:
        raise ConfigurationError("give older_than (outbox rows), dedup_window (inbox records) or both")
    if (isinstance(batch_size, bool) or not isinstance(batch_size, int)
            or not 1 <= batch_size <= MAX_BATCH_SIZE):
        raise ConfigurationError(f"batch_size must be an int from 1 to {MAX_BATCH_SIZE}, got {batch_size!r}")
    if isinstance(duty, bool) or not isinstance(duty, int | float) or not 0 < duty <= 1:
        raise ConfigurationError(f"duty must be a share of the time above 0 and at most 1, got {duty!r}")
    moment = now or utcnow()
    jobs: list[tuple[Target, datetime]] = []
    if older_than is not None:
        jobs.append((outbox_target(tables), moment - parse_period(older_than, "retention")))
    if dedup_window is not None:
        jobs.append((inbox_target(tables, group), moment - parse_period(dedup_window, "dedup window")))
    engine = worker_engine(engine)
    result = RetentionResult(dry_run=dry_run)
    inbox = inbox_target(tables)
    if dedup_window is None and _partitioned(engine, inbox):
        # Any pass makes the inbox's coming days, so a relay's retention alone keeps them made.
        result.inbox_partitions = maintain_inbox_partitions(engine, tables, None, now=moment,
                                                            dry_run=dry_run)
    for target, cutoff in jobs:
        result.cutoffs[target.name] = cutoff
        if stop is not None and stop.is_set():
            result.stopped = True
            break
        if target.table is tables.messages and _partitioned(engine, target):
            result.partitions = maintain_partitions(engine, tables, cutoff, now=moment, dry_run=dry_run)
        if target.table is tables.inbox_messages and _partitioned(engine, target):
            # One group's pass must not drop a day holding other groups' records (their windows
            # may be longer): it makes the coming days and deletes its own rows one by one.
            result.inbox_partitions = maintain_inbox_partitions(
                engine, tables, cutoff if group is None else None, now=moment, dry_run=dry_run)
        if dry_run:
            # Rows of a partition that would be dropped are reported with it, not as deletions.
            report = result.partitions if target.table is tables.messages else result.inbox_partitions
            dropping = list(report.dropped) if report else []
            result.deleted[target.name] = count_settled(engine, target, cutoff, besides=dropping)
            continue
        result.deleted[target.name] = 0
        working = time.monotonic()
        for done in _batches(engine, target, cutoff, batch_size):
            result.deleted[target.name] += done
            if progress is not None:
                progress(target.name, result.deleted[target.name])
            if stop is not None and stop.is_set():
                result.stopped = True
                return result
            if not _rest(time.monotonic() - working, duty, stop):
                result.stopped = True
                return result
            working = time.monotonic()
    return result


def _rest(worked: float, duty: float, stop: threading.Event | None) -> bool:
    """Rest after ``worked`` seconds of deleting so that deleting is ``duty`` of the time; False
    when ``stop`` was set meanwhile."""
    rest = worked * (1 - duty) / duty
    if stop is None:
        time.sleep(rest)
        return True
    return not stop.wait(rest)


def _partitioned(engine: Engine, target: Target) -> bool:
    if engine.dialect.name != "postgresql":
        return False
    with engine.connect() as conn:
        return is_partitioned(conn, target.table)


def count_settled(engine: Engine, target: Target, cutoff: datetime, besides: Sequence[str] = ()) -> int:
    """How many rows a run with this cutoff would delete now (reads, locks nothing), leaving out
    the rows of the partitions named in ``besides`` (PostgreSQL: they would be dropped whole)."""
    query = select(func.count()).select_from(target.table).where(*target.settled(cutoff))
    if target.newest_kept is not None and engine.dialect.name != "postgresql":  # as ``_one_batch``
        query = query.where(target.newest_kept < select(func.max(target.newest_kept)).scalar_subquery())
    if besides:
        quote = engine.dialect.identifier_preparer.quote
        schema = f"{quote(target.table.schema)}." if target.table.schema else ""
        query = query.where(literal_column("tableoid").not_in(
            [func.to_regclass(literal(schema + quote(name))) for name in besides]))
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def _batches(engine: Engine, target: Target, cutoff: datetime, size: int) -> Iterator[int]:
    """Delete batch after batch, yielding each one's count, until a batch finds fewer than ``size``."""
    after: Sequence[Any] | None = None
    while True:
        for attempt in range(BATCH_ATTEMPTS):
            try:
                picked, last, gone = _one_batch(engine, target, cutoff, size, after)
                break
            except DBAPIError as exc:
                # A deadlock (InnoDB can pick a batch as the victim of a publisher's unique-index
                # check) or a lost connection: the batch rolled back whole, so it is run again.
                if not is_database_outage(exc) or attempt == BATCH_ATTEMPTS - 1:
                    raise
                time.sleep(BATCH_RETRY.delay(attempt + 1))
        if not picked:
            return
        yield gone
        if picked < size:
            return
        after = last


def _one_batch(engine: Engine, target: Target, cutoff: datetime, size: int,
               after: Sequence[Any] | None) -> Batch:
    """One transaction: pick the next settled rows after ``after``, delete them.

    Returns how many were picked, the last one's key (the next batch starts after it) and how
    many were deleted.
    """
    if engine.dialect.name == "postgresql":
        return pg_batch(engine, target, cutoff, size, after)
    with engine.begin() as conn:
        kept: list[ColumnElement[bool]] = []
        if target.newest_kept is not None:  # read apart: MySQL refuses a DELETE naming its table again
            newest = conn.execute(select(func.max(target.newest_kept))).scalar()
            kept = [target.newest_kept < newest] if newest is not None else []
        pick = (select(*target.key).where(*target.settled(cutoff), *kept)
                .order_by(*target.key).limit(size))
        if after is not None:
            pick = pick.where(key_of(target) > values_of(target, after))
        if engine.dialect.name in MYSQL_FAMILY:
            pick = pick.with_for_update(skip_locked=True)
        rows = list(conn.execute(pick).all())
        if not rows:
            return 0, None, 0
        gone = conn.execute(delete(target.table).where(
            key_of(target).in_([tuple(r) if len(target.key) > 1 else r[0] for r in rows]),
            *target.settled(cutoff), *kept)).rowcount
    return len(rows), tuple(rows[-1]), gone


def _bound(bind: Outbox | Engine, tables: OutboxTables | None) -> tuple[Engine, OutboxTables]:
    if isinstance(bind, Outbox):
        if tables is not None:
            raise ConfigurationError("pass tables= with an engine; an Outbox names its own tables")
        engine: object = bind.engine
        tables = bind.tables
    else:
        engine = bind
    if not isinstance(engine, Engine):
        raise ConfigurationError(f"retention runs on a sync Engine (or an Outbox made with one), "
                                 f"got {type(engine).__name__}")
    return engine, tables or OutboxTables()
