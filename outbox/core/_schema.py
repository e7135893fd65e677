"""The schema version and shard count stored with the tables, and in-place upgrades.

Settings that every publisher and relay of a database must agree on live in the
database (DESIGN §9), in ``{prefix}outbox_meta``: ``schema_version``,
``shard_count`` and ``max_record_bytes`` (the record size limit publishers
check and relays must be able to send; optional, for databases made before
it). Release 0.1 had no meta table; its tables are schema version 1.

The meta table also holds the database's ``incarnation`` (DESIGN §10): a UUID
minted when the tables are made, carried in every envelope the relay sends, so
a consumer can tell a rebuilt producer (whose keys count from seq 1 again)
from a broken one. A restored backup carries the incarnation of the database
it copied: ``new_incarnation`` mints another one after a restore.

An upgrade is the ordered list ``UPGRADES``: entry *i* (from 0) takes a database
from version *i + 1* to *i + 2*, so ``SCHEMA_VERSION`` is ``1 + len(UPGRADES)``.
Each step runs in its own transaction together with its version bump, and each
is idempotent (it looks before it creates), so an interrupted upgrade resumes
where it stopped, and tables already altered by hand or by Alembic are only
stamped. Adding a column or a table is one more entry, made with
``add_column`` / ``create_table`` below.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, inspect, select, text, update
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.schema import CreateColumn

from . import _mysql
from ._envelope import utcnow
from ._errors import ConfigurationError, SchemaError
from ._sharding import shard_for_key
from ._tables import MYSQL_FAMILY, OutboxStatus, OutboxTables, sql_name

DEFAULT_SHARDS = 16
MAX_SHARDS = 4096
INCARNATION = "incarnation"
# The largest broker record publish() accepts, counted as librdkafka counts it (``_wire``):
# librdkafka's default message.max.bytes, below a default broker's 1,048,588 per batch.
DEFAULT_MAX_RECORD_BYTES = 1_000_000
MIN_MAX_RECORD_BYTES = 4096  # room for the envelope and a small message
MAX_MAX_RECORD_BYTES = 1_000_000_000  # librdkafka's upper bound for message.max.bytes
UPGRADE_HINT = "run `outbox init-db --upgrade` (or Outbox.upgrade_tables())"

Step = Callable[[Connection, OutboxTables], None]


def create_table(attribute: str) -> Step:
    """A step creating ``OutboxTables.<attribute>`` with its indexes, unless it exists."""
    def step(conn: Connection, tables: OutboxTables) -> None:
        getattr(tables, attribute).create(conn, checkfirst=True)
    return step


def add_column(attribute: str, column: str) -> Step:
    """A step adding one column, defined once in ``_tables``, unless it exists.

    On a table with rows, a NOT NULL column needs a ``server_default``.
    """
    def step(conn: Connection, tables: OutboxTables) -> None:
        table = getattr(tables, attribute)
        schema = conn.schema_for_object(table)  # the inspector ignores a schema_translate_map
        present = {c["name"] for c in inspect(conn).get_columns(table.name, schema=schema)}
        if column not in present:
            ddl = CreateColumn(table.c[column]).compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {sql_name(conn, table)} ADD COLUMN {ddl}"))
    return step


def add_incarnation(conn: Connection, tables: OutboxTables) -> None:
    """The upgrade step of the incarnation: mint one unless there, add the inbox's columns."""
    _insert_missing(conn, tables, {INCARNATION: uuid.uuid4()})
    for attribute in ("inbox_keys", "inbox_held", "inbox_parked"):
        add_column(attribute, "incarnation")(conn, tables)


def add_event_type(conn: Connection, tables: OutboxTables) -> None:
    """The upgrade step of typed events: the event type of outbox rows, held and parked messages."""
    for attribute in ("messages", "inbox_held", "inbox_parked"):
        add_column(attribute, "event_type")(conn, tables)


# (what it does, the step). Append only; never reorder or remove a released entry.
UPGRADES: list[tuple[str, Step]] = [
    ("outbox_meta: the schema version and the shard count", create_table("meta")),
    ("inbox_keys.started_at_seq: the seq a first_seen key started at",
     add_column("inbox_keys", "started_at_seq")),
    ("incarnation: this database's identity in outbox_meta, and the producer incarnation "
     "of each inbox key, held and parked message", add_incarnation),
    ("event_type: the event type of each outbox row, held and parked inbox message",
     add_event_type),
    ("outbox_leases.unsettled_topics: the topics an exactly-once shard's transactions wrote since "
     "its last take-over settled them", add_column("leases", "unsettled_topics")),
]
SCHEMA_VERSION = 1 + len(UPGRADES)


@dataclass(frozen=True)
class StoredSchema:
    """What the meta table says: schema version, shard count, incarnation, record size limit.

    ``max_record_bytes`` is the largest broker record ``publish()`` accepts and
    every relay must be able to send; a database without the row (made before
    it existed) uses ``DEFAULT_MAX_RECORD_BYTES``.
    """

    version: int
    shard_count: int
    incarnation: str = ""
    """This database's identity (a UUID's text), sent in every envelope as ``outbox-incarnation``."""
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES


def check_shard_count(shards: object) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ConfigurationError(f"shards must be an int from 1 to {MAX_SHARDS}, got {shards!r}")
    return shards


def check_max_record_bytes(value: object) -> int:
    if (isinstance(value, bool) or not isinstance(value, int)
            or not MIN_MAX_RECORD_BYTES <= value <= MAX_MAX_RECORD_BYTES):
        raise ConfigurationError(
            f"max_record_bytes must be an int from {MIN_MAX_RECORD_BYTES} to {MAX_MAX_RECORD_BYTES}, "
            f"got {value!r}")
    return value


def check_same_max_record_bytes(requested: int | None, stored: int) -> None:
    """A publisher or relay that names the record limit must name the stored one."""
    if requested is not None and requested != stored:
        raise ConfigurationError(
            f"max_record_bytes={requested} was asked for, but this database's outbox tables "
            f"store {stored}: leave it out to use the stored one, or change it with "
            f"`outbox init-db --max-record-bytes {requested}` (relays must accept records that large)")


def check_same_shards(requested: int | None, stored: int) -> None:
    """A caller that names a shard count must name the stored one; a silent re-route splits keys."""
    if requested is not None and requested != stored:
        raise ConfigurationError(
            f"shards={requested} was asked for, but this database's outbox tables use "
            f"{stored} shards (stored in outbox_meta): leave the shard count out to use "
            "the stored one; to change it see 'Changing the shard count' in docs/relay.md"
        )


def read(conn: Connection, tables: OutboxTables) -> StoredSchema:
    """The stored schema, or a ``SchemaError`` saying what to run when it does not fit."""
    version, values = _look(conn, tables)
    if version is None:
        where = f" with prefix {tables.prefix!r}" if tables.prefix else ""
        schema = conn.schema_for_object(tables.meta)
        place = "this database" if schema is None else f"schema {schema!r} of this database"
        raise SchemaError(
            f"no outbox tables{where} in {place}: run `outbox init-db` "
            "(or Outbox.create_tables())"
        )
    _check_version(version)
    if "shard_count" not in values:
        raise SchemaError(f"outbox_meta records no shard count: {UPGRADE_HINT}")
    if INCARNATION not in values:
        raise SchemaError(f"outbox_meta records no incarnation: {UPGRADE_HINT}")
    if conn.dialect.name in MYSQL_FAMILY and (absent := _mysql.missing(conn, tables)):
        raise SchemaError(f"the outbox tables lack the {' and the '.join(absent)}: {UPGRADE_HINT}")
    return StoredSchema(version, _stored(values, "shard_count", check_shard_count),
                        _stored(values, INCARNATION, _check_incarnation),
                        _stored(values, "max_record_bytes", check_max_record_bytes,
                                str(DEFAULT_MAX_RECORD_BYTES)))


def _check_incarnation(text: str) -> str:
    """A UUID's canonical text: every envelope carries it, and the inbox decodes it as a UUID."""
    if str(uuid.UUID(text)) != text:
        raise ValueError(f"not a UUID's canonical text: {text[:40]!r}")
    return text


def _stored(values: dict[str, str], name: str, check: Callable[[Any], Any], default: str = "") -> Any:
    """The meta row ``name`` as ``check`` accepts it, or ``SchemaError`` naming the row.

    The meta table is plain rows anyone can edit: a value ``publish()`` or a relay would
    take on trust (a negative record limit, an incarnation every consumer refuses to
    decode) stops them here, at the first read, with what to fix.
    """
    text = str(values.get(name, default))
    try:
        return check(text if name == INCARNATION else int(text))
    except (ValueError, ConfigurationError) as exc:
        raise SchemaError(
            f"outbox_meta's {name!r} row holds {text[:40]!r}, which is not a valid {name} ({exc}): "
            f"{_REPAIRS.get(name, 'restore the value it had')}") from None


_REPAIRS = {INCARNATION: "give the database a new one with `outbox init-db --new-incarnation`",
            "max_record_bytes": "store the limit again with `outbox init-db --max-record-bytes N`"}


def create(conn: Connection, tables: OutboxTables, shards: int | None,
           max_record_bytes: int | None = None) -> StoredSchema:
    """Create missing tables and record version and shard count; refuse an old or new schema.

    ``max_record_bytes``, when given, is stored (a new value replaces the old one).
    """
    version, _ = _look(conn, tables)
    if version is not None:
        _check_version(version)
    tables.metadata.create_all(conn)
    _create_mysql_objects(conn, tables)
    if version is None:  # empty tables; _shards_in_use still refuses a count leases contradict
        _insert_missing(conn, tables, {"schema_version": SCHEMA_VERSION,
                                       "shard_count": _shards_in_use(conn, tables, shards),
                                       INCARNATION: uuid.uuid4()})
    if max_record_bytes is not None:
        _put(conn, tables, "max_record_bytes", check_max_record_bytes(max_record_bytes))
    stored = read(conn, tables)
    check_same_shards(shards, stored.shard_count)
    return stored


def upgrade(engine: Engine, tables: OutboxTables, shards: int | None = None,
            max_record_bytes: int | None = None) -> tuple[int, int]:
    """Bring the tables to ``SCHEMA_VERSION`` in place; returns (version before, after).

    A database without tables is created. Release 0.1's shard count was a flag,
    so it is taken from ``shards``, else the relays' lease rows, else the
    default, and refused if unpublished rows were sharded with another count.
    """
    with engine.begin() as conn:
        before, values = _look(conn, tables)
        if before is None:
            create(conn, tables, shards, max_record_bytes)
            return 0, SCHEMA_VERSION
        _check_version(before, allow_older=True)
        count = None if "shard_count" in values else _shards_in_use(conn, tables, shards)
    for version, (_, step) in enumerate(UPGRADES, start=2):
        if before < version:
            with engine.begin() as conn:
                step(conn, tables)
                _put(conn, tables, "schema_version", version)
    with engine.begin() as conn:
        _create_mysql_objects(conn, tables)
        if count is not None and "shard_count" not in _look(conn, tables)[1]:
            _put(conn, tables, "shard_count", count)
        if max_record_bytes is not None:
            _put(conn, tables, "max_record_bytes", check_max_record_bytes(max_record_bytes))
        check_same_shards(shards, read(conn, tables).shard_count)
    return before, SCHEMA_VERSION


def reshard(engine: Engine, tables: OutboxTables, shards: int, *, lease_ttl: float = 10.0) -> int:
    """Change the stored shard count of a drained, stopped outbox; returns the old count.

    Refused while a row is unpublished (its key would get rows in two shards,
    served by two relays), a relay holds a live lease or a relay heartbeat is
    younger than ``lease_ttl`` (the relays' TTL; a running relay would go on
    serving the old split — it also notices the change and stops). Publishers
    keep the count they read, so they must be stopped too; that this function
    cannot see (docs/relay.md says so).
    """
    m, leases, relays = tables.messages, tables.leases, tables.relays
    with engine.begin() as conn:
        old = read(conn, tables).shard_count
        waiting = conn.scalar(select(func.count()).select_from(m)
                              .where(m.c.status.not_in([OutboxStatus.PUBLISHED, OutboxStatus.SKIPPED])))
        if waiting:
            raise ConfigurationError(
                f"{waiting} row(s) are not published yet: stop the publishers, let the relays "
                "drain (`outbox stats` shows nothing pending or failed), then change the shard count")
        live = conn.scalar(select(func.count()).select_from(leases).where(
            leases.c.owner.is_not(None), leases.c.expires_at > utcnow()))
        if live:
            raise ConfigurationError(
                f"running relays hold {live} shard lease(s): stop every relay first (SIGTERM, or "
                "wait one lease TTL after a kill), then change the shard count")
        beating = list(conn.scalars(select(relays.c.worker_id).where(
            relays.c.heartbeat_at > utcnow() - timedelta(seconds=lease_ttl))))
        if beating:
            raise ConfigurationError(
                f"relay(s) {', '.join(sorted(beating))} sent a heartbeat in the last {lease_ttl:g} s: "
                "stop every relay first (SIGTERM, or wait one lease TTL after a kill), then "
                "change the shard count")
        # Every lease row stays: a shard's transactional id (incarnation, shard number) outlives a
        # reshard, and its row names the topics its transactions may have left open
        # (``relay._unsettled``) for the next take-over to end; a shard this count removes keeps its
        # row, unleased (``Leases._take`` takes shards below the count only), for a later count that
        # brings it back. The relays add a row per shard of the new count that has none.
        _put(conn, tables, "shard_count", check_shard_count(shards))
    return old


def new_incarnation(engine: Engine, tables: OutboxTables) -> tuple[str, str]:
    """Give the database a new identity; returns (old incarnation, new one).

    Run it after restoring the database from a backup, or copying it to a new
    server, before any relay sends from it: the copy would otherwise send its
    keys' seqs again under the identity of the database it copied, and the
    consumers could not tell the restart from a conflict (they park it as a
    ``seq_conflict``). Relays read the incarnation once when they start, so
    stop them first (docs/consumer.md, "Producer restarts").
    """
    with engine.begin() as conn:
        old = _look(conn, tables)[1].get(INCARNATION)  # as it is: a broken one is what this repairs
        if old is None:
            old = read(conn, tables).incarnation  # says what is missing
        new = str(uuid.uuid4())
        _put(conn, tables, INCARNATION, new)
    return old, new


def check(engine: Engine, tables: OutboxTables, *, inbox: bool = False) -> StoredSchema:
    """``read`` on a connection of its own: for entry points that do not publish.

    With ``inbox``, the inbox tables must be there too: the meta table alone
    does not prove it (they can be dropped, or the outbox tables made by hand),
    and a consumer would otherwise fail later, on every sweep, with "no such table".
    """
    with engine.connect() as conn:
        stored = read(conn, tables)
        if inbox:
            found = inspect(conn)
            for table in (tables.inbox_messages, tables.inbox_keys, tables.inbox_parked, tables.inbox_held):
                if not found.has_table(table.name, schema=conn.schema_for_object(table)):
                    raise SchemaError(f"table {table.name} does not exist in this database: "
                                      "run `outbox init-db` (or Inbox.create_tables())")
        return stored


def _create_mysql_objects(conn: Connection, tables: OutboxTables) -> None:
    """MySQL/MariaDB: the seq trigger and the "may block" column, unless there (``_mysql``).

    Not an upgrade step: they come with MySQL support itself, and a database made
    before they existed (or by ``create_all`` alone) gets them from ``upgrade``.
    """
    if conn.dialect.name in MYSQL_FAMILY:
        _mysql.create(conn, tables)


def _look(conn: Connection, tables: OutboxTables) -> tuple[int | None, dict[str, str]]:
    """(version, meta rows): version None means no tables (or meta rows not yet written)."""
    found = inspect(conn)  # which, unlike Core statements, ignores a schema_translate_map: translate here
    if not found.has_table(tables.meta.name, schema=conn.schema_for_object(tables.meta)):
        old = found.has_table(tables.messages.name, schema=conn.schema_for_object(tables.messages))
        return (1 if old else None), {}
    meta = tables.meta
    values = {name: value for name, value in conn.execute(select(meta.c.name, meta.c.value))}
    version = values.get("schema_version")
    if version is None and _has_rows(conn, tables):
        # An empty meta table beside tables with rows: an older database whose meta
        # table was made by someone else (Alembic's autogenerate). It is to be upgraded,
        # shard count and all, never stamped as new with the default count.
        return 1, values
    return (int(version) if version is not None else None), values


def _has_rows(conn: Connection, tables: OutboxTables) -> bool:
    found = inspect(conn)
    return any(
        found.has_table(table.name, schema=conn.schema_for_object(table))
        and conn.scalar(select(1).select_from(table).limit(1)) is not None
        for table in (tables.messages, tables.leases)
    )


def _check_version(version: int, *, allow_older: bool = False) -> None:
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"the outbox tables are at schema version {version}, newer than this release of "
            f"transactional-outbox knows ({SCHEMA_VERSION}): upgrade the package"
        )
    if version < SCHEMA_VERSION and not allow_older:
        raise SchemaError(
            f"the outbox tables are at schema version {version} and this release needs "
            f"{SCHEMA_VERSION}: {UPGRADE_HINT}"
        )


def _shards_in_use(conn: Connection, tables: OutboxTables, requested: int | None) -> int:
    """The shard count a 0.1 database was run with; refuse one its unpublished rows contradict."""
    leased = conn.execute(select(func.max(tables.leases.c.shard))).scalar()
    count = requested or (leased + 1 if leased is not None else DEFAULT_SHARDS)
    # Fewer than the lease rows name is no contradiction: a reshard to fewer shards keeps the rows
    # of the shards it removes (``reshard``), so they only bound the count from above; the
    # unpublished rows below say whether it is the count they were sharded with.
    if leased is not None and count > leased + 1:
        raise ConfigurationError(
            f"the relays of this database leased shards up to {leased}, so they ran with "
            f"{leased + 1} shards, not {count}: pass --shards {leased + 1}"
        )
    m = tables.messages
    unpublished = (select(m.c.key, m.c.shard).distinct()
                   .where(m.c.status.not_in([OutboxStatus.PUBLISHED, OutboxStatus.SKIPPED])))
    for key, shard in conn.execute(unpublished):
        if shard >= count or (key is not None and shard_for_key(key, count) != shard):
            raise ConfigurationError(
                f"unpublished rows were sharded with another count than {count} (key {key!r} "
                f"is in shard {shard}): pass --shards with the count your publishers used"
            )
    return count


def _insert_missing(conn: Connection, tables: OutboxTables, values: dict[str, object]) -> None:
    """Insert meta rows, leaving any a concurrent ``create`` wrote first."""
    meta = tables.meta
    rows = [{"name": name, "value": str(value)} for name, value in values.items()]
    dialect = conn.dialect.name
    if dialect in ("postgresql", "sqlite"):
        insert = (postgresql if dialect == "postgresql" else sqlite).insert(meta)
        conn.execute(insert.on_conflict_do_nothing(index_elements=[meta.c.name]), rows)
    elif dialect in MYSQL_FAMILY:  # a no-op update: unlike INSERT IGNORE it hides no other error
        upsert = mysql.insert(meta)
        conn.execute(upsert.on_duplicate_key_update(name=upsert.inserted.name), rows)
    else:
        present = set(conn.scalars(select(meta.c.name)))
        missing = [row for row in rows if row["name"] not in present]
        if missing:
            conn.execute(meta.insert(), missing)


def _put(conn: Connection, tables: OutboxTables, name: str, value: object) -> None:
    meta = tables.meta
    if not conn.execute(update(meta).where(meta.c.name == name).values(value=str(value))).rowcount:
        conn.execute(meta.insert().values(name=name, value=str(value)))
