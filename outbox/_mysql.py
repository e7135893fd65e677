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

Both need MySQL 8.0.23+ (invisible columns) or MariaDB 10.3+. Creating a
trigger needs the ``TRIGGER`` privilege; with binary logging on and without
``SUPER``, MySQL also asks for ``log_bin_trust_function_creators=1`` while
``outbox init-db`` runs (docs/producer.md).
"""

from __future__ import annotations

from sqlalchemy import Connection, text

from ._tables import FAILED, PENDING, OutboxTables

MAY_BLOCK = "may_block"
"""The generated column behind MySQL's ``ix_outbox_key_waits``; the relay's probe names it."""


def missing(conn: Connection, tables: OutboxTables) -> list[str]:
    """What of the trigger and the column is not in the database, by name."""
    schema = "COALESCE(:schema, DATABASE())"
    params = {"schema": tables.schema, "table": tables.messages.name}
    found = []
    if conn.execute(text(f"SELECT 1 FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = {schema}"
                         " AND TRIGGER_NAME = :name AND EVENT_OBJECT_TABLE = :table"),
                    {**params, "name": tables.seq_trigger_name}).first() is None:
        found.append(f"trigger {tables.seq_trigger_name}")
    if conn.execute(text(f"SELECT 1 FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = {schema}"
                         " AND TABLE_NAME = :table AND COLUMN_NAME = :column"),
                    {**params, "column": MAY_BLOCK}).first() is None:
        found.append(f"column {tables.messages.name}.{MAY_BLOCK}")
    return found


def create(conn: Connection, tables: OutboxTables) -> None:
    """Make what ``missing`` names (the rest is left as it is)."""
    absent = missing(conn, tables)
    quote = conn.dialect.identifier_preparer
    messages, keys = quote.format_table(tables.messages), quote.format_table(tables.keys)
    if f"column {tables.messages.name}.{MAY_BLOCK}" in absent:
        conn.execute(text(
            f"ALTER TABLE {messages} ADD COLUMN {MAY_BLOCK} TINYINT GENERATED ALWAYS AS "
            f"(status = '{FAILED}' OR (status = '{PENDING}' AND available_at > created_at)) "
            f"STORED INVISIBLE, "
            f"ADD INDEX ix_{tables.prefix}outbox_key_waits (topic, `key`, {MAY_BLOCK}, seq)"))
    if f"trigger {tables.seq_trigger_name}" in absent:
        trigger = quote.quote(tables.seq_trigger_name)
        if tables.schema:
            trigger = f"{quote.quote_schema(tables.schema)}.{trigger}"
        conn.execute(text(
            f"CREATE TRIGGER {trigger} BEFORE INSERT ON {messages} FOR EACH ROW "
            "BEGIN "
            "IF NEW.`key` IS NOT NULL AND NEW.seq IS NULL THEN "
            f"INSERT INTO {keys} (topic, `key`, last_seq) VALUES (NEW.topic, NEW.`key`, LAST_INSERT_ID(1)) "
            "ON DUPLICATE KEY UPDATE last_seq = LAST_INSERT_ID(last_seq + 1); "
            "SET NEW.seq = LAST_INSERT_ID(); "
            "END IF; "
            "END"))
