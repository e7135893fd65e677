"""``worker_engine`` (the READ COMMITTED copy the relay and the inbox run on, on MySQL/MariaDB
only) and ``create_engine``'s DATETIME decoder for the MySQL drivers.

No server is needed: an engine connects on first use, and these only build engines.
"""

from __future__ import annotations

import importlib
from datetime import datetime

import pytest
import sqlalchemy as sa
from pymysql.constants import FIELD_TYPE
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import sessionmaker

from outbox import create_async_engine, create_engine
from outbox._engine import _fast_datetimes, worker_engine
from outbox.inbox._sessions import sessions_for

MYSQL = "mysql+pymysql://app@127.0.0.1:1/shop"
POSTGRES = "postgresql+psycopg://app@127.0.0.1:1/shop"


def test_mysql_workers_run_at_read_committed_on_the_same_pool() -> None:
    engine = create_engine(MYSQL)
    worker = worker_engine(engine)
    assert worker.get_execution_options()["isolation_level"] == "READ COMMITTED"
    assert worker.pool is engine.pool
    assert "isolation_level" not in engine.get_execution_options()  # the publishers' engine is untouched


def test_a_worker_engine_is_made_once_whatever_passes_it_on() -> None:
    """SQLAlchemy 2.0 (the floor in pyproject) refuses to set the isolation level on an engine
    copy again ("No such event 'engine_connect'"), so a second pass must return the copy as is."""
    worker = worker_engine(create_engine(MYSQL))
    assert worker_engine(worker) is worker
    _, maker = sessions_for(worker)
    assert isinstance(maker, sessionmaker) and maker.kw["bind"] is worker
    _, maker = sessions_for(sessionmaker(worker_engine(create_engine(MYSQL))))
    assert maker.kw["bind"].get_execution_options()["isolation_level"] == "READ COMMITTED"


def test_an_async_mysql_inbox_runs_at_read_committed() -> None:
    _, maker = sessions_for(create_async_engine(MYSQL.replace("pymysql", "asyncmy")))
    assert isinstance(maker, async_sessionmaker)
    assert maker.kw["bind"].sync_engine.get_execution_options()["isolation_level"] == "READ COMMITTED"


def test_other_databases_keep_their_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sqlite = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    postgres = sa.create_engine("postgresql+psycopg://app@127.0.0.1:1/shop")
    assert worker_engine(sqlite) is sqlite and worker_engine(postgres) is postgres


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
    assert "connect_args" not in given[POSTGRES]
