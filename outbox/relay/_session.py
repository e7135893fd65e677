"""The relay's PostgreSQL sessions: set up once for the fetch, so that a fetch is one round trip.

The fetch wants three settings (``PostgresRelayStatements.prepare_fetch`` says
why: no sort, no JIT, the zone named 'UTC'). Set per transaction (``SET
LOCAL``) they cost a fetch four round trips: BEGIN, the settings, the fetch,
COMMIT. Each waits its turn for the database's CPU, so next to a tenant whose
backlog keeps the database busy a quiet tenant's fetch grew 3-4x (issue 39).
Set once per session instead, the fetch runs alone in autocommit: one round
trip, as one statement sees what committed before it either way.

A session so set is the relay's. The application, an inbox or a housekeeping
pass may share the relay's pool (``Relay(outbox)`` on the application's
engine), and must find their session as they left it: when anything but a
relay takes a connection the relay set, its own values are put back, as
they were read when the relay took it (the application's ``SET TIME ZONE``
included, not the server's default). As with ``core._engine._keep_levels``,
only a change of hands costs a statement.

Behind a pooler in transaction mode (PgBouncer's) a session is not the
client's to set: what the relay set would reach whichever client the server
connection serves next. An engine marked ``TRANSACTION_POOLED`` sets the
fetch's settings per transaction, as before (four round trips). Nor is a
prepared statement the client's: ``transaction_pooled_options`` gives the keyword
arguments of an engine made for such a pooler.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError

from ..core._engine import marked_copy, worker_engine

RELAY = "outbox_relay"
"""The execution option that marks a relay's engine copy: its connections may keep the fetch's session."""

TRANSACTION_POOLED = "outbox_transaction_pooled"
"""The execution option that says an engine reaches PostgreSQL through a transaction-mode pooler:
the relay then sets nothing on a session (``create_engine(url, execution_options={...: True})``)."""

def transaction_pooled_options(url: str) -> dict[str, Any]:
    """``create_engine`` keyword arguments for ``url``'s database reached through a transaction-mode pooler.

    The mark (``TRANSACTION_POOLED``), and through psycopg no prepared
    statements: psycopg prepares a statement it has run five times on its
    connection, and the pooler runs the next transaction on any server
    connection, where that statement does not exist, or another client's of the
    same name does ("prepared statement "_pg3_0" does not exist" / "already
    exists"). PgBouncer keeps prepared statements across server connections only
    from 1.21 on, and only with ``max_prepared_statements`` set; an application
    whose pooler does can make its own engine with the mark alone.
    """
    options: dict[str, Any] = {"execution_options": {TRANSACTION_POOLED: True}}
    try:
        driver = make_url(url).get_dialect().driver
    except Exception:
        return options  # not a URL, or an unknown dialect: create_engine names the problem
    if driver == "psycopg":
        options["connect_args"] = {"prepare_threshold": None}
    return options


_TAKEN = "outbox.relay_session"
"""Key in a pooled connection's ``info``: the session's own values, saved when the relay set it up."""

_SETTINGS = (("enable_sort", "off"), ("jit", "off"), ("TimeZone", "UTC"))

# The session's values read before they are set, in one statement (a materialized CTE runs first).
_TAKE = (
    "WITH theirs AS MATERIALIZED (SELECT "
    + ", ".join(f"current_setting('{name}') AS s{i}" for i, (name, _) in enumerate(_SETTINGS))
    + ") SELECT theirs.*, "
    + ", ".join(f"set_config('{name}', '{value}', false)" for name, value in _SETTINGS)
    + " FROM theirs"
)
_PER_TRANSACTION = "; ".join(f"SET LOCAL {name} = '{value}'" for name, value in _SETTINGS)
_GIVE_BACK = "SELECT " + ", ".join(f"set_config('{name}', %s, false)" for name, _ in _SETTINGS)


def relay_engine(engine: Engine) -> Engine:
    """The engine a relay runs on: ``worker_engine``'s, and on PostgreSQL marked as the relay's.

    Every statement of the relay runs there (fetch, marks, leases, the watch of
    its stuck keys), so a session set up for the fetch stays set while it passes
    between them; anything else that takes it gets its own values back
    (``_give_back``).
    """
    engine = worker_engine(engine)
    if engine.dialect.name != "postgresql" or engine.get_execution_options().get(RELAY):
        return engine
    return marked_copy(engine, engine, RELAY, _give_back)


def fetch_session(conn: Connection) -> Connection:
    """``conn`` in autocommit, its session set up for the fetch (once per connection); through a
    transaction-mode pooler, ``conn`` in a transaction with the settings set for it alone."""
    if conn.get_execution_options().get(TRANSACTION_POOLED):
        conn.exec_driver_sql(_PER_TRANSACTION)
        return conn
    conn = conn.execution_options(isolation_level="AUTOCOMMIT")
    pooled = conn.connection
    if _TAKEN not in pooled.info:
        theirs = conn.exec_driver_sql(_TAKE).one()
        pooled.info[_TAKEN] = tuple(theirs[: len(_SETTINGS)])
    return conn


def _give_back(connection: Connection) -> None:
    """A connection the relay set up, taken by anything else: the session's own values back.

    Set in autocommit, outside the taker's transaction (a rollback of theirs
    would set the relay's values again). A dead connection is invalidated first,
    so the pool does not hand it out again, and its error raised as SQLAlchemy's
    ``DBAPIError`` with ``connection_invalidated``: the driver's own error is no
    outage to ``is_database_outage`` nor to an application's ``except``.
    """
    if connection.get_execution_options().get(RELAY):
        return
    pooled = connection.connection
    theirs: Any = pooled.info.get(_TAKEN)
    if theirs is None:
        return
    dbapi = pooled.dbapi_connection
    assert dbapi is not None  # a connection just checked out has one
    try:
        autocommit = dbapi.autocommit
        dbapi.autocommit = True
        try:
            cursor = dbapi.cursor()
            try:
                cursor.execute(_GIVE_BACK, theirs)
            finally:
                cursor.close()
        finally:
            dbapi.autocommit = autocommit
    except Exception as exc:
        connection.invalidate(exc)
        # Wrapped as SQLAlchemy wraps a statement's error, so that whoever took the connection
        # (an inbox, a retention pass, the application's ``except DBAPIError``) sees an outage.
        raise DBAPIError.instance(_GIVE_BACK, theirs, exc, connection.dialect.loaded_dbapi.Error,
                                  hide_parameters=connection.engine.hide_parameters,
                                  connection_invalidated=True, dialect=connection.dialect) from exc
    del pooled.info[_TAKEN]
