"""``create_engine``: SQLAlchemy's, with the settings the outbox needs per backend."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine.interfaces import DBAPICursor, ExecutionContext
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine

from ._errors import ConfigurationError
from ._secrets import database_url


def create_engine(url: str, **kwargs: Any) -> Engine:
    """An engine ready for concurrent outbox writers and a relay.

    On SQLite: WAL journal (readers don't block the writer), a 30 s busy
    timeout, and ``BEGIN IMMEDIATE`` so a transaction takes the write lock at
    its start instead of failing with "database is locked" when it upgrades
    from reading to writing. On MySQL/MariaDB through mysqlclient or PyMySQL
    (unless ``connect_args`` brings a ``conv``): ``DATETIME`` values decoded by
    ``datetime.fromisoformat``, see ``_fast_datetimes``. Other backends get
    SQLAlchemy's defaults.

    PostgreSQL and MySQL connections give up after ``CONNECT_TIMEOUT`` seconds
    unless the URL or ``connect_args`` says otherwise: a server that accepts
    the TCP connection and never answers (frozen, overloaded) would otherwise
    hold a worker in ``connect`` for good.

    A server's pool keeps ``POOL_SIZE`` connections unless ``pool_size`` says
    otherwise: SQLAlchemy's 5 is fewer than an inbox's default 8 workers, and a
    pool closes every connection past its size when it is returned, so three
    workers would connect again and again.
    """
    parsed = _parsed(url)
    connect_args = kwargs.get("connect_args", {})
    driver = parsed.get_dialect().driver
    timeout = _connect_timeout(driver, parsed.query, connect_args)
    if timeout:
        kwargs = {**kwargs, "connect_args": {**connect_args, **timeout}}
        connect_args = kwargs["connect_args"]
    conversions = _fast_datetimes(driver) if "conv" not in connect_args else None
    if conversions is not None:
        kwargs = {**kwargs, "connect_args": {**connect_args, "conv": conversions}}
    if parsed.get_backend_name() != "sqlite" and "poolclass" not in kwargs:
        kwargs = {"pool_size": POOL_SIZE, **kwargs}
    engine = sqlalchemy.create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        _configure_sqlite(engine)
    return engine


def _parsed(url: str) -> sqlalchemy.URL:
    """``url`` parsed, or a ``ConfigurationError`` that says why and quotes no credential.

    A password with an unescaped ``@``, ``:`` or ``/`` cuts the URL elsewhere:
    SQLAlchemy's own error is ``invalid literal for int() … '99@db:5432'``, a
    piece of the password and no word about the cause.
    """
    try:
        return sqlalchemy.make_url(url)
    except ValueError:
        raise ConfigurationError(
            f"the database URL {database_url(str(url))} cannot be parsed "
            "(a port that is not a number, most often cut from a password): "
            "percent-encode a password that holds @, : or / (urllib.parse.quote(password, safe=''))"
        ) from None


POOL_SIZE = 10
"""Connections a PostgreSQL or MySQL engine keeps (its overflow, 10 more, is SQLAlchemy's): an inbox's
default 8 workers, its sweep and a relay's few, without closing and opening connections in turn."""

CONNECT_TIMEOUT = 10
"""Seconds a new PostgreSQL or MySQL connection may take, unless the URL or ``connect_args`` set one."""

# driver -> the name of its connect timeout argument
_TIMEOUT_ARGUMENTS = {"psycopg": "connect_timeout", "psycopg2": "connect_timeout",
                      "mysqldb": "connect_timeout", "pymysql": "connect_timeout",
                      "asyncpg": "timeout"}


def _connect_timeout(driver: str, query: Any, connect_args: dict[str, Any]) -> dict[str, Any]:
    name = _TIMEOUT_ARGUMENTS.get(driver)
    if name is None or name in query or name in connect_args:
        return {}
    return {name: CONNECT_TIMEOUT}


# The drivers whose DATETIME decoder ``_fast_datetimes`` replaces: driver name -> package.
_DRIVER_PACKAGES = {"mysqldb": "MySQLdb", "pymysql": "pymysql"}


def _fast_datetimes(driver: str) -> dict[Any, Any] | None:
    """The driver's conversions with DATETIME parsed by ``datetime.fromisoformat`` (C).

    Both drivers parse ``DATETIME(6)`` text in Python (mysqlclient slices and
    calls ``int`` seven times, PyMySQL runs a regex): ~4 µs a value, two a
    row, as much as the rest of a relay's fetch of 5,000 rows. What
    ``fromisoformat`` refuses (zero dates) goes to the driver's own parser.
    None for any other driver, or when the driver is missing (SQLAlchemy then
    names it).
    """
    package = _DRIVER_PACKAGES.get(driver)
    if package is None:
        return None
    try:
        converters = importlib.import_module(f"{package}.converters")
        field_type = importlib.import_module(f"{package}.constants.FIELD_TYPE")
    except ImportError:
        return None
    conversions = dict(converters.conversions)
    slow = conversions[field_type.DATETIME]

    def datetime_of(text: str | bytes) -> Any:
        try:
            return datetime.fromisoformat(text.decode() if isinstance(text, bytes) else text)
        except ValueError:
            return slow(text)

    conversions[field_type.DATETIME] = datetime_of
    return conversions


E = TypeVar("E", Engine, AsyncEngine)

_WORKER = "outbox_worker"
"""The execution option that marks the relay's and the inbox's engine copy."""
_AT_READ_COMMITTED = "outbox.read_committed"
"""Key in a pooled MySQL connection's ``info``: a worker switched its session to READ COMMITTED."""


def worker_engine(engine: E) -> E:
    """The engine a relay or inbox runs its own transactions on: real transactions, READ COMMITTED
    on MySQL/MariaDB.

    Their SQL was proved at PostgreSQL's READ COMMITTED, where every statement
    sees what committed before it. InnoDB defaults to REPEATABLE READ, whose
    plain ``SELECT`` reads a snapshot taken at the transaction's first read and
    keeps gap locks (more deadlocks between consumers of neighbouring keys).
    Publishers need nothing: their seq comes from a locking upsert, correct at
    any level.

    On PostgreSQL the engine's level is kept, except AUTOCOMMIT (an application
    engine made with ``isolation_level="AUTOCOMMIT"``, or a copy of one): there
    ``begin()`` sends no BEGIN, each statement commits alone, and a ``SET LOCAL``
    (the relay's idle bound, ``relay._sql``) applies to nothing. A worker's
    connection found in autocommit is taken out of it for its checkout
    (``_in_transactions``). SQLite needs nothing (``create_engine``'s ``BEGIN
    IMMEDIATE`` runs whatever the level), nor MySQL/MariaDB (setting READ
    COMMITTED takes a connection out of autocommit).

    The copy shares the application's pool. SQLAlchemy's ``isolation_level``
    execution option would set the level at every checkout and reset it at
    every checkin: two statements a transaction, a fifth of what an inbox
    batch sends. Instead a connection's session is switched once, when a worker
    takes it and it is not at READ COMMITTED yet, and switched back only when
    the application's engine takes it (``_keep_levels``). A worker process
    that reuses its own connections pays nothing per transaction.
    """
    sync = engine.sync_engine if isinstance(engine, AsyncEngine) else engine
    if sync.dialect.driver == "psycopg":
        root = root_engine(sync)
        if not event.contains(root, "do_execute", _unprepared):
            event.listen(root, "do_execute", _unprepared)
    if sync.get_execution_options().get(_WORKER):
        return engine
    if sync.dialect.name in ("mysql", "mariadb"):
        return marked_copy(engine, sync, _WORKER, _keep_levels)
    if sync.dialect.name == "postgresql":
        return marked_copy(engine, sync, _WORKER, _in_transactions)
    return engine


PLANNED_EACH_RUN = "outbox_planned_each_run"
"""The execution option of a worker's statement that PostgreSQL must plan at every run, for its
table as it is then: psycopg never prepares it (``_unprepared``).

psycopg prepares a statement it has run five times on a connection, and
PostgreSQL may then keep a generic plan, made once, until the table's
statistics next change (autovacuum's ANALYZE). A table with no page whose
``reltuples`` is 0 (VACUUMed after its rows were deleted, or TRUNCATEd and
ANALYZEd) is "clearly empty" to the planner whatever its statistics say: a
plan kept from then is one for a table of no rows, a Seq Scan where an index
probe belongs, and it stays in use while a burst fills the table. Marked are
the statements a worker runs again and again on a table that is often empty
(a relay's keeping-up fetch, its idle polls and marks; an inbox's held
messages and key locks), each planned for a few rows: what planning costs is
less than a parse and plan of a small statement, per batch or per poll
(``tests/test_empty_table_plans.py``, ``tests/test_relay_plans.py``)."""


EACH_RUN = {PLANNED_EACH_RUN: True}
"""``statement.execution_options(**EACH_RUN)``: the statement is planned at every run."""


def _unprepared(cursor: DBAPICursor, statement: str, parameters: Any, context: ExecutionContext) -> bool:
    """Run a statement marked ``PLANNED_EACH_RUN`` unprepared (psycopg's unnamed statement, which
    PostgreSQL plans with its parameters at every run); anything else as SQLAlchemy would (False).

    psycopg never prepares while its connection's ``prepare_threshold`` is
    None, whatever it prepared before; the connection is this statement's
    alone while it runs (sync or async).
    """
    if not context.execution_options.get(PLANNED_EACH_RUN):
        return False
    raw: Any = context.root_connection.connection.driver_connection
    threshold = raw.prepare_threshold
    raw.prepare_threshold = None
    try:
        cursor.execute(statement, parameters)
    finally:
        raw.prepare_threshold = threshold
    return True


def marked_copy(engine: E, sync: Engine, option: str, on_checkout: Callable[[Connection], None]) -> E:
    """``engine``'s copy with execution option ``option`` set, and ``on_checkout`` listening on the
    root of ``sync`` (its sync engine): it then runs for every connection of the pool, the
    application's included, and can tell the copy's checkouts by the option."""
    root = root_engine(sync)
    if not event.contains(root, "engine_connect", on_checkout):
        event.listen(root, "engine_connect", on_checkout)
    return engine.execution_options(**{option: True})


def root_engine(engine: Engine) -> Engine:
    """The engine ``engine`` is an ``execution_options()`` copy of (itself if none): where a
    listener must be to run for every connection of the pool, the copies' included."""
    root = engine
    while isinstance(proxied := getattr(root, "_proxied", None), Engine):
        root = proxied
    return root


def _keep_levels(connection: Connection) -> None:
    """Put a checked-out MySQL connection at its user's level: READ COMMITTED for a worker, else the engine's.

    Runs for every connection of the root engine and of its copies (they share
    its events). Only a change of hands between a worker and the application
    costs a statement. The level is set outside SQLAlchemy's error wrapping, so
    a dead connection raises the driver's own error (``outbox.core._outage`` counts
    it as an outage); the connection is invalidated first, so the pool does not
    hand it out again.
    """
    options = connection.get_execution_options()
    worker = bool(options.get(_WORKER))
    # An engine copy with its own ``isolation_level`` option: SQLAlchemy has just set that
    # level (a copy's own listeners run before its parent's, where this one is) and puts the
    # engine's level back at checkin. Leave it, unless a worker was built on such a copy.
    theirs = "isolation_level" in options
    pooled = connection.connection
    if not theirs and pooled.info.get(_AT_READ_COMMITTED, False) == worker:
        return
    dbapi = pooled.dbapi_connection
    assert dbapi is not None  # a connection just checked out has one
    try:
        if worker:
            connection.dialect.set_isolation_level(dbapi, "READ COMMITTED")
        elif not theirs:
            connection.dialect.reset_isolation_level(dbapi)
    except Exception:
        connection.invalidate()
        raise
    pooled.info[_AT_READ_COMMITTED] = worker and not theirs


def _in_transactions(connection: Connection) -> None:
    """A worker's PostgreSQL connection checked out in autocommit: at READ COMMITTED for this checkout.

    Runs for every connection of the root engine and of its copies, after the
    copies' own listeners (an application copy's ``isolation_level`` set just
    before), so it sees the level the connection really has. SQLAlchemy puts the
    engine's level back at checkin. psycopg sets both on its connection object,
    no round trip; a connection not in autocommit costs one attribute read.
    """
    if not connection.get_execution_options().get(_WORKER):
        return
    if getattr(connection.connection.dbapi_connection, "autocommit", False) is True:
        connection.execution_options(isolation_level="READ COMMITTED")


def missing_sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names when it does not exist, else None.

    SQLite creates a missing file on connect, so a command that only reads
    (or a worker pointed at a mistyped path) must look first, or it would
    leave an empty database behind and report "no tables" instead of "no file".
    """
    try:
        parsed = sqlalchemy.make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return None  # not a URL at all, or a port cut from a password: create_engine says so
    if not parsed.drivername.startswith("sqlite"):
        return None
    path = parsed.database or ""
    if path in ("", ":memory:") or path.startswith("file:") or parsed.query.get("mode") == "memory":
        return None
    return None if Path(path).exists() else path


def create_async_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """``create_engine`` for asyncio drivers (``postgresql+psycopg``, ``sqlite+aiosqlite``)."""
    parsed = _parsed(url)
    connect_args = kwargs.get("connect_args", {})
    timeout = _connect_timeout(parsed.get_dialect().driver, parsed.query, connect_args)
    if timeout:
        kwargs = {**kwargs, "connect_args": {**connect_args, **timeout}}
    if parsed.get_backend_name() != "sqlite" and "poolclass" not in kwargs:
        kwargs = {"pool_size": POOL_SIZE, **kwargs}
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
