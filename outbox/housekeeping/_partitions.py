"""Opt-in time partitions of ``outbox_messages`` on PostgreSQL: retention becomes a partition drop.

The table is partitioned by ``created_at`` (declarative range partitioning),
one partition a UTC day, named ``{table}_pYYYYMMDD``, made ``ahead`` days in
advance; a ``DEFAULT`` partition catches a row dated outside them (a clock far
off), so ``publish()`` never fails for want of a partition. Rows that existed
when a table was converted live in ``{table}_beforeYYYYMMDD`` (everything
before that day). A partition whose every row is past the cutoff goes once all
its rows are published: it is detached, checked for a row that is not
published while detached (nothing can be written to it then), and dropped, in
one transaction under a ``lock_timeout``; if the lock is not granted promptly
the partition waits for the next pass. Rows in partitions that cannot go yet
are deleted row by row, as on an unpartitioned table.

PostgreSQL requires the partition key in every unique constraint, so the
primary key is ``(id, created_at)`` and ``message_id`` is unique together with
``created_at``. Ids still come from one sequence, and a message id is minted
once by ``publish()``; the relay and the audits find rows by ``id`` (every
partition's index is probed: a few per day of retention).

``inbox_messages`` is partitioned too, but by the day inside its message ids
(``_inbox_partitions``): its dedup key ``(consumer_group, message_id)`` must
stay a unique constraint, and it holds the id but no time of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy.exc import DBAPIError

from ..core._envelope import utcnow
from ..core._errors import ConfigurationError
from ..core._tables import MAX_IDENTIFIER_LENGTH, OutboxStatus, OutboxTables

DAY = timedelta(days=1)
DEFAULT_AHEAD_DAYS = 7
LOCK_TIMEOUT = "500ms"
"""How long a partition's creation or drop waits for the table's lock before it is left for later."""


@dataclass
class PartitionReport:
    """What a maintenance pass did: partitions made, dropped (with their estimated rows), kept and why."""

    created: list[str] = field(default_factory=list)
    dropped: dict[str, int | None] = field(default_factory=dict)
    """Partition -> its rows: PostgreSQL's estimate when dropped (None when it was never analyzed:
    counting would hold the table's lock), the exact count in a dry run (a read locks nothing)."""
    kept: dict[str, str] = field(default_factory=dict)


def is_partitioned(conn: Connection, table: Table) -> bool:
    """Whether ``table`` is a partitioned table (PostgreSQL); False elsewhere or when absent."""
    if conn.dialect.name != "postgresql":
        return False
    kind = conn.execute(text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:name)"),
                        {"name": _qualified(conn, table)}).scalar()
    return kind == "p"


def partition_outbox(engine: Engine, tables: OutboxTables, *, ahead_days: int = DEFAULT_AHEAD_DAYS,
                     now: datetime | None = None) -> int | None:
    """Make ``outbox_messages`` partitioned by day, keeping every row; returns the rows moved
    (None when it was partitioned already).

    One transaction, holding the table's ACCESS EXCLUSIVE lock while the rows
    are copied: publishers and relays wait for it (a few seconds a million
    rows), nothing is lost, and a failure leaves the table as it was.
    """
    if engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"partitioned tables need PostgreSQL; this database is {engine.dialect.name}")
    table = tables.messages
    old_name = _checked_name(f"{table.name}_unpartitioned")
    day = _day(now or utcnow())
    with engine.begin() as conn:
        name = _qualified(conn, table)
        conn.execute(text(f"LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE"))
        if is_partitioned(conn, table):
            return None
        seq = conn.execute(text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": name}).scalar()
        earliest = conn.execute(text(f"SELECT min(created_at) FROM {name}")).scalar()
        old = _qualified(conn, table, old_name)
        conn.execute(text(f"ALTER TABLE {name} RENAME TO {_quote(conn, old_name)}"))
        indexes = conn.execute(text(
            "SELECT pg_get_indexdef(x.indexrelid) FROM pg_index x WHERE x.indrelid = to_regclass(:t) "
            "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)"),
            {"t": old}).scalars().all()
        keys: dict[str, str] = {kind: key for kind, key in conn.execute(text(
            "SELECT contype, conname FROM pg_constraint WHERE conrelid = to_regclass(:t) "
            "AND contype IN ('p', 'u')"), {"t": old})}
        conn.execute(text(f"CREATE TABLE {name} (LIKE {old} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                          "INCLUDING STORAGE) PARTITION BY RANGE (created_at)"))
        if earliest is not None and earliest < day:
            conn.execute(text(f"CREATE TABLE {_part(conn, table, 'before', day)} PARTITION OF {name} "
                              f"FOR VALUES FROM (MINVALUE) TO ('{day.isoformat()}')"))
        for n in range(ahead_days + 1):
            _create_day(conn, table, day + n * DAY)
        conn.execute(text(f"CREATE TABLE {_qualified(conn, table, _checked_name(table.name + '_default'))} "
                          f"PARTITION OF {name} DEFAULT"))
        moved = conn.execute(text(f"INSERT INTO {name} SELECT * FROM {old}")).rowcount
        keep_access(conn, table, old)  # before the sequence moves: its owner must own the table
        if seq is not None:
            conn.execute(text(f"ALTER SEQUENCE {seq} OWNED BY NONE"))
        conn.execute(text(f"DROP TABLE {old}"))
        primary = _quote(conn, keys.get("p", f"{table.name}_pkey"))
        conn.execute(text(f"ALTER TABLE {name} ADD CONSTRAINT {primary} PRIMARY KEY (id, created_at)"))
        if "u" in keys:
            conn.execute(text(f"ALTER TABLE {name} ADD CONSTRAINT {_quote(conn, keys['u'])} "
                              "UNIQUE (message_id, created_at)"))
        for definition in indexes:
            # "CREATE INDEX ix ON public.outbox_messages_unpartitioned USING …": the same, on the new table.
            conn.execute(text(re.sub(r" ON \S+ USING ", lambda _: f" ON {name} USING ", definition, count=1)))
        if seq is not None:
            conn.execute(text(f"ALTER SEQUENCE {seq} OWNED BY {name}.id"))
    return moved


def maintain_partitions(engine: Engine, tables: OutboxTables, cutoff: datetime, *,
                        ahead_days: int = DEFAULT_AHEAD_DAYS, now: datetime | None = None,
                        dry_run: bool = False) -> PartitionReport:
    """Make the coming days' partitions, and drop those wholly older than ``cutoff`` whose rows
    are all published. Each partition is its own short transaction under a lock timeout."""
    report = PartitionReport()
    table = tables.messages
    with engine.connect() as conn:
        if not is_partitioned(conn, table):
            return report
        names = conn.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(:t)"), {"t": _qualified(conn, table)}).scalars().all()
    days = {_bounds(table, n): n for n in names}
    today = _day(now or utcnow())
    for n in range(ahead_days + 1):
        day = today + n * DAY
        if any(lo is not None and lo == day for lo, _ in days) or dry_run:
            continue
        try:
            with engine.begin() as conn:
                conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
                report.created.append(_create_day(conn, table, day))
        except DBAPIError as exc:
            report.kept[_day_name(table, day)] = f"not created yet: {_first_line(exc)}"
    for name in sorted(names):
        upper = _bounds(table, name)[1]
        if upper is not None and upper <= cutoff:
            _retire(engine, table, name, report, dry_run)
    return report


def _retire(engine: Engine, table: Table, name: str, report: PartitionReport, dry_run: bool) -> None:
    def unpublished(conn: Connection, part: str) -> str | None:
        open_rows = _open_rows(conn, part)
        return f"{open_rows}{'+' if open_rows == 1000 else ''} row(s) not published" if open_rows else None

    retire_day(engine, table, name, report, dry_run, keep=unpublished)


def retire_day(engine: Engine, table: Table, name: str, report: PartitionReport, dry_run: bool, *,
               keep: Callable[[Connection, str], str | None]) -> None:
    """Detach and drop the day partition ``name`` unless ``keep(conn, partition)`` gives a reason.

    ``keep`` is asked twice: first in a plain read, which no writer waits on (a day that must
    stay is kept without asking for the table's lock: a queued lock request stalls every
    writer), then again once the partition is detached in the dropping transaction, when
    nothing can be written to it any more, so the answer holds. One short transaction under
    ``LOCK_TIMEOUT``; a lock not granted in time leaves the day to the next pass.
    """
    try:
        with engine.begin() as conn:
            reason = keep(conn, _qualified(conn, table, name))
        if reason:
            report.kept[name] = reason
            return
        with engine.begin() as conn:
            parent, part = _qualified(conn, table), _qualified(conn, table, name)
            conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
            if not dry_run:
                conn.execute(text(f"ALTER TABLE {parent} DETACH PARTITION {part}"))
            reason = keep(conn, part)
            if reason:
                report.kept[name] = reason
                conn.rollback()
                return
            if dry_run:
                report.dropped[name] = conn.execute(text(f"SELECT count(*) FROM {part}")).scalar_one()
                return
            # reltuples is -1 until the partition is first analyzed: unknown, not "0 rows".
            estimate = conn.execute(text("SELECT reltuples::bigint FROM pg_class "
                                         "WHERE oid = to_regclass(:p)"), {"p": part}).scalar_one()
            conn.execute(text(f"DROP TABLE {part}"))
            report.dropped[name] = None if estimate < 0 else int(estimate)
    except DBAPIError as exc:
        report.kept[name] = f"not dropped yet: {_first_line(exc)}"


def _open_rows(conn: Connection, part: str) -> int:
    """Up to 1,000 rows of ``part`` not published, found through the partial index of open rows.

    Under DETACH this runs holding the parent's ACCESS EXCLUSIVE lock: a sequential scan of a
    settled day (the planner's choice on a never-analyzed partition) would stall publishers for
    as long as it reads the whole day; the index holds only the unfinished rows.
    """
    conn.execute(text("SET LOCAL enable_seqscan = off"))
    found = conn.execute(text(
        f"SELECT count(*) FROM (SELECT 1 FROM {part} WHERE status <> :published LIMIT 1000) o"),
        {"published": OutboxStatus.PUBLISHED}).scalar_one()
    conn.execute(text("SET LOCAL enable_seqscan = on"))
    return int(found)


def _create_day(conn: Connection, table: Table, day: datetime) -> str:
    name = _day_name(table, day)
    conn.execute(text(f"CREATE TABLE IF NOT EXISTS {_qualified(conn, table, name)} PARTITION OF "
                      f"{_qualified(conn, table)} FOR VALUES FROM ('{day.isoformat()}') "
                      f"TO ('{(day + DAY).isoformat()}')"))
    return name


def _bounds(table: Table, name: str) -> tuple[datetime | None, datetime | None]:
    """(lower, upper) of a partition this module named; (None, None) for others and the default."""
    found = re.fullmatch(re.escape(table.name) + r"_(p|before)(\d{8})", name)
    if found is None:
        return None, None
    day = datetime.strptime(found.group(2), "%Y%m%d").replace(tzinfo=UTC)
    return (day, day + DAY) if found.group(1) == "p" else (None, day)


def _day(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _day_name(table: Table, day: datetime) -> str:
    return _checked_name(f"{table.name}_p{day:%Y%m%d}")


def _part(conn: Connection, table: Table, kind: str, day: datetime) -> str:
    return _qualified(conn, table, _checked_name(f"{table.name}_{kind}{day:%Y%m%d}"))


def _checked_name(name: str) -> str:
    if len(name) > MAX_IDENTIFIER_LENGTH:
        raise ConfigurationError(f"the partition name {name!r} is longer than {MAX_IDENTIFIER_LENGTH} "
                                 "characters: use a shorter table prefix")
    return name


def _quote(conn: Connection, name: str) -> str:
    return conn.dialect.identifier_preparer.quote(name)


def _qualified(conn: Connection, table: Table, name: str | None = None) -> str:
    quoted = _quote(conn, name or table.name)
    return f"{_quote(conn, table.schema)}.{quoted}" if table.schema else quoted


def _first_line(exc: DBAPIError) -> str:
    return str(exc.orig or exc).strip().splitlines()[0]


def keep_access(conn: Connection, table: Table, old: str) -> None:
    """Give the converted table and its partitions the old table's owner, and the table its grants.

    ``CREATE TABLE … LIKE`` copies neither: converted by an administrator, the
    table would belong to them, so the owner's retention passes could no longer
    make or drop a day, and a publisher, relay or inbox running as a role
    granted the old table would fail on every row ("permission denied").
    """
    quote = conn.dialect.identifier_preparer.quote
    name = _qualified(conn, table)
    owner = conn.execute(text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = to_regclass(:t)"),
                         {"t": old}).scalar_one()
    grants = conn.execute(text(
        "SELECT a.privilege_type, CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END, "
        "a.is_grantable FROM pg_class c, aclexplode(c.relacl) a "
        "WHERE c.oid = to_regclass(:t) AND a.grantee <> c.relowner"), {"t": old}).all()
    parts = conn.execute(text(
        "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = to_regclass(:t)"),
        {"t": name}).scalars().all()
    for relation in [name, *parts]:
        conn.execute(text(f"ALTER TABLE {relation} OWNER TO {quote(owner)}"))
    for privilege, grantee, grantable in grants:
        to = "PUBLIC" if grantee == "PUBLIC" else quote(grantee)
        conn.execute(text(f"GRANT {privilege} ON TABLE {name} TO {to}"
                          + (" WITH GRANT OPTION" if grantable else "")))
