"""What counts as a database outage: the database cannot serve us *now*; not the work's fault.

One rule for every worker (DESIGN §9: an outage is not a failure). The inbox
waits an outage out without counting an attempt; the relay waits it out and
logs it once. Anything else a statement raises (an integrity, data or
programming error, a statement timeout) would fail again unchanged, so it is
the work's own failure.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, PendingRollbackError

# SQLSTATE classes that mean "try again later": 08 connection exception, 40 transaction
# rollback (serialization failure, deadlock), 53 insufficient resources (disk full, too many
# connections), 57 operator intervention (admin shutdown, the server is starting up),
# 55P03 lock not available, 58 system error (I/O).
_OUTAGE_SQLSTATE_CLASSES = ("08", "40", "53", "57", "58")
_OUTAGE_SQLSTATES = ("55P03",)
# 57014 is a statement timeout or a cancel: a handler's query too slow for its limit is the
# message's problem (it would time out again), not the database's.
_NOT_OUTAGE_SQLSTATES = ("57014",)
# MySQL/MariaDB error numbers that mean "try again later". The drivers (PyMySQL, aiomysql,
# mysqlclient) raise OperationalError for most server errors, a misspelt column (1054)
# included, so the number decides, not the class. Client side: 2002/2003 cannot connect,
# 2006 server gone away, 2013/2055 connection lost mid-query. Server side: 1040/1203 too
# many connections, 1053 shutdown in progress, 1205 lock wait timeout, 1213 deadlock
# (both roll back our work: rerun the transaction), 1021/1114 disk or table full,
# 1037/1038/1041 out of memory or resources, 1152/1159/1160/1161 connection aborted or
# a network read/write failed, 1180 error during commit, 1927 connection killed (MariaDB),
# 4031 disconnected for inactivity (MySQL 8). Statement timeouts (MySQL 3024, MariaDB
# 1969) are not outages: like PostgreSQL's 57014, the work would time out again.
_MYSQL_OUTAGE_CODES = frozenset({
    2002, 2003, 2006, 2013, 2055, 1040, 1203, 1053, 1205, 1213, 1021, 1114, 1037, 1038, 1041,
    1152, 1159, 1160, 1161, 1180, 1927, 4031,
})
_MYSQL_DRIVERS = ("pymysql", "aiomysql", "MySQLdb", "asyncmy", "mysql", "mariadb")
# SQLite reports everything as OperationalError, "no such table" (a bug) included.
_SQLITE_OUTAGES = ("locked", "busy", "disk i/o", "unable to open", "disk is full", "readonly")


def is_database_outage(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) says the database is unavailable, not wrong.

    Lost or refused connections, deadlocks, serialization failures, lock
    timeouts, a full disk, a server shutting down: retried unchanged, they
    succeed once the database is back. Integrity, data and programming errors
    are not outages: retried unchanged they fail again, so they count.
    """
    seen = 0
    link: BaseException | None = error  # then what caused it, and so on down the chain
    while link is not None and seen < 8:
        if isinstance(link, PendingRollbackError) and "invalid transaction" in str(link):
            return True  # the connection died under the transaction
        if isinstance(link, DBAPIError) and _dbapi_outage(link):
            return True
        if not isinstance(link, DBAPIError) and _raw_mysql_outage(link):
            return True
        link = link.__cause__ or link.__context__
        seen += 1
    return False


def _dbapi_outage(error: DBAPIError) -> bool:
    if error.connection_invalidated or isinstance(error, InterfaceError):
        return True
    # First: PyMySQL gives its errors a SQLSTATE too, and a lock wait timeout's (HY000)
    # says nothing; the MySQL error number does.
    code = _mysql_error_code(error.orig)
    if code is not None:
        return code in _MYSQL_OUTAGE_CODES
    sqlstate = getattr(error.orig, "sqlstate", None)
    if sqlstate:
        if sqlstate in _NOT_OUTAGE_SQLSTATES:
            return False
        return sqlstate.startswith(_OUTAGE_SQLSTATE_CLASSES) or sqlstate in _OUTAGE_SQLSTATES
    if not isinstance(error, OperationalError):
        return False
    if type(error.orig).__module__.startswith("sqlite3"):
        text = str(error.orig).lower()
        return any(word in text for word in _SQLITE_OUTAGES)
    return True  # a driver error without a SQLSTATE: the connection failed


def _raw_mysql_outage(error: BaseException) -> bool:
    """A MySQL driver's own error that SQLAlchemy let through unwrapped.

    A checked-out connection's isolation level (the relay's and inbox's READ
    COMMITTED, and back, ``outbox._engine._keep_levels``) is set outside
    SQLAlchemy's error wrapping, so a pooled connection the server dropped
    surfaces there as the driver's bare error.
    """
    code = _mysql_error_code(error)
    if code is None:
        return False
    return code in _MYSQL_OUTAGE_CODES or type(error).__name__ == "InterfaceError"


def _mysql_error_code(orig: BaseException | None) -> int | None:
    """The MySQL error number a MySQL driver's exception carries as its first argument."""
    if orig is None or type(orig).__module__.split(".")[0] not in _MYSQL_DRIVERS:
        return None
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None
