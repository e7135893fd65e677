"""Opt-in partitions of ``inbox_messages`` on PostgreSQL, by the time inside each message id.

Why by the message id: PostgreSQL requires the partition key in every unique
constraint, and the inbox's dedup promise *is* a unique constraint, on
``(consumer_group, message_id)``. Partitioned by ``message_id`` itself, the
primary key stays exactly that, the database still refuses a second record of
an id in any partition, and every statement of the inbox's dedup records (its ``ON
CONFLICT`` claims, its upserts, its lookups) is unchanged. A duplicate is the
same id, so it always meets its first copy in the same partition.

``publish()`` mints UUIDv7 ids, whose first 48 bits are the Unix time in
milliseconds, and PostgreSQL orders UUIDs byte by byte: the ids of one UTC day
are one range, ``[day's first id, next day's first id)``. So the table is
range-partitioned by ``message_id``, one partition a day (``{table}_pYYYYMMDD``),
made ``ahead`` days in advance; rows that existed when it was converted, and
ids whose first bits read as a time before then, live in
``{table}_beforeYYYYMMDD``. Ids that are not UUIDv7 (a CloudEvent's id, a
producer's own) read as a random time, almost always after 2200: they go to
``{table}_untimed`` (ids from 2200 on), the rest to ``{table}_default``. Those
two are never dropped; retention deletes their settled rows row by row.

Retention is unchanged in what it deletes: a record goes only once its message
was created *and* processed before the cutoff (``_targets.inbox_target``). A
day whose ids are all older than the cutoff is dropped only when every row in
it is such a record; a message processed late (a lagging consumer, a delayed
message) keeps its day until it too is out of the window. The check runs twice:
first as a plain read (nothing waits on it), then again inside the transaction
that DETACHes the partition (nothing can be written to it then), on a BRIN
index of ``(processed_at, created_at)`` so that it reads only the block ranges
that could hold a recent row, not the whole day, while it holds the table's
lock. That transaction waits at most ``LOCK_TIMEOUT`` for the lock; if it is not
granted, the day waits for the next pass.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy.exc import DBAPIError

from ..core._envelope import utcnow
from ..core._errors import ConfigurationError
from ..core._tables import OutboxTables
from ._partitions import (
    DAY,
    DEFAULT_AHEAD_DAYS,
    LOCK_TIMEOUT,
    PartitionReport,
    _checked_name,
    _day,
    _first_line,
    _qualified,
    _quote,
    is_partitioned,
    keep_access,
    retire_day,
)

UNTIMED_FROM = datetime(2200, 1, 1, tzinfo=UTC)
"""Ids whose first 48 bits read as this time or later go to ``{table}_untimed`` (not UUIDv7, mostly)."""
MAX_UNSETTLED_SHOWN = 1000
MAX_AHEAD_DAYS = 366
"""Days made ahead at most: a partition a day, and every partition costs each statement's planning."""


def first_id_of(moment: datetime) -> uuid.UUID:
    """The smallest UUID whose first 48 bits are ``moment`` in Unix milliseconds (a UUIDv7's time)."""
    millis = int(moment.timestamp() * 1000)
    return uuid.UUID(bytes=millis.to_bytes(6, "big") + bytes(10))


def _checked_ahead(ahead_days: int) -> int:
    """Refuse a count of days ahead that is not an int from 0 to ``MAX_AHEAD_DAYS``: a negative
    one would make no day at all, not even today's (every record to the default partition)."""
    if (isinstance(ahead_days, bool) or not isinstance(ahead_days, int)
            or not 0 <= ahead_days <= MAX_AHEAD_DAYS):
        raise ConfigurationError(f"ahead_days must be an int from 0 to {MAX_AHEAD_DAYS}, got {ahead_days!r}")
    return ahead_days


def settled_index_name(tables: OutboxTables) -> str:
    """The BRIN index of ``(processed_at, created_at)`` that a partitioned inbox table gets."""
    return _checked_name(f"ix_{tables.prefix}inbox_settled")


def partition_inbox(engine: Engine, tables: OutboxTables, *, ahead_days: int = DEFAULT_AHEAD_DAYS,
                    now: datetime | None = None) -> int | None:
    """Make ``inbox_messages`` partitioned by its ids' day, keeping every row; returns the rows
    moved (None when it was partitioned already).

    One transaction holding the table's ACCESS EXCLUSIVE lock while the rows
    are copied: consumers wait for it, nothing is lost, a failure leaves the
    table as it was. The store's statements are the same on both layouts.
    """
    if engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"partitioned tables need PostgreSQL; this database is {engine.dialect.name}")
    _checked_ahead(ahead_days)
    table = tables.inbox_messages
    old_name = _checked_name(f"{table.name}_unpartitioned")
    day = _day(now or utcnow())
    # Every name the passes after it will make must fit too, the longest being a coming day's
    # fence: a prefix they cannot serve is refused here, before anything changes.
    _fence(table, day)
    with engine.begin() as conn:
        name = _qualified(conn, table)
        conn.execute(text(f"LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE"))
        if is_partitioned(conn, table):
            return None
        old = _qualified(conn, table, old_name)
        conn.execute(text(f"ALTER TABLE {name} RENAME TO {_quote(conn, old_name)}"))
        indexes = conn.execute(text(
            "SELECT pg_get_indexdef(x.indexrelid) FROM pg_index x WHERE x.indrelid = to_regclass(:t) "
            "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)"),
            {"t": old}).scalars().all()
        primary = conn.execute(text(
            "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(:t) AND contype = 'p'"),
            {"t": old}).scalar() or f"{table.name}_pkey"
        conn.execute(text(f"CREATE TABLE {name} (LIKE {old} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                          "INCLUDING STORAGE) PARTITION BY RANGE (message_id)"))
        before = _checked_name(f"{table.name}_before{day:%Y%m%d}")
        conn.execute(text(f"CREATE TABLE {_qualified(conn, table, before)} PARTITION OF {name} "
                          f"FOR VALUES FROM (MINVALUE) TO ('{first_id_of(day)}')"))
        for n in range(ahead_days + 1):
            _create_day(conn, table, day + n * DAY)
        conn.execute(text(f"CREATE TABLE {_qualified(conn, table, _checked_name(table.name + '_untimed'))} "
                          f"PARTITION OF {name} FOR VALUES FROM ('{first_id_of(UNTIMED_FROM)}') "
                          "TO (MAXVALUE)"))
        conn.execute(text(f"CREATE TABLE {_qualified(conn, table, _default_name(table))} "
                          f"PARTITION OF {name} DEFAULT"))
        moved = conn.execute(text(f"INSERT INTO {name} SELECT * FROM {old}")).rowcount
        keep_access(conn, table, old)
        conn.execute(text(f"DROP TABLE {old}"))
        # (consumer_group, message_id) holds the partition key: the dedup key stays the primary key.
        conn.execute(text(f"ALTER TABLE {name} ADD CONSTRAINT {_quote(conn, primary)} "
                          "PRIMARY KEY (consumer_group, message_id)"))
        for definition in indexes:
            conn.execute(text(re.sub(r" ON \S+ USING ", lambda _: f" ON {name} USING ", definition, count=1)))
        conn.execute(text(f"CREATE INDEX {_quote(conn, settled_index_name(tables))} ON {name} "
                          "USING brin (processed_at, created_at)"))
    return moved


def maintain_inbox_partitions(engine: Engine, tables: OutboxTables, cutoff: datetime | None, *,
                              ahead_days: int = DEFAULT_AHEAD_DAYS, now: datetime | None = None,
                              dry_run: bool = False) -> PartitionReport:
    """Make the coming days' partitions; with a ``cutoff``, drop the days whose ids are all older
    and whose every row is a record created and processed before it.

    ``cutoff`` is now minus the dedup window of *every* group (the partitions
    hold all groups' records): a pass limited to one group passes None.
    """
    _checked_ahead(ahead_days)
    report = PartitionReport()
    table = tables.inbox_messages
    with engine.connect() as conn:
        if not is_partitioned(conn, table):
            return report
        names = conn.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:t)"), {"t": _qualified(conn, table)}).scalars().all()
    today = _day(now or utcnow())
    days = {_bounds(table, n)[0] for n in names}
    default = _default_name(table) if _default_name(table) in names else None
    if default is not None and not dry_run:
        _drop_fences(engine, table, default)
    for n in range(ahead_days + 1):
        day = today + n * DAY
        if day in days or dry_run:
            continue
        try:
            if default is not None and day > today:
                if not _make_day_beside_default(engine, table, default, day):
                    report.kept[_day_name(table, day)] = "not created yet: another pass took its fence down"
                    continue
            elif default is not None and _default_holds(engine, table, default, day):
                report.kept[_day_name(table, day)] = (
                    "not created: the default partition holds records of this day (no pass made it "
                    "in time); they stay there, deleted row by row")
                continue
            else:
                with engine.begin() as conn:
                    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
                    _create_day(conn, table, day)
            report.created.append(_day_name(table, day))
        except DBAPIError as exc:
            report.kept[_day_name(table, day)] = f"not created yet: {_first_line(exc)}"
    if cutoff is None:
        return report
    for name in sorted(names):
        upper = _bounds(table, name)[1]
        if upper is not None and upper <= cutoff:
            _retire(engine, table, name, cutoff, report, dry_run)
    return report


def _make_day_beside_default(engine: Engine, table: Table, default: str, day: datetime) -> bool:
    """Make a coming day without reading the default partition under the table's lock.

    Making a partition beside a ``DEFAULT`` one makes PostgreSQL check that
    the default holds no row of the new range, by reading all of it while it
    holds the parent's ACCESS EXCLUSIVE lock, unless a valid constraint of the
    default already proves it. Ids that are not UUIDv7 put rows there, so the
    proof comes first: a ``NOT VALID`` check constraint excluding the day's
    ids (a brief lock, no read), validated while writers carry on (SHARE
    UPDATE EXCLUSIVE), then the day made in an instant and the fence dropped.
    Only for a day still to come: while the fence stands (the validation's
    read of the default), an id of that day would be refused by the default —
    only a producer clock a day ahead, or a non-UUIDv7 id falling into that
    one day of its 9,000-year range, can send one; the inbox waits that out as
    an outage (``_outage``), never counting it against the message, as it does
    a fence a killed pass left up until the next pass takes it down. False when the fence was gone by
    the time the day was to be made (another pass took it down): the day waits
    for the next pass rather than be made by a read of the default under the lock.
    """
    fence, lo, hi = _fence(table, day), first_id_of(day), first_id_of(day + DAY)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            part = _qualified(conn, table, default)
            conn.execute(text(f"ALTER TABLE {part} ADD CONSTRAINT {_quote(conn, fence)} "
                              f"CHECK (message_id < '{lo}' OR message_id >= '{hi}') NOT VALID"))
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            conn.execute(text(f"ALTER TABLE {part} VALIDATE CONSTRAINT {_quote(conn, fence)}"))
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            # The locks the creation takes anyway, first (the table's, the default's, not the other
            # partitions'): then the fence, if it still stands (a concurrent pass sweeps the fences
            # it takes for leftovers), stands until the day is made.
            conn.execute(text(f"LOCK TABLE ONLY {_qualified(conn, table)} IN ACCESS EXCLUSIVE MODE"))
            conn.execute(text(f"LOCK TABLE ONLY {part} IN ACCESS EXCLUSIVE MODE"))
            if not conn.execute(text(
                    "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass(:p) "
                    "AND conname = :fence AND convalidated)"), {"p": part, "fence": fence}).scalar_one():
                return False
            _create_day(conn, table, day)
            conn.execute(text(f"ALTER TABLE {part} DROP CONSTRAINT {_quote(conn, fence)}"))
        return True
    finally:
        _drop_fences(engine, table, default, only=fence)


def _default_holds(engine: Engine, table: Table, default: str, day: datetime) -> bool:
    """Whether the default partition holds a record of ``day`` (a plain read, which nobody waits on).

    Today's partition cannot be fenced (today's ids go to the default until it exists), so
    PostgreSQL would read the whole default under the table's lock to make it, every consumer
    waiting, and refuse when it holds one of today's records. Asked first, such a day is left
    unmade without asking for the lock.
    """
    with engine.connect() as conn:
        return bool(conn.execute(text(
            f"SELECT EXISTS (SELECT 1 FROM {_qualified(conn, table, default)} "
            "WHERE message_id >= :lo AND message_id < :hi)"),
            {"lo": first_id_of(day), "hi": first_id_of(day + DAY)}).scalar_one())


def _drop_fences(engine: Engine, table: Table, default: str, *, only: str | None = None) -> None:
    """Drop the fences a pass left on the default partition (its lock was not granted in time)."""
    try:
        with engine.begin() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            part = _qualified(conn, table, default)
            like = _fence(table, None).replace("_", r"\_")
            fences = conn.execute(text(
                "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(:p) AND contype = 'c' "
                "AND conname LIKE :like"), {"p": part, "like": like}).scalars().all()
            for fence in fences:
                if only is None or fence == only:
                    conn.execute(text(f"ALTER TABLE {part} DROP CONSTRAINT {_quote(conn, fence)}"))
    except DBAPIError:
        pass  # the next pass drops it


def _fence(table: Table, day: datetime | None) -> str:
    """The default partition's check constraint that keeps ``day``'s ids out (None: a LIKE of all)."""
    return _checked_name(f"ck_{table.name}_not_p" + ("%" if day is None else f"{day:%Y%m%d}"))


def _default_name(table: Table) -> str:
    return _checked_name(table.name + "_default")


def _retire(engine: Engine, table: Table, name: str, cutoff: datetime, report: PartitionReport,
            dry_run: bool) -> None:
    def inside_window(conn: Connection, part: str) -> str | None:
        unsettled = _unsettled(conn, part, cutoff)
        return _inside(unsettled) if unsettled else None

    _summarize(engine, table, name)
    retire_day(engine, table, name, report, dry_run, keep=inside_window)


def _unsettled(conn: Connection, part: str, cutoff: datetime) -> int:
    """Up to ``MAX_UNSETTLED_SHOWN`` records of ``part`` that retention must keep: created or
    processed at or after ``cutoff`` (the negation of ``inbox_target``'s rule).

    Planned on the BRIN index, never as a read of the whole day: a settled day's block ranges
    all end before the cutoff, so it reads a few index pages and the ranges written since they
    were summarized — the same whatever the day's size, also while DETACH holds the table's lock.
    """
    conn.execute(text("SET LOCAL enable_seqscan = off"))
    found = conn.execute(text(
        f"SELECT count(*) FROM (SELECT 1 FROM {part} WHERE processed_at >= :cutoff "
        f"OR created_at >= :cutoff LIMIT {MAX_UNSETTLED_SHOWN}) o"), {"cutoff": cutoff}).scalar_one()
    conn.execute(text("SET LOCAL enable_seqscan = on"))
    return int(found)


def _summarize(engine: Engine, table: Table, name: str) -> None:
    """Summarize the BRIN ranges of ``name`` that were never summarized, outside any lock a writer
    waits on, so the check under DETACH reads only what changed since. Best effort: without it
    (another role owns the index) the check is as exact, only slower."""
    try:
        with engine.begin() as conn:
            indexes = conn.execute(text(
                "SELECT x.indexrelid::regclass::text FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
                "JOIN pg_am a ON a.oid = i.relam WHERE x.indrelid = to_regclass(:p) AND a.amname = 'brin'"),
                {"p": _qualified(conn, table, name)}).scalars().all()
            for index in indexes:
                conn.execute(text("SELECT brin_summarize_new_values(to_regclass(:i))"), {"i": index})
    except DBAPIError:
        pass


def _inside(count: int) -> str:
    more = "+" if count == MAX_UNSETTLED_SHOWN else ""
    return f"{count}{more} record(s) created or processed inside the dedup window"


def _create_day(conn: Connection, table: Table, day: datetime) -> str:
    name = _day_name(table, day)
    conn.execute(text(f"CREATE TABLE IF NOT EXISTS {_qualified(conn, table, name)} PARTITION OF "
                      f"{_qualified(conn, table)} FOR VALUES FROM ('{first_id_of(day)}') "
                      f"TO ('{first_id_of(day + DAY)}')"))
    return name


def _day_name(table: Table, day: datetime) -> str:
    return _checked_name(f"{table.name}_p{day:%Y%m%d}")


def _bounds(table: Table, name: str) -> tuple[datetime | None, datetime | None]:
    """(first day, end) by ids' time of a partition this module named; (None, None) for the
    untimed and default ones, which are never dropped."""
    found = re.fullmatch(re.escape(table.name) + r"_(p|before)(\d{8})", name)
    if found is None:
        return None, None
    day = datetime.strptime(found.group(2), "%Y%m%d").replace(tzinfo=UTC)
    return (day, day + DAY) if found.group(1) == "p" else (None, day)
