"""The PostgreSQL fast path of the reader: ``COPY (SELECT …) TO STDOUT`` parsed by Arrow.

Fetching rows through the driver costs a Python object per value, which is
what bounds a read of millions of rows; ``COPY`` sends one CSV stream that
Arrow's C++ parser turns into columns directly. The server renders UUIDs and
JSON as text and timestamps as epoch microseconds, so nothing needs
converting in Python. Columns of other types (binary payloads) take the
generic path.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import sqlalchemy as sa

BATCH_ROWS = 65_536


def supports(engine: sa.Engine, columns: Sequence[sa.Column[Any]], schema: pa.Schema) -> bool:
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg" and not any(
        pa.types.is_binary(f.type) for f in schema
    )


def _rendered(column: sa.Column[Any], kind: pa.DataType) -> sa.ColumnElement[Any]:
    if pa.types.is_timestamp(kind):
        micros = sa.func.floor(sa.extract("epoch", column) * 1_000_000)
        return sa.cast(micros, sa.BigInteger).label(column.name)
    if pa.types.is_string(kind):
        return sa.cast(column, sa.Text).label(column.name)
    return column


def read_batches(engine: sa.Engine, columns: Sequence[sa.Column[Any]], schema: pa.Schema,
                 where: Sequence[sa.ColumnElement[bool]]) -> Iterator[pa.RecordBatch]:
    """The selected rows as Arrow batches of ``schema``, through one COPY."""
    stmt = sa.select(*[_rendered(c, f.type) for c, f in zip(columns, schema, strict=True)]).where(*where)
    compiled = stmt.compile(dialect=engine.dialect)
    buffer = io.BytesIO()
    raw = engine.raw_connection()
    try:
        cursor: Any = raw.cursor()  # psycopg's cursor: a context manager with copy()
        with cursor, cursor.copy(
            f"COPY ({compiled.string}) TO STDOUT (FORMAT csv)", compiled.params
        ) as copy:
            for block in copy:
                buffer.write(block)
    finally:
        raw.close()
    if buffer.tell() == 0:
        return
    buffer.seek(0)
    wire = [pa.int64() if pa.types.is_timestamp(f.type) else f.type for f in schema]
    table = pacsv.read_csv(
        buffer,
        read_options=pacsv.ReadOptions(column_names=schema.names, block_size=32 << 20),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types=dict(zip(schema.names, wire, strict=True)),
            strings_can_be_null=True, quoted_strings_can_be_null=False,
            true_values=["t"], false_values=["f"],
        ),
    )
    table = table.cast(schema)
    yield from table.to_batches(max_chunksize=BATCH_ROWS)
