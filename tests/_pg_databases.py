"""The tests' fresh PostgreSQL databases (``postgres_db``): a finished test's database, emptied.

A ``CREATE DATABASE`` copies template1 (7.5 MB, through the WAL) and the ``DROP DATABASE``
after the test removes it again; the first connection to a new database also builds its
relation cache. That was 60-250 ms of every PostgreSQL test's set-up alone on this 2-core host,
quiet or beside the other sessions' tests (2026-12-05), against about 30 ms for what follows. So
a database a test is done with goes to the next test, once nothing of the earlier test can be
seen in it:

- no one may connect to it while every connection to it is ended, as ``DROP DATABASE … WITH
  (FORCE)`` ends them, and it is renamed (``t_`` and a new uuid): what the test left running
  (a fleet's closer giving leases back) reconnects by the old name and fails as after a drop,
  and no test sees a name an earlier one used;
- what tests make is dropped: extensions, schemas, and the tables, views, sequences, types and
  routines in ``public`` (``public`` itself stays: made again it would lack template1's
  initial privileges);
- its catalogs are compared with a new database's (``_fingerprint_of``: the row count of every
  per-database catalog but the statistics; ``public``'s owner, privileges and comment; the
  database's own row, settings and shared dependencies; the privileges on every object): a
  leftover the cleanup does not know (``ALTER DATABASE … SET``, a publication, a revoked
  privilege, a temporary schema, a prepared transaction) shows as a difference, and that
  database is dropped as before. So is one whose connections would not end within 5 s.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

_MADE = """
SELECT 1, 'EXTENSION', quote_ident(extname) FROM pg_extension WHERE extname <> 'plpgsql'
UNION ALL
SELECT 2, 'SCHEMA', quote_ident(nspname) FROM pg_namespace
 WHERE nspname NOT IN ('public', 'pg_catalog', 'information_schema', 'pg_toast')
   AND nspname NOT LIKE 'pg\\_temp\\_%' AND nspname NOT LIKE 'pg\\_toast\\_temp\\_%'
UNION ALL
SELECT 3, CASE relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                       WHEN 'f' THEN 'FOREIGN TABLE' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
       'public.' || quote_ident(relname)
  FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
UNION ALL
SELECT 4, 'TYPE', 'public.' || quote_ident(t.typname)
  FROM pg_type t LEFT JOIN pg_class c ON c.oid = t.typrelid
 WHERE t.typnamespace = 'public'::regnamespace AND t.typtype IN ('c', 'd', 'e', 'r')
   AND (t.typrelid = 0 OR c.relkind = 'c')
UNION ALL
SELECT 5, 'ROUTINE',
       'public.' || quote_ident(proname) || '(' || pg_get_function_identity_arguments(oid) || ')'
  FROM pg_proc WHERE pronamespace = 'public'::regnamespace
ORDER BY 1
"""
"""What tests make in a database, in the order to drop it (an extension's members go with it)."""

_CATALOGS = """
SELECT relname FROM pg_class
 WHERE relnamespace = 'pg_catalog'::regnamespace AND relkind = 'r' AND NOT relisshared
   AND relname NOT IN ('pg_statistic', 'pg_largeobject')
 ORDER BY relname
"""
"""The per-database catalogs (not the statistics ANALYZE keeps; large objects count by their metadata)."""

_ABOUT_THE_DATABASE = """
SELECT to_jsonb(n) - 'oid', obj_description(n.oid, 'pg_namespace'),
       to_jsonb(d) - 'oid' - 'datname' - 'datfrozenxid' - 'datminmxid',
       (SELECT count(*) FROM pg_db_role_setting WHERE setdatabase = d.oid),
       (SELECT count(*) FROM pg_shdepend WHERE dbid = d.oid),
       (SELECT count(*) FROM pg_shdescription WHERE objoid = d.oid),
       (SELECT count(*) FROM pg_subscription WHERE subdbid = d.oid),
       (SELECT count(*) FROM pg_replication_slots WHERE database = d.datname),
       (SELECT count(*) FROM pg_prepared_xacts WHERE database = d.datname),
       (SELECT md5(string_agg(oid || ':' || nspacl::text, ',' ORDER BY oid)) FROM pg_namespace
         WHERE nspacl IS NOT NULL),
       (SELECT md5(string_agg(oid || ':' || relacl::text, ',' ORDER BY oid)) FROM pg_class
         WHERE relacl IS NOT NULL),
       (SELECT md5(string_agg(oid || ':' || proacl::text, ',' ORDER BY oid)) FROM pg_proc
         WHERE proacl IS NOT NULL),
       (SELECT md5(string_agg(oid || ':' || typacl::text, ',' ORDER BY oid)) FROM pg_type
         WHERE typacl IS NOT NULL),
       (SELECT md5(string_agg(oid || ':' || lanacl::text, ',' ORDER BY oid)) FROM pg_language
         WHERE lanacl IS NOT NULL)
  FROM pg_namespace n, pg_database d WHERE n.nspname = 'public' AND d.datname = current_database()
"""
"""The database's own row and what it shares with the server, ``public`` as a new database has it,
and the privileges on what every database has (a test may revoke ``pg_control_system()``)."""


def _url(server_url: str, name: str) -> str:
    return sa.make_url(server_url).set(database=name).render_as_string(hide_password=False)


def _new_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


class RecycledDatabases:
    """Empty databases on the PostgreSQL server at ``server_url``, each handed to one test at a time."""

    def __init__(self, server_url: str) -> None:
        self._server_url = server_url
        self._admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", pool_size=1)
        self._spare: list[str] = []
        self._lock = threading.Lock()
        self._fingerprint_sql: str | None = None
        self._new: str | None = None  # a new database's fingerprint
        self.made = self.handed_on = 0

    @contextmanager
    def database(self) -> Iterator[str]:
        """The URL of an empty database of the caller's own until the block ends."""
        name = self._take()
        try:
            yield _url(self._server_url, name)
        finally:
            self._give_back(name)

    def close(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, []
        for name in spare:
            self._drop(name)
        self._admin.dispose()

    def _take(self) -> str:
        with self._lock:
            if self._spare:
                self.handed_on += 1
                return self._spare.pop()
        name = _new_name()
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        self.made += 1
        if self._new is None:
            self._new = self._fingerprint(name)
        return name

    def _give_back(self, name: str) -> None:
        try:
            hidden = self._hidden(name)
            if hidden is not None:
                name = hidden
                if self._emptied(name):
                    with self._lock:
                        self._spare.append(name)
                    return
        except sa.exc.DBAPIError:
            pass
        self._drop(name)

    def _hidden(self, name: str) -> str | None:
        """End every connection to ``name`` and rename it; the new name, None if they would not end.

        Under its new name the database is out of reach of what the test left behind (a worker
        loop left running by design reconnects by the old name, and fails as after a drop)."""
        fresh = _new_name()
        with self._admin.connect() as conn:
            # Not even a superuser connects meanwhile (a fleet's closer reconnects to give leases back).
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            if not self._without_connections(conn, name, end=True):
                return None
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" RENAME TO "{fresh}"')
            conn.exec_driver_sql(f'ALTER DATABASE "{fresh}" ALLOW_CONNECTIONS true')
        return fresh

    def _emptied(self, name: str) -> bool:
        """Drop what tests make in ``name``; whether it is then like a new database."""
        engine = sa.create_engine(_url(self._server_url, name), isolation_level="AUTOCOMMIT",
                                  poolclass=sa.NullPool)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("SET lock_timeout = '5s'")  # a prepared transaction's locks
                made: dict[str, list[str]] = {}
                for _, kind, what in conn.execute(sa.text(_MADE)):
                    made.setdefault(kind, []).append(what)
                for kind, names in made.items():
                    conn.exec_driver_sql(f"DROP {kind} IF EXISTS {', '.join(names)} CASCADE")
                same = self._fingerprint_of(conn) == self._new
        finally:
            engine.dispose()
        with self._admin.connect() as conn:  # the next test sees no connection of ours
            return same and self._without_connections(conn, name)

    @staticmethod
    def _without_connections(conn: sa.Connection, name: str, *, end: bool = False) -> bool:
        """Wait until no connection to ``name`` is left (ended ones take a moment to go), ending
        each one seen if ``end``; whether none was left within 5 s. (``pg_terminate_backend``'s
        own wait polls every 0.1 s.)"""
        left = sa.text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = :name" if end else
                       "SELECT count(*) FROM pg_stat_activity WHERE datname = :name")
        deadline = time.monotonic() + 5
        while conn.execute(left, {"name": name}).scalar_one():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _fingerprint(self, name: str) -> str:
        engine = sa.create_engine(_url(self._server_url, name), poolclass=sa.NullPool)
        try:
            with engine.connect() as conn:
                return self._fingerprint_of(conn)
        finally:
            engine.dispose()

    def _fingerprint_of(self, conn: sa.Connection) -> str:
        if self._fingerprint_sql is None:
            counts = [f"(SELECT count(*) FROM pg_catalog.{catalog})"
                      for catalog in conn.exec_driver_sql(_CATALOGS).scalars()]
            self._fingerprint_sql = f"SELECT {', '.join(counts)}"
        counts = conn.exec_driver_sql(self._fingerprint_sql).one()
        about = conn.exec_driver_sql(_ABOUT_THE_DATABASE).one()
        return repr((tuple(counts), tuple(about)))

    def _drop(self, name: str) -> None:
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
