"""Which table a job means, its columns as Spark types, and a checked connection.

Shared by the driver (planning, validation) and the executors (reading,
archiving), so it imports nothing from Spark's session machinery.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from ..core._engine import create_engine, missing_sqlite_file
from ..core._errors import ConfigurationError
from ..core._secrets import database_url
from ..core._tables import OutboxTables, UTCDateTime

TABLE_NAMES = (
    "outbox_messages", "outbox_keys", "inbox_messages", "inbox_keys", "inbox_parked", "inbox_held",
)


def table_for(name: str, prefix: str = "", schema: str | None = None) -> sa.Table:
    """The ``sa.Table`` for a default table name such as ``"inbox_messages"``."""
    if name not in TABLE_NAMES:
        raise ConfigurationError(f"unknown table {name!r}; expected one of {', '.join(TABLE_NAMES)}")
    plain = isinstance(prefix, str) and (schema is None or isinstance(schema, str))
    tables = _tables(prefix, schema) if plain else OutboxTables(prefix=prefix, schema=schema)
    attribute = {"outbox_messages": "messages", "outbox_keys": "keys"}.get(name, name)
    table: sa.Table = getattr(tables, attribute)
    return table


@functools.lru_cache(maxsize=16)
def _tables(prefix: str, schema: str | None) -> OutboxTables:
    """The tables of one prefix and schema, built once per process.

    Every range a Spark task reads resolves its table, and building all the
    tables costs about 10 ms: with one range per consumer group, that was
    most of a small read. The tables are only read from, never changed.
    """
    return OutboxTables(prefix=prefix, schema=schema)


def safe_url(url: str) -> str:
    """The URL as it may appear in an error message: password and secret query values hidden."""
    return database_url(url)


def connect(url: str) -> sa.Engine:
    """An engine without a pool (each Spark task opens and closes its own connection)."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"database URL must be a non-empty string, got {url!r}")
    try:
        return create_engine(url, poolclass=NullPool)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
        raise ConfigurationError(f"invalid database URL {safe_url(url)!r}: {exc}") from None


def check_table(url: str, table: sa.Table) -> None:
    """Fail now, naming database and table, if the database is unreachable or lacks the table.

    A SQLite file that does not exist is refused before connecting: SQLite would create it.
    """
    where = f"{table.schema}.{table.name}" if table.schema else table.name
    if isinstance(url, str) and url and missing_sqlite_file(url) is not None:
        raise ConfigurationError(f"table {where} does not exist in {safe_url(url)}: there is no such "
                                 "database file (check the URL, or run `outbox init-db`)")
    engine = connect(url)
    try:
        with engine.connect() as conn:
            present = sa.inspect(conn).has_table(table.name, schema=table.schema)
    except sa.exc.DBAPIError as exc:
        raise ConfigurationError(
            f"cannot read database {safe_url(url)}: {exc.orig or exc}"
        ) from None
    finally:
        engine.dispose()
    if not present:
        raise ConfigurationError(
            f"table {where} does not exist in {safe_url(url)} (run `outbox init-db`?)"
        )


def arrow_type(column: sa.Column[Any]) -> pa.DataType:
    kind = column.type
    if isinstance(kind, UTCDateTime | sa.DateTime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(kind, sa.Boolean):
        return pa.bool_()
    if isinstance(kind, sa.Integer):
        return pa.int64()
    if isinstance(kind, sa.LargeBinary):
        return pa.binary()
    return pa.string()  # strings, text, UUIDs (canonical text) and JSON (serialised)


def converter(column: sa.Column[Any]) -> Callable[[Any], Any] | None:
    """How a value read through SQLAlchemy becomes an Arrow value (None: as it is)."""
    if isinstance(column.type, sa.Uuid):
        return lambda v: None if v is None else str(v)
    if isinstance(column.type, sa.JSON):
        return lambda v: None if v is None else json.dumps(v, sort_keys=True)
    return None


def arrow_schema(columns: Sequence[sa.Column[Any]]) -> pa.Schema:
    return pa.schema([pa.field(c.name, arrow_type(c)) for c in columns])


def to_batch(rows: Sequence[Sequence[Any]], columns: Sequence[sa.Column[Any]],
             schema: pa.Schema) -> pa.RecordBatch:
    """Rows from SQLAlchemy as one Arrow batch of ``schema``."""
    arrays = []
    for index, column in enumerate(columns):
        values = [row[index] for row in rows]
        convert = converter(column)
        if convert is not None:
            values = [convert(v) for v in values]
        arrays.append(pa.array(values, type=schema.field(index).type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
