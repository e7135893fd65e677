"""``worker_engine`` (the copy the relay and the inbox run on: at READ COMMITTED on MySQL/MariaDB,
in real transactions on an application engine made AUTOCOMMIT) and ``create_engine``'s DATETIME
decoder for the MySQL drivers.

Most need no server (an engine connects on first use, and they only build engines); the
``mysql`` ones pass one pooled connection between a worker and the application on a real
server.
"""

from __future__ import annotations

import importlib
import re
import sqlite3
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import publish
from pymysql.constants import FIELD_TYPE
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from outbox import Outbox, Relay, create_async_engine, create_engine
from outbox.core._engine import (
    _WORKER,
    CONNECT_TIMEOUT,
    POOL_SIZE,
    _fast_datetimes,
    _keep_levels,
    worker_engine,
)
from outbox.core._outage import is_database_outage
from outbox.inbox._sessions import sessions_for
from tests.inbox_support import async_url
from transports.memory import InMemoryBroker, InMemoryTransport

MYSQL = "mysql+pymysql://app@127.0.0.1:1/shop"
POSTGRES = "postgresql+psycopg://app@127.0.0.1:1/shop"


def test_mysql_workers_share_the_pool_on_a_marked_copy() -> None:
    engine = create_engine(MYSQL)
    worker = worker_engine(engine)
    assert worker.get_execution_options()[_WORKER] is True
    assert worker.pool is engine.pool
    assert _WORKER not in engine.get_execution_options()  # the publishers' engine is untouched
    assert "isolation_level" not in worker.get_execution_options()  # no set and reset per checkout
    assert sa.event.contains(engine, "engine_connect", _keep_levels)


def test_a_worker_engine_is_made_once_whatever_passes_it_on() -> None:
    worker = worker_engine(create_engine(MYSQL))
    assert worker_engine(worker) is worker
    _, maker = sessions_for(worker)
    assert isinstance(maker, sessionmaker) and maker.kw["bind"] is worker
    _, maker = sessions_for(sessionmaker(worker_engine(create_engine(MYSQL))))
    assert maker.kw["bind"].get_execution_options()[_WORKER] is True


def test_the_level_keeper_listens_on_the_root_engine_whose_connections_it_must_switch_back() -> None:
    """Given a copy (``engine.execution_options(...)``), the listener still goes on the engine the
    application checks connections out of: on the copy it would never see them."""
    engine = create_engine(MYSQL)
    worker_engine(engine.execution_options(logging_token="a").execution_options(logging_token="b"))
    assert sa.event.contains(engine, "engine_connect", _keep_levels)


def test_an_async_mysql_inbox_runs_on_a_marked_copy() -> None:
    engine = create_async_engine(MYSQL.replace("pymysql", "asyncmy"))
    _, maker = sessions_for(engine)
    assert isinstance(maker, async_sessionmaker)
    assert maker.kw["bind"].sync_engine.get_execution_options()[_WORKER] is True
    assert sa.event.contains(engine.sync_engine, "engine_connect", _keep_levels)


@pytest.mark.mysql
def test_a_worker_switches_a_connection_to_read_committed_once_and_the_application_gets_it_back(
        mysql_db: str) -> None:
    """One pooled connection passed between a worker and the application on a real server: the
    worker's transactions see READ COMMITTED, the application's its engine's level (InnoDB's
    REPEATABLE READ), and a worker reusing the connection sends no SET (the server's own count)."""
    engine = create_engine(mysql_db, pool_size=1, max_overflow=0)
    worker = worker_engine(engine)

    def level_and_sets(conn: sa.Connection) -> tuple[str, int]:
        sets = conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Com_set_option'").one()[1]
        return conn.get_isolation_level(), int(sets)

    with worker.connect() as conn:
        level, sets = level_and_sets(conn)
        assert level == "READ COMMITTED"
    for _ in range(3):
        with worker.connect() as conn:
            assert level_and_sets(conn) == ("READ COMMITTED", sets)
    with engine.connect() as conn:
        assert level_and_sets(conn)[0] == "REPEATABLE READ"
    with Session(worker) as session:
        assert session.connection().get_isolation_level() == "READ COMMITTED"
    engine.dispose()


@pytest.mark.mysql
def test_an_engine_copy_with_its_own_level_keeps_it_and_a_worker_built_on_one_still_reads_committed(
        mysql_db: str) -> None:
    """The application's ``engine.execution_options(isolation_level=...)`` copies: SQLAlchemy sets
    their level at checkout and resets it at checkin, around the worker's switch."""
    engine = create_engine(mysql_db, pool_size=1, max_overflow=0)
    serializable = engine.execution_options(isolation_level="SERIALIZABLE")
    worker = worker_engine(engine)
    levels = []
    for user in (worker, serializable, engine, worker, worker_engine(serializable), worker, engine):
        with user.connect() as conn:
            levels.append(conn.get_isolation_level())
    assert levels == ["READ COMMITTED", "SERIALIZABLE", "REPEATABLE READ", "READ COMMITTED",
                      "READ COMMITTED", "READ COMMITTED", "REPEATABLE READ"]
    engine.dispose()


@pytest.mark.mysql
async def test_an_async_worker_switches_through_the_async_driver_too(mysql_db: str) -> None:
    """asyncmy: the switch runs inside SQLAlchemy's greenlet bridge, as the statements do."""
    engine = create_async_engine(async_url(mysql_db), pool_size=1, max_overflow=0)
    worker = worker_engine(engine)
    async with worker.connect() as conn:
        assert await conn.get_isolation_level() == "READ COMMITTED"
    async with engine.connect() as conn:
        assert await conn.get_isolation_level() == "REPEATABLE READ"
    async with worker.connect() as conn:
        assert await conn.get_isolation_level() == "READ COMMITTED"
    await engine.dispose()


@pytest.mark.mysql
def test_a_connection_that_died_while_switched_is_dropped_not_handed_out_again(mysql_db: str) -> None:
    """The server ends a worker's connection while it sits in the pool; the application's
    checkout fails to switch it back, and the next one gets a fresh connection."""
    engine = create_engine(mysql_db, pool_size=1, max_overflow=0)
    worker = worker_engine(engine)
    with worker.connect() as conn:
        dead = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
    with sa.create_engine(mysql_db, poolclass=sa.NullPool).connect() as admin:
        admin.exec_driver_sql(f"KILL {dead}")
    with pytest.raises(Exception) as failed:
        engine.connect()
    assert is_database_outage(failed.value)  # waited out by a worker, not counted against a message
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar() != dead
        assert conn.get_isolation_level() == "REPEATABLE READ"
    engine.dispose()


def test_sqlite_keeps_its_engine_and_postgresql_workers_share_the_pool_on_a_marked_copy(
        tmp_path: Path) -> None:
    """PostgreSQL's copy is marked so that a worker's connection found in autocommit is taken out
    of it (``_in_transactions``); SQLite's ``BEGIN IMMEDIATE`` runs at any level."""
    sqlite = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    postgres = sa.create_engine(POSTGRES)
    worker = worker_engine(postgres)
    assert worker_engine(sqlite) is sqlite
    assert worker.get_execution_options()[_WORKER] is True and worker.pool is postgres.pool
    assert worker_engine(worker) is worker


@pytest.mark.parametrize("driver", ["mysqldb", "pymysql"])
def test_mysql_datetimes_are_decoded_by_fromisoformat_as_the_driver_would(driver: str) -> None:
    package = {"mysqldb": "MySQLdb", "pymysql": "pymysql"}[driver]
    pytest.importorskip(package)  # mysqlclient is optional: setup adds it when it builds
    fast = _fast_datetimes(driver)
    assert fast is not None
    own = importlib.import_module(f"{package}.converters").conversions[FIELD_TYPE.DATETIME]
    decode = fast[FIELD_TYPE.DATETIME]
    assert decode is not own
    for text in ("2026-11-24 07:00:45.224753", "2026-11-24 07:00:45", "1970-01-01 00:00:00.5",
                 "0000-00-00 00:00:00"):  # a zero date: the driver's own answer (None or the text)
        assert decode(text) == own(text), text
    assert decode(b"2026-11-24 07:00:45.000001") == datetime(2026, 11, 24, 7, 0, 45, 1)


def test_the_fast_decoder_is_only_for_the_two_mysql_drivers_and_yields_to_a_callers_conv(
        monkeypatch) -> None:
    assert _fast_datetimes("psycopg") is None and _fast_datetimes("asyncmy") is None
    given: dict[str, dict] = {}
    real = sa.create_engine

    def recording(url: str, **kwargs: object) -> sa.Engine:
        given[url] = kwargs
        return real(url, **kwargs)

    monkeypatch.setattr(sa, "create_engine", recording)
    create_engine(MYSQL, pool_size=3)
    assert FIELD_TYPE.DATETIME in given[MYSQL]["connect_args"]["conv"]
    assert given[MYSQL]["pool_size"] == 3
    mine = {"mine": True}
    create_engine(MYSQL.replace("pymysql", "mysqldb"), connect_args={"conv": mine, "connect_timeout": 2})
    assert given[MYSQL.replace("pymysql", "mysqldb")]["connect_args"] == {"conv": mine, "connect_timeout": 2}
    create_engine(POSTGRES)
    assert given[POSTGRES]["connect_args"] == {"connect_timeout": CONNECT_TIMEOUT}  # nothing else


@pytest.mark.parametrize("make", [create_engine, create_async_engine])
def test_a_server_engine_keeps_a_connection_for_each_of_an_inbox_s_default_workers(
    make: Callable[..., sa.Engine | AsyncEngine],
) -> None:
    """A pool closes each connection returned past its size: with SQLAlchemy's 5, three of the
    inbox's 8 default workers connected again after every transaction."""
    from outbox import Inbox

    workers = Inbox(create_engine("sqlite://"), group="g").concurrency
    engine = make("postgresql+psycopg://u@127.0.0.1:1/db")
    assert engine.pool.size() == POOL_SIZE >= workers
    assert make("postgresql+psycopg://u@127.0.0.1:1/db", pool_size=3).pool.size() == 3


def in_autocommit(dbapi: Any) -> bool:
    """Whether a DBAPI connection of psycopg, PyMySQL/mysqlclient or sqlite3 is in autocommit."""
    if isinstance(dbapi, sqlite3.Connection):
        return dbapi.isolation_level is None
    return bool(dbapi.get_autocommit() if hasattr(dbapi, "get_autocommit") else dbapi.autocommit)


@pytest.mark.parametrize("made", ["create_engine", "execution_options"])
def test_a_relay_on_an_autocommit_application_engine_runs_real_transactions(proof_db_url: str,
                                                                           made: str) -> None:
    """The relay on the application's engine, made with ``isolation_level="AUTOCOMMIT"`` (or a copy
    of one made so). On PostgreSQL ``begin()`` then sent no BEGIN: each statement of a relay's
    transaction committed alone, its take of a lease before it read the epoch back, its marks
    before their COMMIT, and its idle bound (``SET LOCAL``) bound nothing (df9d560, from the
    attack on bf2fb6c). What its lease take and its marks write is seen by another connection only
    once their transaction commits; and the application's own connections keep autocommit."""
    autocommit = {"isolation_level": "AUTOCOMMIT"}
    base = create_engine(proof_db_url, **(autocommit if made == "create_engine" else {}))
    app = base if made == "create_engine" else base.execution_options(**autocommit)
    other = sa.create_engine(proof_db_url)  # SQLAlchemy's own: on SQLite a read begins nothing
    box = Outbox(app, shards=1)
    box.create_tables()
    leases, messages = box.tables.leases, box.tables.messages
    seen: dict[str, list[object]] = {"outbox_leases": [], "outbox_messages": []}

    def beside(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        """Right after each UPDATE of a lease or an outbox row, before its transaction's COMMIT."""
        # The table updated, not one its fence reads (MySQL: ``UPDATE outbox_messages, JSON_TABLE(…)``).
        table = next((name for name in seen if re.match(rf"\s*UPDATE\s+[`\"]?{name}\b", statement, re.I)),
                     None)
        if table is None:
            return
        with other.connect() as conn:
            seen[table].append(conn.scalar(
                sa.select(leases.c.owner).where(leases.c.shard == 0) if table == "outbox_leases"
                else sa.select(messages.c.status)))

    publish(box, "orders", ["k"])
    sa.event.listen(base, "after_cursor_execute", beside)
    relay = Relay(box, InMemoryTransport(InMemoryBroker()), worker_id="w")
    try:
        assert relay.run_once().published == 1
    finally:
        sa.event.remove(base, "after_cursor_execute", beside)
        relay.close()
    try:
        assert seen["outbox_leases"][:1] == [None], seen  # its take, not committed yet
        assert seen["outbox_messages"] and "published" not in seen["outbox_messages"], seen
        with other.connect() as conn:
            assert conn.scalar(sa.select(messages.c.status)) == "published"
        with app.connect() as conn:  # the application's own connections keep autocommit
            assert in_autocommit(conn.connection.dbapi_connection)
    finally:
        base.dispose()
        other.dispose()
