"""What MySQL/MariaDB errors count as an outage, provoked on a real server.

The drivers raise OperationalError for a misspelt column as for a lost
connection, so the error number decides (``outbox.core._outage``): a lock wait
timeout, a deadlock and a killed connection are waited out; a programming or
integrity error is the work's own failure and counts.
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from outbox.core._outage import is_database_outage

pytestmark = pytest.mark.mysql


@pytest.fixture
def engine(mysql_db: str):
    engine = sa.create_engine(mysql_db, isolation_level="READ COMMITTED")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (id INT PRIMARY KEY, n INT) ENGINE=InnoDB"))
        conn.execute(sa.text("INSERT INTO t VALUES (1, 0), (2, 0)"))
    yield engine
    engine.dispose()


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("no error raised")


def test_errors_that_would_fail_again_are_not_outages(engine):
    with engine.connect() as conn:
        assert not is_database_outage(raised(lambda: conn.execute(sa.text("SELECT nope FROM t"))))
        conn.rollback()
        assert not is_database_outage(raised(lambda: conn.execute(sa.text("INSERT INTO t VALUES (1, 0)"))))
        conn.rollback()
        assert not is_database_outage(raised(lambda: conn.execute(sa.text("SELECT * FROM missing"))))


def test_a_lock_wait_timeout_is_an_outage(engine):
    with engine.connect() as holder, engine.connect() as waiter:
        holder.execute(sa.text("UPDATE t SET n = 1 WHERE id = 1"))
        waiter.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
        error = raised(lambda: waiter.execute(sa.text("UPDATE t SET n = 2 WHERE id = 1")))
        assert error.orig.args[0] == 1205  # type: ignore[attr-defined]
        assert is_database_outage(error)
        holder.rollback()


def test_a_deadlock_is_an_outage(engine):
    with engine.connect() as a, engine.connect() as b:
        a.execute(sa.text("UPDATE t SET n = 1 WHERE id = 1"))
        b.execute(sa.text("UPDATE t SET n = 1 WHERE id = 2"))
        errors: list[BaseException] = []

        def cross(conn, row: int) -> None:
            try:
                conn.execute(sa.text(f"UPDATE t SET n = 2 WHERE id = {row}"))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=cross, args=(a, 2)), threading.Thread(target=cross, args=(b, 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [e.orig.args[0] for e in errors] == [1213]  # type: ignore[attr-defined]
        assert is_database_outage(errors[0])
        a.rollback()
        b.rollback()


def test_a_killed_connection_is_an_outage(engine):
    with engine.connect() as victim, engine.connect() as admin:
        victim.execute(sa.text("SELECT 1"))
        connection_id = victim.scalar(sa.text("SELECT CONNECTION_ID()"))
        admin.execute(sa.text(f"KILL CONNECTION {int(connection_id)}"))
        assert is_database_outage(raised(lambda: victim.execute(sa.text("SELECT n FROM t"))))
