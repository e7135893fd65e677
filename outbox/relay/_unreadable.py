"""Rows the relay's fetch cannot read: found one by one, so that they fail alone.

A value that the driver or a column type cannot turn into Python fails the
fetch of the whole batch, and would fail it again every batch, stopping every
key: text that is not UTF-8 in SQLite, a timestamp or message id SQLite holds
as free text, a timestamp PostgreSQL stores as ``infinity``. None of these can
come from ``publish()``; hand-written SQL or a bug can write them.

When the fetch fails with an error that is not an outage, the due rows' ids
are read (integers always read) and each row is read alone; the rows that
fail are returned, to be marked failed with what the read said. If every row
reads, the error was not a row's fault and the caller raises it again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from ..core._outage import is_database_outage
from ._sql import RelayStatements


@dataclass(frozen=True, slots=True)
class UnreadableRow:
    """What could be read of a row that cannot be fetched; the fields a failed row's alert names."""

    id: int
    shard: int
    topic: str
    key: str | None
    message_id: str | None
    seq: int | None


def find_unreadable(engine: Engine, sql: RelayStatements, shards: list[int],
                    params: dict[str, Any]) -> list[tuple[UnreadableRow, str]]:
    """The due rows of ``shards`` (``fetch``'s ``params``) that cannot be read, with the error."""
    found = []
    with engine.connect() as conn:
        conn = sql.prepare_fetch(conn)
        due = conn.execute(sql.due_ids(shards), params).all()
        conn.rollback()
    statement = sql.row()
    for row_id, shard in due:
        with engine.connect() as conn:
            try:
                conn.execute(statement, {"id": row_id}).all()
                continue
            except Exception as exc:
                if is_database_outage(exc):
                    raise
                error = f"{type(exc).__name__}: {exc}"
        found.append((_identify(engine, sql, row_id, shard), error))
    return found


def _identify(engine: Engine, sql: RelayStatements, row_id: int, shard: int) -> UnreadableRow:
    """Each identifying field that reads, for the alert; ``None`` (topic ``"?"``) for one that does not."""

    def read(name: str, kind: Callable[[Any], Any]) -> Any:
        with engine.connect() as conn:
            try:
                value = conn.execute(sql.row_field(name), {"id": row_id}).scalar()
            except Exception as exc:
                if is_database_outage(exc):
                    raise
                return None
        return kind(value) if value is not None else None

    topic = read("topic", str)
    return UnreadableRow(id=row_id, shard=shard, topic=topic if topic is not None else "?",
                         key=read("key", str), message_id=read("message_id", str),
                         seq=read("seq", lambda seq: seq if type(seq) is int else None))
