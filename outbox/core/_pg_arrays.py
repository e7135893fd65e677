"""Bulk statements on PostgreSQL: many rows travel as one array per column.

An ``INSERT … VALUES`` of n rows, or an ``IN`` list of n tuples, is a new
statement text for every n: the driver parses each one again (psycopg caches
only short texts) and the server plans each one again. ``unnest`` of one
array parameter per column is one short text whatever the batch size, so the
relay and the inbox send their per-batch statements this way.

Each array travels as one PostgreSQL array literal (``'{1,2,3}'``) cast to
its type on the server: building the literal with ``str.join`` costs a
fraction of the driver adapting every element in Python (a regex per text
element, a dumper call per UUID or timestamp), and these arrays are on the
hot path of both the relay and the inbox.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ARRAY, DateTime, Integer, Subquery, Text, Uuid, bindparam, cast, func, select
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine


def int_array(values: Iterable[int | None]) -> str:
    """A PostgreSQL integer array literal, e.g. '{1,2,3}'."""
    values = list(values)
    if None in values:
        return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"
    return "{" + ",".join(map(str, values)) + "}"


class IntList(TypeDecorator[Sequence[int]]):
    """A parameter given as a list of ints and sent as one integer array literal (``int_array``);
    the statement casts it to ``integer[]``."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Dialect) -> str | None:
        return None if value is None else int_array(value)


def text_array(values: Iterable[str | None]) -> str:
    """A PostgreSQL array literal of any strings: each quoted, ``\\`` and ``"`` escaped."""
    return "{" + ",".join(
        "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for v in values
    ) + "}"


def _plain_array(render: Callable[[Any], str]) -> Callable[[Iterable[Any]], str]:
    """For values whose text form never needs quoting in an array (UUIDs, ISO timestamps)."""

    def array(values: Iterable[Any]) -> str:
        return "{" + ",".join("NULL" if v is None else render(v) for v in values) + "}"

    return array


def _timestamp(value: datetime) -> str:
    if value.tzinfo is None:
        raise ValueError(f"naive datetime {value!r}: pass timezone-aware UTC datetimes")
    return value.isoformat()


_uuid_array = _plain_array(str)
_timestamp_array = _plain_array(_timestamp)


def _literal(kind: TypeEngine[Any]) -> Callable[[Iterable[Any]], str]:
    if isinstance(kind, Integer):
        return int_array
    if isinstance(kind, Uuid):
        return _uuid_array
    if isinstance(kind, DateTime):
        return _timestamp_array
    return text_array


def rows_of(columns: Mapping[str, TypeEngine[Any]], *, prefix: str = "a_", name: str = "v") -> Subquery:
    """``SELECT unnest(:a_x::T[]) AS x, unnest(:a_y::U[]) AS y …``: one row per array position."""
    return select(*[
        func.unnest(cast(bindparam(f"{prefix}{column}", type_=Text()), ARRAY(kind))).label(column)
        for column, kind in columns.items()
    ]).subquery(name)


def array_params(columns: Mapping[str, TypeEngine[Any]], values: Mapping[str, Sequence[Any]],
                 *, prefix: str = "a_") -> dict[str, str]:
    """The parameters of ``rows_of(columns)``: ``values`` holds one list per column."""
    return {f"{prefix}{column}": _literal(kind)(values[column]) for column, kind in columns.items()}
