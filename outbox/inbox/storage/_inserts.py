"""How each dialect says "insert unless a row with the same unique key is there" and "insert or update".

The one piece of SQL every store of the inbox shares and every dialect
spells its own way: SQLite and PostgreSQL have ``ON CONFLICT``, MySQL and
MariaDB ``ON DUPLICATE KEY UPDATE``. Each store is handed its dialect's
``Inserts`` once, when it is built; none asks which database it is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sqlalchemy import Column, Insert, Table
from sqlalchemy.dialects import mysql, postgresql, sqlite

from ...core._tables import OutboxTables


class Inserts(Protocol):
    """A dialect's conditional INSERTs; safe to share between threads (it holds no state)."""

    counts_exactly: bool
    """An INSERT that leaves an existing row alone reports 0 rows (not so on MySQL: ``OnDuplicateKey``)."""

    def new(self, table: Table) -> Insert:
        """An INSERT that leaves a row with the same unique key as it is."""
        ...

    def upsert(self, table: Table, row: dict[str, Any], changes: dict[str, Any],
               unique: Sequence[Column[Any]]) -> Insert:
        """Insert ``row``, or apply ``changes`` to the row already there with the same ``unique`` key."""
        ...


class OnConflict:
    """``INSERT … ON CONFLICT DO NOTHING / DO UPDATE`` (SQLite, PostgreSQL)."""

    counts_exactly = True

    def __init__(self, insert: Callable[[Table], sqlite.Insert | postgresql.Insert]) -> None:
        self._insert = insert

    def new(self, table: Table) -> Insert:
        return self._insert(table).on_conflict_do_nothing()

    def upsert(self, table: Table, row: dict[str, Any], changes: dict[str, Any],
               unique: Sequence[Column[Any]]) -> Insert:
        return self._insert(table).values(row).on_conflict_do_update(index_elements=list(unique),
                                                                     set_=changes)


class OnDuplicateKey:
    """``INSERT … ON DUPLICATE KEY UPDATE`` (MySQL, MariaDB).

    "Insert unless present" assigns a column to itself rather than using
    ``INSERT IGNORE``, which would also turn a too-long value or a NULL into a
    warning and store something else.
    """

    counts_exactly = False
    """``ON DUPLICATE KEY UPDATE`` counts a kept row as found (the driver's FOUND_ROWS flag)."""

    def new(self, table: Table) -> Insert:
        ins = mysql.insert(table)  # every unique key of the inbox tables holds consumer_group
        return ins.on_duplicate_key_update(consumer_group=ins.inserted.consumer_group)

    def upsert(self, table: Table, row: dict[str, Any], changes: dict[str, Any],
               unique: Sequence[Column[Any]]) -> Insert:
        return mysql.insert(table).values(row).on_duplicate_key_update(changes)


SQLITE_INSERTS = OnConflict(sqlite.insert)
POSTGRES_INSERTS = OnConflict(postgresql.insert)
MYSQL_INSERTS = OnDuplicateKey()


class GroupStore:
    """What every store is built on: the tables, the one group whose rows it reads and writes, and
    its dialect's ``Inserts``."""

    def __init__(self, tables: OutboxTables, group: str, inserts: Inserts) -> None:
        self.t = tables
        self.group = group
        self.inserts = inserts
