"""The relay's SQL, one class per dialect: one fetch and at most three bulk updates per batch.

What every dialect shares is ``_sql_shared.RelayStatements``; each class here
says what its database does its own way, and ``statements_for`` picks one
once per set of tables and dialect:

- **PostgreSQL**: each bulk update is one ``UPDATE … FROM unnest(...)``
  statement with one array per column; the fetch is one index range scan per
  shard, merged in id order, and leaves out the rows being written in the
  statement itself (pipelined batches).
- **MySQL and MariaDB**: each bulk update is one multi-table ``UPDATE`` joined
  to ``JSON_TABLE(:rows)`` (MySQL 8.0.4+, MariaDB 10.6+), whose one parameter
  is the batch as a JSON array — an executemany of UPDATEs is one round trip
  per row there; the rows being written are dropped after the fetch.
- **SQLite** (in process): each bulk update is one executemany; batches are
  not pipelined.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import (
    ARRAY,
    BigInteger,
    Integer,
    LargeBinary,
    Text,
    bindparam,
    cast,
    exists,
    func,
    literal_column,
    select,
    true,
    union_all,
    update,
)

from ..core._engine import EACH_RUN
from ..core._errors import ConfigurationError
from ..core._mysql import MAY_BLOCK, json_rows, json_table
from ..core._pg_arrays import IntList, array_params, int_array, rows_of
from ..core._tables import MYSQL_FAMILY, OutboxStatus, OutboxTables
from ._session import fetch_session
from ._sql_shared import ROW_COLUMNS, Marks, RelayStatements, add_mark, empty_marks

__all__ = ["ROW_COLUMNS", "Marks", "RelayStatements", "add_mark", "empty_marks", "statements_for"]


IDLE_FLOOR = 5.0
"""The fewest seconds a relay's transaction may sit idle before PostgreSQL ends it (``end_if_idle``):
a lease TTL may be a fraction of a second, and on a loaded host a thread can wait that long for the
CPU between two statements."""

IDLE_CEILING_MS = 2**31 - 1
"""The most ``idle_in_transaction_session_timeout`` takes (milliseconds, about 24.8 days): PostgreSQL
refuses a larger value, and a longer lease TTL would otherwise fail every mark and lease transaction."""


def idle_timeout_ms(seconds: float) -> int:
    """``idle_in_transaction_session_timeout`` for a relay whose lease lasts ``seconds``: within
    ``IDLE_FLOOR`` and ``IDLE_CEILING_MS`` (``PostgresRelayStatements.end_if_idle``)."""
    return min(round(max(seconds, IDLE_FLOOR) * 1000), IDLE_CEILING_MS)


class PostgresRelayStatements(RelayStatements):
    """PostgreSQL: arrays as parameters, a fetch per shard merged in id order, pipelined batches."""

    pipelines = True

    def _column(self, m: sa.Table, name: str) -> Any:
        """The message id comes as its text too, the form the record header carries.

        The driver's uuid.UUID and str() of it cost a microsecond and a half per
        row. (Elsewhere the column's text is not that form: SQLite stores 32 hex
        digits.)
        """
        if name == "message_id":
            return cast(m.c[name], Text).label(name)
        return super()._column(m, name)

    def _of_shards(self, m: sa.Table) -> sa.ColumnElement[bool]:
        """One array parameter (``IntList``): an expanding IN rendered a parameter per shard into the
        statement's text at every run, which the driver then parsed again (a fleet's idle poll reads
        the delayed rows on every tenant's turn: a third of its Python time went there)."""
        return m.c.shard == sa.any_(cast(bindparam("shards", type_=IntList()), ARRAY(Integer)))

    def _fetch_of(self, shards: tuple[int, ...], *, backlog: bool) -> sa.Select[Any]:
        """One index range scan per shard on the pending index, each stopping at ``limit``, merged in
        id order: a LATERAL subquery over the shards, or (``backlog``) a UNION ALL of a subquery each.

        The scans never walk published rows. "busy": ids whose outcome is still
        being written (pipelined batches); NOT IN (SELECT …) becomes a hashed
        subplan, where "<> ALL(array)" compared every row with every busy id.

        The fetch's transaction ends with a commit, not a rollback (it writes
        nothing), because psycopg forgets its prepared statements at every
        rollback: kept, a connection's UNION ALL of a shard set is prepared on
        the server from its fifth run and then not parsed again, and after five
        more runs PostgreSQL may run it with its generic plan, not planned
        again either, which the status constant and ``enable_sort = off`` keep
        on the pending index (``tests/test_relay_plans.py``, both forms). The UNION ALL's plan grows with the
        shards, and on a partitioned table with shards x partitions: planning it
        took 1.4 ms of a 1.8 ms fetch over 16 shards on a plain table, and 13 to
        40 ms on a table of 8 daily partitions, for 20 due rows. The LATERAL
        subquery is planned once whatever the shard count (0.3 ms; 1 ms
        partitioned), so a relay that keeps up (the latency case) fetches with
        it. It reads every shard's due rows up to ``limit`` before sorting them,
        though, where the UNION ALL's merge stops after ``limit`` rows in all:
        with a backlog (the last fetch full) that is up to shards x ``limit`` rows,
        so a backlog is fetched with the UNION ALL.

        The LATERAL form is never prepared (``PLANNED_EACH_RUN``): it is the
        one a relay runs while the table is empty, every poll and notification
        of a quiet hour, and when retention has emptied the table and VACUUM
        cut it to no page, PostgreSQL takes it for "clearly empty" whatever
        the statistics say. A plan kept from then is one for a table of no
        rows, and it stayed in use while a burst filled the table, until
        autovacuum next ANALYZEd: each due row's key-waits probe a Seq Scan of
        the whole table, the scan itself on the primary key (863,767 buffers
        for a fetch of 62 rows from 20,000, ``tests/test_relay_plans.py``; 853
        ms for one row of 800 in the fleet benchmark). Planned at each run it
        costs no more on a plain table (0.3 ms, as much as the parse) and about 3 ms of a
        16-shard fetch on a table of 8 partitions. The UNION ALL runs only
        after a full fetch, when the table has rows, and keeps its plan: planning it
        again each run would cost a batch of 1,000 rows 2.4 ms plain, 10.6 ms
        partitioned.
        """
        m, limit = self._m, bindparam("limit", type_=Integer())
        busy_ids = select(func.unnest(cast(bindparam("busy", type_=Text()), ARRAY(BigInteger))))
        busy = m.c.id.not_in(busy_ids.scalar_subquery())
        if not backlog:
            owned = func.unnest(cast(bindparam("shards", value=int_array(shards), type_=Text()),
                                     ARRAY(Integer))).table_valued("shard").render_derived(name="owned")
            each = self._due.where(m.c.shard == owned.c.shard, busy).order_by(m.c.id).limit(limit)
            due = each.lateral("due")
            return (select(due).select_from(owned.join(due, true())).order_by(due.c.id).limit(limit)
                    .execution_options(**EACH_RUN))
        parts = [self._due.where(m.c.shard == shard, busy).order_by(m.c.id).limit(limit)
                 for shard in shards]
        merged = union_all(*parts).subquery("due")
        return select(merged).order_by(merged.c.id).limit(limit)

    def prepare_fetch(self, conn: sa.Connection) -> sa.Connection:
        """In autocommit, its session with no sort, no JIT, and the zone named 'UTC' (``_session``:
        set once per connection, so that the fetch is one round trip).

        No sort: the fetch's only sort-free plan is the one it is written for,
        ix_outbox_pending read in (shard, id) order and stopped at ``limit``. A
        table ANALYZEd while nothing was pending (a quiet hour, a purge, the end
        of a burst) has statistics saying no row is pending ('published' 100%,
        the partial indexes empty) until the next ANALYZE, however much arrives
        after; on them the planner would rather read all of ix_outbox_open_key
        and sort (estimated: one row) — every fetch then
        reads the whole backlog (issue 37: 1M buffers a fetch, relay rounds 3-8x
        slower). JIT compiling this short query costs more than running it; and
        with the zone named 'UTC' psycopg returns datetime.UTC datetimes, which
        format and compare several times faster than ZoneInfo('Etc/UTC') ones.
        """
        return fetch_session(conn)

    def fetch_params(self, now: datetime, limit: int, busy: Sequence[int], max_bytes: int) -> dict[str, Any]:
        return {"now": now, "limit": limit, "busy": int_array(busy), "max_bytes": max_bytes}

    def end_if_idle(self, conn: sa.Connection, seconds: float) -> None:
        """``idle_in_transaction_session_timeout`` for this transaction alone (``SET LOCAL``): the
        connection may be the application's too (a shared engine), whose own transactions keep theirs.
        Never below ``IDLE_FLOOR``: a busy host's scheduler must not end a relay that merely waited
        (``idle_timeout_ms``)."""
        conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {idle_timeout_ms(seconds)}")

    def _build_mark(self, set_: dict[str, Any], per_row: dict[str, Any]) -> Any:
        m, leases = self._m, self._leases
        rows = rows_of(mark_arrays(per_row))
        # The fence names only v's columns, so PostgreSQL checks it per incoming row
        # and then finds each row by primary key (a fence on m.shard made it scan
        # every pending row of the owned shards). "Still pending" is spelled so that
        # it implies no partial index's predicate: with ``status = 'pending'`` a
        # planner whose statistics say nothing is pending (ANALYZEd when nothing
        # was, see prepare_fetch) hashes the whole backlog read through it.
        fenced = exists().where(
            leases.c.shard == rows.c.shard, leases.c.owner == bindparam("owner"),
            leases.c.epoch == rows.c.epoch,
        )
        return (
            update(m)
            .where(m.c.id == rows.c.id, m.c.shard == rows.c.shard,
                   m.c.status.is_not_distinct_from(OutboxStatus.PENDING), fenced)
            .values(**set_, **{name: rows.c[name] for name in per_row})
        )

    def _mark(self, conn: sa.Connection, marks: Marks, stmt: Any, params: dict[str, Any],
              per_row: dict[str, Any]) -> int:
        arrays = array_params(mark_arrays(per_row), {"id": marks.ids, "shard": marks.shards,
                                                     "epoch": marks.epochs, **marks.values})
        return conn.execute(stmt, {**params, **arrays}).rowcount


def mark_arrays(per_row: dict[str, Any]) -> dict[str, Any]:
    """The arrays of a PostgreSQL bulk update: the fence's columns, then ``per_row``'s."""
    return {"id": BigInteger(), "shard": Integer(), "epoch": BigInteger(), **per_row}


class MySQLRelayStatements(RelayStatements):
    """MySQL and MariaDB: a JSON parameter per bulk update, busy rows dropped after the fetch."""

    pipelines = True
    ids_need_checking = True

    def _key_waits(self, tables: OutboxTables, prior: sa.FromClause,
                   conditions: tuple[sa.ColumnElement[bool], ...]) -> sa.Exists:
        """The index's predicate is its generated column there (``_mysql``), which the probe names.

        Forced, as the planner prefers ix_outbox_open_key's shorter prefix and
        would walk every earlier row of the key.
        """
        return exists(
            select(literal_column("1")).select_from(prior)
            .with_hint(prior, f"FORCE INDEX ({tables.key_waits_index})")
            .where(literal_column(f"prior.{MAY_BLOCK}") == 1, *conditions))

    def _column(self, m: sa.Table, name: str) -> Any:
        """The message id is 32 hex digits there: dashed in the statement, as cheap as a cast."""
        if name == "message_id":
            parts = [func.substr(m.c.message_id, start, length)
                     for start, length in ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))]
            return func.concat_ws("-", *parts).label("message_id")
        return super()._column(m, name)

    def _sized(self, fetch: sa.Select[Any]) -> sa.Select[Any]:
        """The byte cut over the due rows' ids and sizes alone, their columns read after by primary key.

        MySQL materializes a derived table with every column it carries: cut
        over the whole rows, a fetch of 4 rows of 300 KB out of 300 due copied
        all 300 payloads (0.6 s against 12 ms for the 4).
        """
        m = self._m
        own = self._octets(m.c.payload) + func.coalesce(self._octets(cast(m.c.headers, Text)), 0)
        batch = fetch.with_only_columns(m.c.id, own.label("own")).subquery("batch")
        upto = func.sum(batch.c.own).over(order_by=batch.c.id)
        sized = select(batch.c.id, upto.label("octets"), batch.c.own).subquery("sized")
        return (select(*self._columns, sized.c.octets).select_from(sized.join(m, m.c.id == sized.c.id))
                .where(sized.c.octets - sized.c.own < bindparam("max_bytes", type_=BigInteger()))
                .order_by(sized.c.id))

    def fetch_params(self, now: datetime, limit: int, busy: Sequence[int], max_bytes: int) -> dict[str, Any]:
        """As many more rows as are busy: a NOT IN over JSON_TABLE made the fetch slower than the write.
        (Their bytes count too: a batch may come that much under ``max_bytes``.)"""
        return {"now": now, "limit": limit + len(busy), "max_bytes": max_bytes}

    def without_busy(self, rows: Sequence[Any], busy: Sequence[int], limit: int) -> Sequence[Any]:
        if not busy:
            return rows
        drop = set(busy)
        return [r for r in rows if r[0] not in drop][:limit]  # r[0]: the id (ROW_COLUMNS)

    def _build_mark(self, set_: dict[str, Any], per_row: dict[str, Any]) -> Any:
        m, leases = self._m, self._leases
        rows = json_table("rows", {"id": BigInteger(), "shard": Integer(), "epoch": BigInteger(), **per_row},
                          name="v")
        fenced = exists().where(
            leases.c.shard == rows.c.shard, leases.c.owner == bindparam("owner"),
            leases.c.epoch == rows.c.epoch,
        )
        return (
            update(m)
            .where(m.c.id == rows.c.id, m.c.status == OutboxStatus.PENDING, fenced)
            .values(**set_, **{name: rows.c[name] for name in per_row})
        )

    def _mark(self, conn: sa.Connection, marks: Marks, stmt: Any, params: dict[str, Any],
              per_row: dict[str, Any]) -> int:
        values = [marks.ids, marks.shards, marks.epochs, *(marks.values[name] for name in per_row)]
        return conn.execute(stmt, {**params, "rows": json_rows(zip(*values, strict=True))}).rowcount


class SQLiteRelayStatements(RelayStatements):
    """SQLite, in process: an executemany per bulk update; batches are not pipelined."""

    def _octets(self, column: Any) -> Any:
        """``length`` counts a text's characters and a blob's bytes (``octet_length`` is 3.43's)."""
        return func.length(cast(column, LargeBinary))

    def _build_mark(self, set_: dict[str, Any], per_row: dict[str, Any]) -> Any:
        m, leases = self._m, self._leases
        fenced = exists().where(
            leases.c.shard == m.c.shard, leases.c.owner == bindparam("owner"),
            leases.c.epoch == bindparam("b_epoch"),
        )
        return (
            update(m)
            .where(m.c.id == bindparam("b_id"), m.c.status == OutboxStatus.PENDING, fenced)
            .values(**set_, **{name: bindparam(f"b_{name}") for name in per_row})
        )

    def _mark(self, conn: sa.Connection, marks: Marks, stmt: Any, params: dict[str, Any],
              per_row: dict[str, Any]) -> int:
        rows_params = [
            {**params, "b_id": row_id, "b_epoch": epoch,
             **{f"b_{name}": values[i] for name, values in marks.values.items()}}
            for i, (row_id, epoch) in enumerate(zip(marks.ids, marks.epochs, strict=True))
        ]
        return conn.execute(stmt, rows_params).rowcount


_DIALECTS: dict[str, type[RelayStatements]] = {
    "postgresql": PostgresRelayStatements,
    "sqlite": SQLiteRelayStatements,
    **dict.fromkeys(MYSQL_FAMILY, MySQLRelayStatements),
}


@functools.lru_cache(maxsize=64)
def statements_for(tables: OutboxTables, dialect: str) -> RelayStatements:
    """The statements of ``tables`` on ``dialect``, built once and shared by every relay of them.

    They hold no state of a relay (the fetches built per shard set are the same
    for all), so the relays of a ``TenantRelay``, whose tenants share one
    schema-less ``OutboxTables`` under their own ``schema_translate_map``, share
    one set of statement objects and, per database, one compiled form.
    """
    try:
        kind = _DIALECTS[dialect]
    except KeyError:
        raise ConfigurationError(f"unsupported database dialect {dialect!r}; "
                                 f"supported: {tuple(_DIALECTS)}") from None
    return kind(tables)
