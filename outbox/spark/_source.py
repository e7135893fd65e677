"""Reading the outbox and inbox tables into Spark, in parallel ranges.

The driver runs one small query for the bounds (min/max id, or per consumer
group min/max message id) and splits them into ranges; each Spark task then
reads its own range with SQLAlchemy and hands Arrow batches to Spark. No JDBC
driver jar is involved, so a fresh machine needs only the ``spark`` extra.
``read_table`` (what the jobs use) runs the reads as a ``mapInArrow``;
``TableSource`` offers the same reads as ``spark.read.format("outbox_table")``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from ..core._errors import ConfigurationError
from . import _pgcopy as pgcopy
from ._tablemap import arrow_schema, check_table, connect, table_for, to_batch

FORMAT = "outbox_table"
FETCH_ROWS = 20_000


def portable_url(url: str) -> str:
    """The URL with a relative SQLite path made absolute, here on the driver.

    Spark's Python workers plan and read partitions in their own working
    directory, so ``sqlite:///orders.db`` would name another file there.
    """
    parsed = sa.make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:" or os.path.isabs(path):
        return url
    return parsed.set(database=os.path.abspath(path)).render_as_string(hide_password=False)


def estimate_rows(url: str, table: sa.Table) -> int:
    """An upper bound of the table's row count from its id bounds (an index lookup), or 0."""
    engine = connect(url)
    try:
        with engine.connect() as conn:
            low, high = conn.execute(sa.select(sa.func.min(table.c.id), sa.func.max(table.c.id))).one()
    finally:
        engine.dispose()
    return 0 if low is None else high - low + 1


def read_table(
    spark: SparkSession,
    url: str,
    table: str,
    *,
    columns: Sequence[str] | None = None,
    time_column: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    partitions: int | None = None,
    prefix: str = "",
    schema: str | None = None,
) -> DataFrame:
    """A DataFrame over one table, filtered to ``since <= time_column < until`` in SQL.

    The database and table are checked here, so a bad URL or a missing table
    fails before Spark starts any task. ``partitions`` defaults to twice the
    session's parallelism.
    """
    url = portable_url(url)
    sa_table = table_for(table, prefix, schema)
    names = list(columns) if columns else [c.name for c in sa_table.columns]
    unknown = [n for n in [*names, time_column] if n and n not in sa_table.c]
    if unknown:
        raise ConfigurationError(f"table {table} has no column(s) {', '.join(map(str, unknown))}")
    for moment in (since, until):
        if moment is not None and moment.tzinfo is None:
            raise ConfigurationError(f"since/until must be timezone-aware (UTC), got {moment!r}")
    count = 2 * spark.sparkContext.defaultParallelism if partitions is None else partitions
    if count < 1:
        raise ConfigurationError(f"partitions must be at least 1, got {count}")
    check_table(url, sa_table)
    options = {"url": url, "table": table, "prefix": prefix, "columns": ",".join(names),
               "partitions": str(count)}
    if schema:
        options["schema"] = schema
    if time_column:
        options["time_column"] = time_column
        options |= {k: v.isoformat() for k, v in (("since", since), ("until", until)) if v is not None}
    query = _Query(options)
    engine = connect(url)
    try:
        with engine.connect() as conn:
            ranges = [p.value for p in plan_ranges(conn, query.table, query.filters, count)]
    finally:
        engine.dispose()

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        reader = _RangeReader(options)
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield from reader.read_range(ranges[index])

    # The ranges are planned here, on the driver, and each task reads one: the
    # same reads as the data source below, without the Python planning process
    # Spark starts for every data source it plans (seconds per table).
    spark_schema = from_arrow_schema(arrow_schema(query.columns))
    return spark.range(0, len(ranges), 1, len(ranges)).mapInArrow(read, spark_schema)


class TableSource(DataSource):
    """``spark.read.format("outbox_table")``; options as written by ``read_table``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return from_arrow_schema(arrow_schema(_Query(self.options).columns))

    def reader(self, schema: StructType) -> DataSourceReader:
        return _RangeReader(dict(self.options))


class _Query:
    """The options decoded into a table, its columns and the time filter."""

    def __init__(self, options: Any) -> None:
        self.url = options["url"]
        self.table = table_for(options["table"], options.get("prefix", ""), options.get("schema"))
        self.columns = [self.table.c[name] for name in options["columns"].split(",")]
        self.partitions = int(options.get("partitions", "1"))
        self.filters: list[sa.ColumnElement[bool]] = []
        if column := options.get("time_column"):
            if since := options.get("since"):
                self.filters.append(self.table.c[column] >= datetime.fromisoformat(since))
            if until := options.get("until"):
                self.filters.append(self.table.c[column] < datetime.fromisoformat(until))


class _RangeReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        query = _Query(self.options)
        engine = connect(query.url)
        try:
            with engine.connect() as conn:
                return plan_ranges(conn, query.table, query.filters, query.partitions)
        finally:
            engine.dispose()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self.read_range(partition.value)

    def read_range(self, value: tuple[Any, ...]) -> Iterator[pa.RecordBatch]:
        query = _Query(self.options)
        schema = arrow_schema(query.columns)
        where = [*query.filters, *range_filter(query.table, value)]
        engine = connect(query.url)
        try:
            if pgcopy.supports(engine, query.columns, schema):
                yield from pgcopy.read_batches(engine, query.columns, schema, where)
                return
            with engine.connect() as conn:
                stmt = sa.select(*query.columns).where(*where)
                result = conn.execution_options(stream_results=True).execute(stmt)
                for rows in result.partitions(FETCH_ROWS):
                    yield to_batch(rows, query.columns, schema)
        finally:
            engine.dispose()


def plan_ranges(
    conn: sa.Connection, table: sa.Table, filters: Sequence[sa.ColumnElement[bool]], count: int
) -> list[InputPartition]:
    """Split the rows matching ``filters`` into about ``count`` ranges of the key.

    Tables with an integer ``id`` split its [min, max]; tables keyed by
    (consumer_group, message_id) split each group's message-id interval, with
    ranges shared among groups by row count. Ranges are half-open except the
    last of each interval, which includes its maximum.
    """
    c = table.c
    if "id" in c:
        low, high = conn.execute(sa.select(sa.func.min(c.id), sa.func.max(c.id)).where(*filters)).one()
        if low is None:
            return [InputPartition(("empty",))]
        return [InputPartition(("id", a, b, last)) for a, b, last in _split(low, high, count)]
    if "consumer_group" in c and "message_id" in c:
        # As text: PostgreSQL has no min(uuid); hex text sorts like the UUID's bytes.
        text_id = sa.cast(c.message_id, sa.String)
        groups = conn.execute(
            sa.select(c.consumer_group, sa.func.min(text_id), sa.func.max(text_id),
                      sa.func.count()).where(*filters).group_by(c.consumer_group)
        ).all()
        if not groups:
            return [InputPartition(("empty",))]
        total = sum(g[3] for g in groups)
        parts = []
        for group, low, high, rows in groups:
            share = max(1, round(count * rows / total))
            for a, b, last in _split(_as_uuid(low).int, _as_uuid(high).int, share):
                parts.append(InputPartition(("group", group, str(uuid.UUID(int=a)),
                                             str(uuid.UUID(int=b)), last)))
        return parts
    return [InputPartition(("all",))]


def range_filter(table: sa.Table, value: tuple[Any, ...]) -> list[sa.ColumnElement[bool]]:
    kind = value[0]
    if kind == "empty":
        return [sa.false()]
    if kind == "all":
        return []
    if kind == "id":
        _, low, high, last = value
        return [table.c.id >= low, table.c.id <= high if last else table.c.id < high]
    _, group, low, high, last = value
    mid = table.c.message_id
    low_id, high_id = uuid.UUID(low), uuid.UUID(high)
    return [table.c.consumer_group == group, mid >= low_id, mid <= high_id if last else mid < high_id]


def _split(low: int, high: int, count: int) -> list[tuple[int, int, bool]]:
    """[low, high] as at most ``count`` contiguous ranges (a, b), the last one closed."""
    count = max(1, min(count, high - low + 1))
    step = (high - low + 1) / count
    edges = [low + int(step * i) for i in range(count)] + [high]
    return [(edges[i], edges[i + 1], i == count - 1) for i in range(count)]


def _as_uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
