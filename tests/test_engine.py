"""``worker_engine``: the READ COMMITTED copy the relay and the inbox run on, on MySQL/MariaDB only.

No server is needed: an engine connects on first use, and these only build engines.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import sessionmaker

from outbox import create_async_engine, create_engine
from outbox._engine import worker_engine
from outbox.inbox._sessions import sessions_for

MYSQL = "mysql+pymysql://app@127.0.0.1:1/shop"


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
