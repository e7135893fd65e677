"""``create_engine``: SQLAlchemy's, with the settings the outbox needs per backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import Engine, event
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine


def create_engine(url: str, **kwargs: Any) -> Engine:
    """An engine ready for concurrent outbox writers and a relay.

    On SQLite: WAL journal (readers don't block the writer), a 30 s busy
    timeout, and ``BEGIN IMMEDIATE`` so a transaction takes the write lock at
    its start instead of failing with "database is locked" when it upgrades
    from reading to writing. Other backends get SQLAlchemy's defaults.
    """
    engine = sqlalchemy.create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    return engine


def worker_engine(engine: Engine) -> Engine:
    """The engine a relay or inbox runs its own transactions on: READ COMMITTED on MySQL/MariaDB.

    Their SQL was proved at PostgreSQL's READ COMMITTED, where every statement
    sees what committed before it. InnoDB defaults to REPEATABLE READ, whose
    plain ``SELECT`` reads a snapshot taken at the transaction's first read and
    keeps gap locks (more deadlocks between consumers of neighbouring keys).
    The copy shares the pool; only its transactions change level. Elsewhere
    the engine is returned as it is. Publishers need nothing: their seq comes
    from a locking upsert, correct at any level.
    """
    if engine.dialect.name not in ("mysql", "mariadb"):
        return engine
    if engine.get_execution_options().get("isolation_level") == "READ COMMITTED":
        return engine  # already one: SQLAlchemy 2.0 refuses to set the level on a copy again
    return engine.execution_options(isolation_level="READ COMMITTED")


def missing_sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names when it does not exist, else None.

    SQLite creates a missing file on connect, so a command that only reads
    (or a worker pointed at a mistyped path) must look first, or it would
    leave an empty database behind and report "no tables" instead of "no file".
    """
    try:
        parsed = sqlalchemy.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return None  # not a URL at all: create_engine says so
    if not parsed.drivername.startswith("sqlite"):
        return None
    path = parsed.database or ""
    if path in ("", ":memory:") or path.startswith("file:") or parsed.query.get("mode") == "memory":
        return None
    return None if Path(path).exists() else path


def create_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """``create_engine`` for asyncio drivers (``postgresql+psycopg``, ``sqlite+aiosqlite``)."""
    engine = _create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine.sync_engine)
    return engine


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
