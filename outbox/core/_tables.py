"""The tables, as SQLAlchemy Core on one ``MetaData`` users can hand to Alembic.

Broker positions are stored as ``kafka_partition`` / ``kafka_offset`` and the
consumer group as ``consumer_group``, so no column needs quoting in hand-written
SQL (``offset`` and ``group`` are reserved words).

On MySQL and MariaDB the generic types would lose things, so they get variants
(docs/producer.md, "MySQL and MariaDB"): timestamps keep microseconds
(``DATETIME(6)``), payloads up to 4 GiB (``LONGBLOB``, a ``BLOB`` stops at
64 KiB), and topics, keys and group names compare byte for byte (a binary,
no-pad collation), where the servers' default collations would make ``"A"``
and ``"a"`` — or ``"a"`` and ``"a "`` — one key sharing one seq.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.types import TypeEngine

from ._errors import ConfigurationError
from ._status import OutboxStatus as OutboxStatus  # re-exported: the package imports it from here
from ._status import StatusText
from ._validation import validate_identifier

MYSQL_FAMILY = ("mysql", "mariadb")
"""SQLAlchemy's dialect names for MySQL and MariaDB (``mariadb://`` URLs name the second)."""

SUPPORTED_DIALECTS = ("postgresql", "sqlite", *MYSQL_FAMILY)
"""The databases the producer, the relay and the inbox run on (SQLAlchemy's dialect names)."""

# The shortest identifier limit among the supported databases: PostgreSQL's 63 bytes
# (MySQL's is 64). A longer name is truncated by PostgreSQL and refused by MySQL.
MAX_IDENTIFIER_LENGTH = 63


class InboxOutcome(StrEnum):
    """``inbox_messages.outcome``: how a message id was finished (``outbox.inbox.InboxOutcome``)."""

    PROCESSED = "processed"
    """The handler's writes committed with this row."""
    SKIPPED = "skipped"
    """The handler raised ``SkipMessage``."""
    DISCARDED = "discarded"
    """An operator discarded it (``note`` says who, when and why)."""

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


# Text that may be long (errors, tracebacks): MySQL's TEXT stops at 64 KiB.
_LongText = Text().with_variant(mysql.MEDIUMTEXT(), *MYSQL_FAMILY)
_Payload = LargeBinary().with_variant(mysql.LONGBLOB(), *MYSQL_FAMILY)
# 32 hex digits on MySQL and MariaDB. MariaDB's own UUID type orders values otherwise than
# their bytes (it moves segments for index locality), so a range of ids split in Python —
# the Spark reader's partitions of inbox_messages — would miss rows there.
_MessageId = Uuid().with_variant(Uuid(native_uuid=False), *MYSQL_FAMILY)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in Python on every backend (SQLite and MySQL store naive UTC).

    On MySQL/MariaDB the column is ``DATETIME(6)``: a plain ``DATETIME`` drops the
    microseconds, and ``TIMESTAMP`` converts with the session's time zone.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in MYSQL_FAMILY:
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass timezone-aware UTC datetimes")
        value = value.astimezone(UTC)
        return value if dialect.name == "postgresql" else value.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC)


class Name(TypeDecorator[str]):
    """A ``VARCHAR`` compared byte for byte on every backend: topics, keys, group and worker names.

    PostgreSQL and SQLite compare strings exactly already. MySQL's and MariaDB's
    default collations ignore case (and accents, and trailing spaces): there the
    column gets the binary no-pad collation of utf8mb4, so two keys that differ
    only in case or a trailing space stay two keys with two seqs.
    """

    impl = String
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in MYSQL_FAMILY:
            length = getattr(self.impl_instance, "length", None)
            return dialect.type_descriptor(
                mysql.VARCHAR(length, charset="utf8mb4", collation=name_collation(dialect)))
        return dialect.type_descriptor(self.impl_instance)


def name_collation(dialect: Dialect) -> str:
    """The binary no-pad utf8mb4 collation of ``Name`` columns on MySQL 8 or MariaDB (10.2+)."""
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


def _stored_message_columns(*, id_is_primary_key: bool = False) -> list[Column[Any]]:
    """Columns that keep a whole consumed message, for tables that replay it later."""
    return [
        Column("message_id", _MessageId, nullable=False, primary_key=id_is_primary_key),
        Column("topic", Name(249), nullable=False),
        Column("key", Name(255)),
        Column("seq", BigInteger),
        Column("payload", _Payload, nullable=False),
        Column("content_type", String(100), nullable=False),
        Column("headers", JSON, nullable=False),
        Column("created_at", UTCDateTime, nullable=False),
        Column("kafka_partition", Integer),
        Column("kafka_offset", BigInteger),
        # The producer database's incarnation from the envelope; NULL when it carried none.
        Column("incarnation", String(36)),
        # The envelope's event type (``outbox-event-type``): typed handlers are chosen by it.
        Column("event_type", Name(255)),
    ]


def sql_name(conn: Connection, table: Table) -> str:
    """``table``'s name for hand-written SQL on ``conn``: quoted, in the schema ``conn`` gives it.

    Core statements follow the connection's ``schema_translate_map`` by
    themselves; text does not, so text names tables through this (a tenant's
    connection maps the tables' schema to the tenant's).
    """
    quote = conn.dialect.identifier_preparer
    schema = conn.schema_for_object(table)
    name = quote.quote(table.name)
    return name if schema is None else f"{quote.quote_schema(schema)}.{name}"


class OutboxTables:
    """All outbox and inbox tables, named ``{prefix}outbox_messages`` etc.

    Pass your own ``metadata`` to get the tables into your Alembic migrations;
    ``prefix`` and ``schema`` must be plain identifiers and are checked here.
    """

    def __init__(
        self, metadata: MetaData | None = None, *, prefix: str = "", schema: str | None = None
    ) -> None:
        self.prefix = validate_identifier(prefix, "table prefix", allow_empty=True)
        self.schema = None if schema is None else validate_identifier(schema, "schema")
        self.metadata = metadata if metadata is not None else MetaData()
        p, s, md = self.prefix, self.schema, self.metadata

        self.messages = Table(
            f"{p}outbox_messages", md,
            Column("id", _BigId, primary_key=True, autoincrement=True),
            Column("message_id", _MessageId, nullable=False, unique=True),
            Column("topic", Name(249), nullable=False),
            Column("key", Name(255)),
            Column("seq", BigInteger),
            Column("shard", Integer, nullable=False),
            Column("payload", _Payload, nullable=False),
            Column("content_type", String(100), nullable=False),
            Column("headers", JSON, nullable=False),
            Column("created_at", UTCDateTime, nullable=False),
            Column("available_at", UTCDateTime, nullable=False),
            Column("attempts", Integer, nullable=False, default=0),
            Column("last_error", _LongText),
            Column("status", StatusText(), nullable=False, default=OutboxStatus.PENDING),
            Column("published_at", UTCDateTime),
            Column("kafka_partition", Integer),
            Column("kafka_offset", BigInteger),
            # What the payload is (a pydantic model's registered name, ``outbox.event``), sent
            # as the ``outbox-event-type`` header; NULL for an untyped message.
            Column("event_type", Name(255)),
            CheckConstraint(
                "status IN ({})".format(", ".join(f"'{status}'" for status in OutboxStatus)),
                name=f"ck_{p}outbox_status",
            ),
            schema=s,
        )
        m = self.messages.c
        Index(
            f"ix_{p}outbox_pending", m.shard, m.id,
            postgresql_where=m.status == OutboxStatus.PENDING, sqlite_where=m.status == OutboxStatus.PENDING,
        )
        # Finds the unfinished predecessors of a key's message (relay ordering, failed rows).
        Index(
            f"ix_{p}outbox_open_key", m.topic, m.key, m.seq,
            postgresql_where=m.status != OutboxStatus.PUBLISHED,
            sqlite_where=m.status != OutboxStatus.PUBLISHED,
        )
        # Rows that may hold their key back (failed, delayed, waiting for a retry): tiny,
        # so the relay's per-row "does an earlier row block my key" probe is nearly free.
        may_block = (m.status != OutboxStatus.PUBLISHED) & (
            (m.status == OutboxStatus.FAILED) | (m.available_at > m.created_at))
        # MySQL and MariaDB have no partial indexes: there ``_mysql`` makes an index of
        # this name on a generated column holding the predicate.
        Index(
            self.key_waits_index, m.topic, m.key, m.seq,
            postgresql_where=may_block, sqlite_where=may_block,
        ).ddl_if(dialect=("postgresql", "sqlite"))  # type: ignore[arg-type]  # a tuple is documented

        self.keys = Table(
            f"{p}outbox_keys", md,
            Column("topic", Name(249), primary_key=True),
            Column("key", Name(255), primary_key=True),
            Column("last_seq", BigInteger, nullable=False),
            schema=s,
        )
        self.leases = Table(
            f"{p}outbox_leases", md,
            Column("shard", Integer, primary_key=True, autoincrement=False),
            Column("owner", Name(200)),
            Column("epoch", BigInteger, nullable=False, default=0),
            Column("expires_at", UTCDateTime, nullable=False),
            # Exactly-once mode: the topics the shard's transactions wrote since its last take-over
            # ended what they may have left open, comma-separated; written before a transaction
            # sends to a topic not named yet, so it outlives a relay killed at any point
            # (``relay._unsettled``). NULL: none.
            Column("unsettled_topics", _LongText),
            schema=s,
        )
        # Settings every process of this database must agree on, and the schema version:
        # one row per name (``schema_version``, ``shard_count``, ``incarnation``), see ``_schema``.
        self.meta = Table(
            f"{p}outbox_meta", md,
            Column("name", String(64), primary_key=True),
            Column("value", String(255), nullable=False),
            schema=s,
        )
        self.relays = Table(
            f"{p}outbox_relays", md,
            Column("worker_id", Name(200), primary_key=True),
            Column("heartbeat_at", UTCDateTime, nullable=False),
            schema=s,
        )

        self.inbox_messages = Table(
            f"{p}inbox_messages", md,
            Column("consumer_group", Name(255), primary_key=True),
            Column("message_id", _MessageId, primary_key=True),
            Column("topic", Name(249), nullable=False),
            Column("key", Name(255)),
            Column("seq", BigInteger),
            Column("kafka_partition", Integer),
            Column("kafka_offset", BigInteger),
            Column("created_at", UTCDateTime),
            Column("received_at", UTCDateTime, nullable=False),
            Column("processed_at", UTCDateTime, nullable=False),
            Column("deliveries", Integer, nullable=False, default=1),
            Column("outcome", String(9), nullable=False, default=InboxOutcome.PROCESSED),
            Column("note", _LongText),
            schema=s,
        )
        self.inbox_keys = Table(
            f"{p}inbox_keys", md,
            Column("consumer_group", Name(255), primary_key=True),
            Column("topic", Name(249), primary_key=True),
            Column("key", Name(255), primary_key=True),
            Column("last_seq", BigInteger, nullable=False, default=0),
            Column("parked", Boolean, nullable=False, default=False),
            Column("parked_reason", _LongText),
            Column("parked_at", UTCDateTime),
            # The seq this group started the key at, when it met the key past seq 1 under the
            # start policy "first_seen"; NULL when the key started at seq 1.
            Column("started_at_seq", BigInteger),
            # The producer database incarnation the key's last applied message came from
            # (NULL: none known yet, or an older producer): tells a rebuilt producer, whose
            # seqs count again, from a conflict (``inbox/_conflicts``).
            Column("incarnation", String(36)),
            schema=s,
        )
        self.inbox_parked = Table(
            f"{p}inbox_parked", md,
            Column("id", _BigId, primary_key=True, autoincrement=True),
            Column("consumer_group", Name(255), nullable=False),
            *_stored_message_columns(),
            Column("reason", String(20), nullable=False),
            Column("error", _LongText),
            Column("traceback", _LongText),
            Column("attempts", Integer, nullable=False, default=0),
            Column("first_failure_at", UTCDateTime, nullable=False),
            Column("last_failure_at", UTCDateTime, nullable=False),
            schema=s,
        )
        Index(
            f"ix_{p}inbox_parked_key",
            self.inbox_parked.c.consumer_group, self.inbox_parked.c.topic,
            self.inbox_parked.c.key, self.inbox_parked.c.seq,
        )
        Index(
            f"ux_{p}inbox_parked_message",
            self.inbox_parked.c.consumer_group, self.inbox_parked.c.message_id, unique=True,
        )
        # Messages that arrived ahead of a gap in their key's seq, waiting for it to fill.
        self.inbox_held = Table(
            f"{p}inbox_held", md,
            Column("consumer_group", Name(255), primary_key=True),
            *_stored_message_columns(id_is_primary_key=True),
            Column("received_at", UTCDateTime, nullable=False),
            UniqueConstraint(
                "consumer_group", "topic", "key", "seq", name=f"ux_{p}inbox_held_seq"
            ),
            schema=s,
        )

        self._check_identifier_lengths()

    def _check_identifier_lengths(self) -> None:
        """Refuse a prefix that makes a table, index or constraint name too long for a database."""
        names: list[str] = [self.seq_trigger_name]
        for table in [*self.outbox_tables, *self.inbox_tables]:
            names.append(table.name)
            names += [str(i.name) for i in table.indexes if i.name]
            names += [str(c.name) for c in table.constraints if isinstance(c.name, str)]
        longest = max(names, key=len)
        if len(longest) > MAX_IDENTIFIER_LENGTH:
            room = len(self.prefix) - (len(longest) - MAX_IDENTIFIER_LENGTH)
            raise ConfigurationError(
                f"table prefix {self.prefix!r} is too long: it makes the name {longest!r} "
                f"{len(longest)} characters, over the {MAX_IDENTIFIER_LENGTH} that PostgreSQL and "
                f"MySQL allow; use at most {room} characters")

    @property
    def key_waits_index(self) -> str:
        """The index of rows that may hold their key back (partial, or on MySQL ``_mysql``'s column)."""
        return f"ix_{self.prefix}outbox_key_waits"

    @property
    def seq_trigger_name(self) -> str:
        """MySQL/MariaDB only: the trigger that numbers a key's messages (``_mysql``)."""
        return f"{self.prefix}outbox_seq"

    @property
    def outbox_tables(self) -> list[Table]:
        return [self.messages, self.keys, self.leases, self.relays, self.meta]

    @property
    def inbox_tables(self) -> list[Table]:
        return [self.inbox_messages, self.inbox_keys, self.inbox_parked, self.inbox_held]

