"""What MySQL and MariaDB need beyond the ``Table`` definitions, made by ``_schema``.

- **The seq trigger.** ``publish()`` must give a key's messages seq 1, 2, 3 … in
  commit order. PostgreSQL bumps the key's counter and inserts the row in one
  statement (a data-modifying CTE); MySQL has no such statement, and two
  statements are two round trips, most of what ``publish()`` adds to a small
  business transaction. So a ``BEFORE INSERT`` trigger bumps the counter for a
  keyed row that comes without a seq: ``INSERT … ON DUPLICATE KEY UPDATE
  last_seq = LAST_INSERT_ID(last_seq + 1)`` locks the key's counter row (the
  latest committed version, at any isolation level) until the caller commits,
  so concurrent writers of a key are numbered in commit order, as on
  PostgreSQL. ``LAST_INSERT_ID`` set inside a trigger is the trigger's own:
  MySQL restores the caller's value when it ends.
- **The "may block" index.** MySQL has no partial indexes, so the relay's
  per-row probe "does an earlier row block my key" would read every earlier
  row of the key, published history included. A stored generated column holds
  the partial index's predicate, ``INVISIBLE`` so ``SELECT *`` (Spark's JDBC
  reads, hand-written SQL) never sees it, and ``ix_outbox_key_waits`` leads
  with the key and that column, so the probe reads only the rows that can block.

And the bulk statements' one parameter: ``json_table`` / ``json_rows`` pass a
batch as one JSON array that ``JSON_TABLE`` (MySQL 8.0.4+, MariaDB 10.6+) turns
into rows to join or insert from. An executemany of ``UPDATE``\\ s is a round
trip per row there, and a multi-row ``INSERT`` is built value by value in Python
by the driver (``Connection.literal``: a fifth of an inbox batch's time on MariaDB);
``json.dumps`` builds the one string in C.

The trigger and the column need MySQL 8.0.23+ (invisible columns) or MariaDB 10.3+. Creating a
trigger needs the ``TRIGGER`` privilege; with binary logging on and without
``SUPER``, MySQL also asks for ``log_bin_trust_function_creators=1`` while
``outbox init-db`` runs (docs/producer.md).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, Connection, DateTime, Integer, text
from sqlalchemy.types import TypeEngine

from ._tables import OutboxStatus, OutboxTables, sql_name

MAY_BLOCK = "may_block"
"""The generated column behind MySQL's ``ix_outbox_key_waits``; the relay's probe names it."""


def missing(conn: Connection, tables: OutboxTables) -> list[str]:
    """What of the trigger and the column is not in the database, by name."""
    absent = [] if _has_trigger(conn, tables) else [f"trigger {tables.seq_trigger_name}"]
    return absent + ([] if _has_column(conn, tables) else [f"column {tables.messages.name}.{MAY_BLOCK}"])


def create(conn: Connection, tables: OutboxTables) -> None:
    """Make what ``missing`` names (the rest is left as it is)."""
    quote = conn.dialect.identifier_preparer
    messages, keys = sql_name(conn, tables.messages), sql_name(conn, tables.keys)
    schema = conn.schema_for_object(tables.messages)  # a tenant's connection: the tenant's database
    if not _has_column(conn, tables):
        conn.execute(text(
            f"ALTER TABLE {messages} ADD COLUMN {MAY_BLOCK} TINYINT GENERATED ALWAYS AS "
            f"(status = '{OutboxStatus.FAILED}' OR "
            f"(status = '{OutboxStatus.PENDING}' AND available_at > created_at)) "
            f"STORED INVISIBLE, ADD INDEX {tables.key_waits_index} (topic, `key`, {MAY_BLOCK}, seq)"))
    if not _has_trigger(conn, tables):
        trigger = quote.quote(tables.seq_trigger_name)
        if schema:
            trigger = f"{quote.quote_schema(schema)}.{trigger}"
        conn.execute(text(
            f"CREATE TRIGGER {trigger} BEFORE INSERT ON {messages} FOR EACH ROW "
            "BEGIN "
            "IF NEW.`key` IS NOT NULL AND NEW.seq IS NULL THEN "
            f"INSERT INTO {keys} (topic, `key`, last_seq) VALUES (NEW.topic, NEW.`key`, LAST_INSERT_ID(1)) "
            "ON DUPLICATE KEY UPDATE last_seq = LAST_INSERT_ID(last_seq + 1); "
            "SET NEW.seq = LAST_INSERT_ID(); "
            "END IF; "
            "END"))


def _has_trigger(conn: Connection, tables: OutboxTables) -> bool:
    return conn.execute(text(
        "SELECT 1 FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = COALESCE(:schema, DATABASE())"
        " AND TRIGGER_NAME = :name AND EVENT_OBJECT_TABLE = :table"),
        {"schema": conn.schema_for_object(tables.messages), "table": tables.messages.name,
         "name": tables.seq_trigger_name},
    ).first() is not None


def _has_column(conn: Connection, tables: OutboxTables) -> bool:
    return conn.execute(text(
        "SELECT 1 FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE())"
        " AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
        {"schema": conn.schema_for_object(tables.messages), "table": tables.messages.name,
         "column": MAY_BLOCK},
    ).first() is not None


def json_table(param: str, types: dict[str, TypeEngine[Any]], *, name: str = "jt",
               sql_types: dict[str, str] | None = None) -> Any:
    """A subquery of ``JSON_TABLE(:param)``: one column per ``types`` entry, in that order.

    ``sql_types`` overrides a column's SQL type (a collation to join on, say).
    """
    declared = sql_types or {}
    columns = ", ".join(f"`{column}` {declared.get(column) or _json_table_type(type_)} PATH '$[{i}]'"
                        for i, (column, type_) in enumerate(types.items()))
    return text(f"SELECT * FROM JSON_TABLE(:{param}, '$[*]' COLUMNS ({columns})) AS {name}_rows"
                ).columns(**types).subquery(name)


def json_rows(rows: Iterable[Sequence[Any]]) -> str:
    """``rows`` as the JSON that ``json_table`` reads: datetimes as naive UTC text, UUIDs as hex.

    Only those two reach ``_json_value`` (``default``): the C encoder writes the rest.
    A batch repeats its datetimes (one receive time, one processing time), so each
    is formatted once.
    """
    formatted: dict[Any, str] = {}

    def text_of(value: Any) -> str:
        text = formatted.get(value)
        if text is None:
            text = formatted[value] = _json_value(value)
        return text

    return json.dumps(rows if isinstance(rows, list) else list(rows), default=text_of)


def _json_table_type(type_: TypeEngine[Any]) -> str:
    if isinstance(type_, BigInteger):
        return "BIGINT"
    if isinstance(type_, Integer):
        return "INT"
    if isinstance(type_, DateTime):
        return "DATETIME(6)"
    return "LONGTEXT"


def _json_value(value: Any) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is UTC:  # the common case: its text less "+00:00"
            return value.isoformat(sep=" ")[:-6]
        return value.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ")
    if isinstance(value, uuid.UUID):
        return value.hex  # the CHAR(32) the tables store
    raise TypeError(f"{type(value).__name__} cannot go into a JSON_TABLE row")
