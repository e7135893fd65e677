"""A database known by what its server says it is, not by how its URL is spelled (DESIGN §11).

``localhost`` and ``127.0.0.1``, an added ``?connect_timeout=10``, another
user, ``postgresql://`` and ``postgresql+psycopg://``, ``dir/./app.db``, a
symlink or a hard link to the file: each spells one database in another way,
and comparing the spellings took one database for two. Every "is this the same
database, the same schema" decision asks the server instead:

- **PostgreSQL**: the cluster's ``system_identifier`` (``pg_control_system()``,
  executable by every user unless revoked) and the database's oid. A schema is
  its name as the server holds it (the SQL we send quotes a name only when it
  must, so the name we are given *is* the server's), or the connection's
  ``current_schema()`` when none is given. Not its oid: a schema dropped and
  made again is the same place for our tables, and a name costs no query per
  tenant. A physical standby shares its primary's identifier and oids: the
  same database, which it is.
- **MySQL**: ``@@server_uuid`` (kept in the data directory's ``auto.cnf``).
- **MariaDB** has no server uuid: its own identity is ``@@server_uid`` (a hash
  of the server's MAC address and TCP port that it computes at start and
  names itself by in its error log) with ``@@hostname``, ``@@port`` and
  ``@@datadir``, all read-only while it runs. Limits: two servers on two
  hosts with the same hostname, port, data directory and MAC address (cloned
  VMs, containers given one hostname) are taken for one, so their tenants
  of one schema name are refused (never mixed); and the nodes of a Galera
  cluster are different servers to it.
- On both, a schema is a database of the server, named as the server compares
  names: folded to lower case when ``lower_case_table_names`` is 1 or 2.
- **SQLite**: the file's device and inode (``os.stat`` follows symlinks, hard
  links share the inode), for the main database and each attached one (a
  schema). An in-memory or temporary database is its engine's own: two
  engines never share one (a named shared-cache memory database is not
  recognised across engines).
- A set of tables is its schema and its table prefix as the server compares
  table names (``tables_identity``): SQLite in any case of ASCII letters (it
  folds no other: the Kelvin sign is not ``k`` there), MySQL and MariaDB as
  their schema names, PostgreSQL as given (a name with capitals is sent
  quoted, so ``OUT_`` and ``out_`` are two prefixes there).

What a server says is read once per connection pool (one query; PostgreSQL's
schemas need no more) and kept while the pool lives. A server that does not
answer raises what its driver raised (``is_database_outage`` says it is an
outage); nothing is cached then.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import Pool

from ._errors import ConfigurationError
from ._outage import first_line, is_database_outage
from ._secrets import database_secrets, database_url, scrub
from ._validation import folded


@dataclass(frozen=True, slots=True)
class DatabaseIdentity:
    """What a database server says one of its databases is: equal for every spelling of its URL."""

    dialect: str
    """``postgresql``, ``mysql``, ``mariadb`` or ``sqlite``."""
    server: str
    """The server (PostgreSQL: the cluster) as it names itself; ``""`` for SQLite (no server)."""
    database: str
    """Which database of the server: PostgreSQL's oid, MySQL's name as it compares names, SQLite's file."""

    def __str__(self) -> str:
        if self.dialect == "sqlite":
            return f"sqlite file {self.database}"
        return f"{self.dialect} server {self.server} database {self.database}"


@dataclass(frozen=True, slots=True)
class SchemaIdentity:
    """Where tables named in one schema live: equal for every spelling of the database and schema."""

    database: DatabaseIdentity
    """The database holding the schema; on MySQL, MariaDB and SQLite the schema's own database."""
    schema: str
    """PostgreSQL's schema name; ``""`` where a schema is a database (MySQL, MariaDB, SQLite)."""

    def __str__(self) -> str:
        return f"{self.database} schema {self.schema}" if self.schema else str(self.database)


@dataclass(frozen=True, slots=True)
class TablesIdentity:
    """One set of outbox and inbox tables: equal for every spelling of the database, schema and prefix."""

    schema: SchemaIdentity
    prefix: str
    """The table prefix as the server compares table names."""


@dataclass(frozen=True, slots=True)
class _Facts:
    """What one connection pool's server said about itself, once."""

    database: DatabaseIdentity
    default_schema: str
    """Where unqualified tables go: PostgreSQL's ``current_schema()``, MySQL's ``DATABASE()``."""
    fold: Callable[[str], str]
    """A schema or table name as the server compares it."""


_facts: weakref.WeakKeyDictionary[Pool, _Facts] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_own = itertools.count(1)
"""Numbers the in-memory SQLite databases: each is its own engine's."""


def database_identity(engine: Engine) -> DatabaseIdentity:
    """The identity of ``engine``'s database, read from its server once per connection pool.

    Raises the driver's error when the database does not answer (an outage),
    ``ConfigurationError`` when the server will not say who it is.
    """
    return _facts_of(engine).database


def known_server(engine: Engine) -> tuple[str, str] | None:
    """The server of ``engine``'s database (``database_identity``'s dialect and server), if it was
    read already on this pool; None otherwise. Never a query: a hung server is not asked.

    The server, not the database: the databases of one server hang together, so what bounds a hung
    server's hold on shared threads counts by it (the inbox's slots; the relay fleet's count by the
    same pair, read once a tenant was claimed).
    """
    with _lock:
        found = _facts.get(engine.pool)
    return None if found is None else (found.database.dialect, found.database.server)


def schema_identity(engine: Engine, schema: str | None) -> SchemaIdentity:
    """Where tables named in ``schema`` of ``engine``'s database live (``None``: unqualified tables).

    Raises as ``database_identity`` does.
    """
    facts = _facts_of(engine)
    database = facts.database
    if database.dialect == "sqlite":
        return SchemaIdentity(_sqlite_schema(engine, schema), "")
    name = facts.default_schema if schema is None else facts.fold(schema)
    if database.dialect == "postgresql":
        return SchemaIdentity(database, name)
    return SchemaIdentity(DatabaseIdentity(database.dialect, database.server, name), "")


def tables_identity(engine: Engine, schema: str | None, prefix: str) -> TablesIdentity:
    """Which tables ``prefix`` names in ``schema`` of ``engine``'s database, as its server compares names.

    SQLite takes a table name in any case, as MySQL and MariaDB do with
    ``lower_case_table_names`` 1 or 2: there ``out_`` and ``OUT_`` name one
    set of tables. Raises as ``database_identity`` does.
    """
    return TablesIdentity(schema_identity(engine, schema), _facts_of(engine).fold(prefix))


def same_database(a: Engine, b: Engine) -> bool:
    """Whether ``a`` and ``b`` reach one database, whatever their URLs look like.

    One pool, or a server's URLs alike to the letter (password included),
    need no question; otherwise both are asked (``database_identity``), and
    raise when they do not answer. SQLite is always asked, as two in-memory
    databases are spelled alike.
    """
    if a.pool is b.pool or (a.dialect.name != "sqlite" and _spelled(a) == _spelled(b)):
        return True
    return database_identity(a) == database_identity(b)


def answers_same(a: Engine, b: Engine) -> bool | None:
    """``same_database``, or None when one of them does not answer (an outage): not known yet."""
    try:
        return same_database(a, b)
    except Exception as exc:
        if is_database_outage(exc):
            return None
        raise


def _spelled(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _facts_of(engine: Engine) -> _Facts:
    pool = engine.pool
    with _lock:
        found = _facts.get(pool)
    if found is not None:
        return found
    if engine.dialect.name == "sqlite":  # on the driver's connection (``_sqlite_file``)
        facts = _Facts(_sqlite_file(engine, None), "main", folded)  # ASCII letters only, as SQLite
    else:
        with engine.connect() as conn:
            facts = _read(engine, conn)
    with _lock:
        return _facts.setdefault(pool, facts)


def _read(engine: Engine, conn: Connection) -> _Facts:
    name = engine.dialect.name
    if name == "postgresql":
        return _postgres(engine, conn)
    if name in ("mysql", "mariadb"):
        return _mysql(engine, conn)
    raise ConfigurationError(f"cannot tell which database {_shown(engine)} is: {name} is not supported")


def _postgres(engine: Engine, conn: Connection) -> _Facts:
    try:
        system, oid, current = conn.execute(sa.text(
            "SELECT (SELECT system_identifier FROM pg_control_system()), "
            "(SELECT oid FROM pg_database WHERE datname = current_database()), current_schema()")).one()
    except DBAPIError as exc:
        if is_database_outage(exc):
            raise
        said = scrub(first_line(exc.orig or exc), database_secrets(_spelled(engine)))
        raise ConfigurationError(
            f"cannot tell which PostgreSQL cluster {_shown(engine)} is: {said} (the user needs EXECUTE "
            "on pg_control_system(), which every user has unless it was revoked)") from None
    # current_schema() is NULL when no schema of the search_path exists: unqualified tables go nowhere.
    return _Facts(DatabaseIdentity("postgresql", str(system), str(oid)), current or "", _same)


def _mysql(engine: Engine, conn: Connection) -> _Facts:
    said = {str(name).lower(): str(value) for name, value in conn.execute(sa.text(
        "SHOW GLOBAL VARIABLES WHERE Variable_name IN "
        "('server_uuid', 'server_uid', 'hostname', 'port', 'datadir', 'lower_case_table_names')"))}
    current = conn.execute(sa.text("SELECT DATABASE()")).scalar()
    fold: Callable[[str], str] = str.lower if said.get("lower_case_table_names", "0") in ("1", "2") else _same
    if said.get("server_uuid"):
        dialect, server = "mysql", said["server_uuid"]
    else:  # MariaDB: no uuid; its own name for itself, and where it runs (the module doc)
        dialect = "mariadb"
        server = " ".join(said.get(name, "?") for name in ("server_uid", "hostname", "port", "datadir"))
    default = fold(current) if current else ""
    return _Facts(DatabaseIdentity(dialect, server, default), default, fold)


def _sqlite_file(engine: Engine, schema: str | None) -> DatabaseIdentity:
    """The identity of the file holding ``schema`` (``None``: the main database) of a SQLite engine.

    Read on the driver's connection, outside any transaction: ``create_engine``'s
    SQLite transactions take the write lock at their start, and a question
    about the file must not wait for a writer.
    """
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA database_list")
        rows = cursor.fetchall()
        cursor.close()
    finally:
        raw.close()
    # SQLite compares names without case in ASCII only (``folded``): not ``str.lower``, which makes the
    # Kelvin sign a ``k`` and ``\u00c9`` an ``\u00e9``, names SQLite takes for others.
    wanted = "main" if schema is None else folded(schema)
    file = {folded(str(name)): str(file or "") for _, name, file in rows}.get(wanted)
    if not file:
        # In memory or temporary (its engine's own), or not attached (no table of it can be
        # reached: nobody's).
        return DatabaseIdentity("sqlite", "", _memory_of(engine, wanted if file is not None else
                                                          f"unattached {wanted}"))
    try:
        found = os.stat(file)
    except OSError:  # not made yet (SQLite makes a file on its first write): named by its real path
        return DatabaseIdentity("sqlite", "", os.path.realpath(file))
    return DatabaseIdentity("sqlite", "", f"device {found.st_dev} inode {found.st_ino}")


_sqlite_schemas: weakref.WeakKeyDictionary[Pool, dict[str, DatabaseIdentity]] = weakref.WeakKeyDictionary()


def _sqlite_schema(engine: Engine, schema: str | None) -> DatabaseIdentity:
    """``_sqlite_file`` of ``schema``, once per pool: the files attached at connect stay."""
    name = "main" if schema is None else folded(schema)
    with _lock:
        found = _sqlite_schemas.get(engine.pool, {}).get(name)
    if found is None:
        found = _sqlite_file(engine, schema)
        with _lock:
            found = _sqlite_schemas.setdefault(engine.pool, {}).setdefault(name, found)
    return found


_memories: weakref.WeakKeyDictionary[Pool, dict[str, str]] = weakref.WeakKeyDictionary()


def _memory_of(engine: Engine, name: str) -> str:
    """A name for an in-memory database that no other engine's shares (a number, never reused)."""
    with _lock:
        own = _memories.setdefault(engine.pool, {})
        if name not in own:
            own[name] = f"memory {next(_own)}"
        return own[name]


def _same(name: str) -> str:
    return name


def _shown(engine: Engine) -> str:
    return database_url(_spelled(engine))
