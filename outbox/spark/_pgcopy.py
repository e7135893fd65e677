"""The PostgreSQL fast path of the reader: ``COPY (SELECT …) TO STDOUT`` parsed by Arrow.

Fetching rows through the driver costs a Python object per value, which is
what bounds a read of millions of rows; ``COPY`` sends one CSV stream that
Arrow's C++ parser turns into columns directly. The server renders UUIDs and
JSON as text and timestamps as epoch microseconds, so nothing needs
converting in Python. Columns of other types (binary payloads) take the
generic path.

Text is data: a value is NULL only when the server says so, never because of
what it says. COPY's CSV marks NULL with an unquoted empty field, and
``FORCE_QUOTE *`` quotes every other value (the empty string included), so
that field is the one null marker Arrow is given; Arrow's defaults would
also read "NA", "null", "nan", "N/A", "#N/A", … as NULL. Quoting every value
also keeps Arrow from dropping a leading byte-order mark (it skips one at the
start of the stream), and empty lines are kept: a one-column row whose value
is NULL is an empty line. The server sends UTF-8 whatever the session's
client encoding, which is what Arrow decodes.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import sqlalchemy as sa

BATCH_ROWS = 65_536
NULL_MARKER = ""  # COPY's NULL in CSV, written unquoted; a quoted "" is the empty string
COPY_OPTIONS = "FORMAT csv, NULL '', FORCE_QUOTE *, ENCODING 'UTF8'"


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
            f"COPY ({compiled.string}) TO STDOUT ({COPY_OPTIONS})", compiled.params
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
        parse_options=pacsv.ParseOptions(newlines_in_values=True, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types=dict(zip(schema.names, wire, strict=True)),
            null_values=[NULL_MARKER], strings_can_be_null=True, quoted_strings_can_be_null=False,
            true_values=["t"], false_values=["f"],
        ),
    )
    table = table.cast(schema)
    yield from table.to_batches(max_chunksize=BATCH_ROWS)
