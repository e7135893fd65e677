"""A database is known by what its server says, not by how its URL is spelled (DESIGN §11).

Every spelling of one database (another host name for the same address, a
query parameter, another user, another driver, a path through ``./``, a
symlink or a hard link) has one identity; two databases never share one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import ConfigurationError, create_engine
from outbox.core._identity import database_identity, same_database, schema_identity, tables_identity


def engines(*urls: str | sa.URL) -> list[sa.Engine]:
    return [sa.create_engine(url, poolclass=sa.NullPool) for url in urls]


# -- PostgreSQL -------------------------------------------------------------------------------------


@pytest.fixture
def other_user(postgres_db: str) -> Iterator[str]:
    """A second login role that may use the database (roles belong to the cluster: dropped after)."""
    name = f"u_{uuid.uuid4().hex[:10]}"
    url = sa.make_url(postgres_db)
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN")
        conn.exec_driver_sql(f"CREATE SCHEMA {name} AUTHORIZATION {name}")  # its "$user" schema
    try:
        yield url.set(username=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {name} CASCADE")
            conn.exec_driver_sql(f"DROP OWNED BY {name}")
            conn.exec_driver_sql(f"DROP ROLE {name}")
        admin.dispose()


@pytest.mark.postgres
def test_every_spelling_of_a_postgres_database_is_one_database(postgres_db: str, other_user: str) -> None:
    url = sa.make_url(postgres_db)
    assert url.host == "127.0.0.1"
    spellings = engines(url, url.set(host="localhost"), url.update_query_dict({"connect_timeout": "10"}),
                        url.update_query_dict({"application_name": "x", "sslmode": "disable"}), other_user)
    first = database_identity(spellings[0])
    assert all(database_identity(e) == first for e in spellings)
    assert all(same_database(spellings[0], e) for e in spellings)
    # The schema named: one place whoever asks; unqualified tables: where each user's search_path says.
    assert {schema_identity(e, "public") for e in spellings} == {schema_identity(spellings[0], None)}
    own = sa.make_url(other_user).username
    assert schema_identity(spellings[-1], None) == schema_identity(spellings[0], own)


@pytest.mark.postgres
def test_two_postgres_databases_and_two_schemas_of_one_are_told_apart(postgres_server: str,
                                                                       postgres_db: str) -> None:
    here, there = engines(postgres_db, postgres_server)
    assert database_identity(here).server == database_identity(there).server  # one cluster
    assert database_identity(here) != database_identity(there)
    assert not same_database(here, there)
    assert schema_identity(here, "public") != schema_identity(there, "public")
    # A name with a capital is quoted, so it is another schema than its lower-case spelling.
    with here.begin() as conn:
        conn.exec_driver_sql('CREATE SCHEMA "Acme"')
        conn.exec_driver_sql("CREATE SCHEMA acme")
    assert schema_identity(here, "Acme") != schema_identity(here, "acme")


@pytest.mark.postgres
def test_a_postgres_server_that_does_not_answer_raises_what_its_driver_raised() -> None:
    """A connection refused, as from any statement: callers treat it as the outage it is."""
    (down,) = engines("postgresql+psycopg://u:pw-s3cr3t@127.0.0.1:1/x?connect_timeout=2")
    with pytest.raises(sa.exc.OperationalError, match="refused"):
        database_identity(down)
    with pytest.raises(sa.exc.OperationalError):
        database_identity(down)  # nothing was cached


@pytest.mark.postgres
def test_a_postgres_user_that_may_not_ask_gets_a_clear_error(postgres_db: str, other_user: str) -> None:
    (admin,) = engines(postgres_db)
    with admin.begin() as conn:
        conn.exec_driver_sql("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
    try:
        (user,) = engines(other_user)
        with pytest.raises(ConfigurationError, match=r"EXECUTE on pg_control_system\(\)"):
            database_identity(user)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql("GRANT EXECUTE ON FUNCTION pg_control_system() TO PUBLIC")


# -- MySQL / MariaDB --------------------------------------------------------------------------------


@pytest.mark.mysql
def test_every_spelling_of_a_mysql_database_is_one_database(mysql_db: str) -> None:
    url = sa.make_url(mysql_db)
    name = f"u_{uuid.uuid4().hex[:10]}"
    (admin,) = engines(url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1'")
        conn.exec_driver_sql(f"GRANT ALL ON `{url.database}`.* TO '{name}'@'127.0.0.1'")
    try:
        other_driver = "mysql+pymysql" if url.drivername != "mysql+pymysql" else "mysql+mysqldb"
        spellings = engines(url, url.set(drivername=other_driver), url.set(username=name),
                            url.update_query_dict({"connect_timeout": "10"}))
        first = database_identity(spellings[0])
        assert all(database_identity(e) == first for e in spellings)
        assert all(same_database(spellings[0], e) for e in spellings)
        # A schema is a database of the server: named through another database, it is the same one.
        (elsewhere,) = engines(url.set(database="mysql"))
        assert schema_identity(elsewhere, url.database) == schema_identity(spellings[0], None)
        assert not same_database(elsewhere, spellings[0])
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


@pytest.mark.mysql
def test_mysql_schema_names_compare_as_the_server_compares_them(mysql_db: str) -> None:
    (engine,) = engines(mysql_db)
    with engine.connect() as conn:
        folding = conn.exec_driver_sql("SELECT @@lower_case_table_names").scalar()
    same = schema_identity(engine, "Acme") == schema_identity(engine, "acme")
    assert same == (str(folding) in ("1", "2"))  # 0 (Linux): two databases; 1, 2: one


@pytest.mark.mysql
def test_two_mysql_servers_are_told_apart(mysql_db: str, own_mariadb) -> None:  # type: ignore[no-untyped-def]
    here, there = engines(mysql_db, own_mariadb.url)
    assert database_identity(here).server != database_identity(there).server
    assert schema_identity(here, "outbox") != schema_identity(there, "outbox")


# -- SQLite -----------------------------------------------------------------------------------------


def test_every_path_to_a_sqlite_file_is_one_database(tmp_path: Path) -> None:
    real = tmp_path / "app.db"
    (tmp_path / "sub").mkdir()
    os.symlink(real, tmp_path / "link.db")
    spellings = engines(f"sqlite:///{real}", f"sqlite:///{tmp_path}/./sub/../app.db",
                        f"sqlite:///{tmp_path / 'link.db'}", f"sqlite:///{os.path.relpath(real)}")
    with spellings[0].begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    os.link(real, tmp_path / "hard.db")
    spellings += engines(f"sqlite:///{tmp_path / 'hard.db'}")
    first = database_identity(spellings[0])
    assert all(database_identity(e) == first for e in spellings)
    (other,) = engines(f"sqlite:///{tmp_path / 'other.db'}")
    assert database_identity(other) != first


def test_a_sqlite_schema_is_the_file_attached_under_its_name(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'home.db'}")

    @sa.event.listens_for(engine, "connect")
    def attach(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute(f"ATTACH DATABASE '{tmp_path / 'acme.db'}' AS Tenant_Acme")

    (direct,) = engines(f"sqlite:///{tmp_path}/./acme.db")
    assert schema_identity(engine, "tenant_acme") == schema_identity(direct, None)  # names without case
    assert schema_identity(engine, "Tenant_Acme") == schema_identity(direct, None)
    assert schema_identity(engine, None) != schema_identity(direct, None)
    assert schema_identity(engine, "globex") != schema_identity(create_engine(f"sqlite:///{tmp_path}/g.db"),
                                                                 "globex")
    engine.dispose()


def test_sqlite_folds_only_ascii_letters_in_table_and_schema_names(tmp_path: Path) -> None:
    """SQLite compares names without case in ASCII only: ``\u212a_t`` (the Kelvin sign) and ``k_t``,
    ``\u00c9_t`` and ``\u00e9_t`` are two tables to it, though Python's ``str.lower`` makes them one."""
    engine = create_engine(f"sqlite:///{tmp_path / 'home.db'}")

    @sa.event.listens_for(engine, "connect")
    def attach(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute(f"ATTACH DATABASE '{tmp_path / 'kx.db'}' AS kx")

    with engine.begin() as conn:
        for name in ("k_t", "\u212a_t", "\u00e9_t", "\u00c9_t"):
            conn.exec_driver_sql(f'CREATE TABLE "{name}" (x INTEGER)')  # four tables: SQLite says so
        with pytest.raises(sa.exc.OperationalError, match="already exists"):
            conn.exec_driver_sql('CREATE TABLE "K_T" (x INTEGER)')  # ASCII: one name in any case
    assert tables_identity(engine, None, "K_") == tables_identity(engine, "MAIN", "k_")
    assert tables_identity(engine, None, "\u212a_") != tables_identity(engine, None, "k_")
    assert tables_identity(engine, None, "\u00c9_") != tables_identity(engine, None, "\u00e9_")
    assert schema_identity(engine, "KX") == schema_identity(engine, "kx")
    assert schema_identity(engine, "\u212ax") != schema_identity(engine, "kx")  # no such database
    engine.dispose()


def test_in_memory_sqlite_databases_are_each_their_engines_own() -> None:
    one, two = create_engine("sqlite://"), create_engine("sqlite://")
    assert database_identity(one) == database_identity(one.execution_options(schema_translate_map={}))
    assert database_identity(one) != database_identity(two)
    assert not same_database(one, two)
