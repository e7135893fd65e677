"""The SQL behind ``publish()``, built once per dialect and cached by SQLAlchemy.

Seq order must equal commit order, so the key's counter is bumped with an
upsert whose row lock is held until the caller commits; the message row is
inserted after it in the same transaction, so within a key id order equals seq
order too. On PostgreSQL the upsert, the insert and the ``pg_notify`` that wakes
relays at commit are one statement (one round trip).

The notification's payload, ``"<shard>"`` or ``"<shard>:<schema>"`` (``_notify``), is
a parameter the caller computes: the schema is the one the connection's
``schema_translate_map`` sends the row to, which only the caller's connection
knows. Every statement here is SQLAlchemy Core on the ``OutboxTables``, so the
translate map routes all of them to the tenant's schema, and their compiled
form is shared by every tenant (SQLAlchemy renders the schema per execution).

On MySQL and MariaDB the insert alone is the statement: a trigger made with the
tables bumps the counter for a keyed row that comes without a seq (``_mysql``).
Elsewhere (SQLite) the upsert returns the seq and the insert follows.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Executable, Insert, Text, bindparam, insert, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Result

from ..core._errors import ConfigurationError
from ..core._notify import notified
from ..core._tables import MYSQL_FAMILY, SUPPORTED_DIALECTS, OutboxStatus, OutboxTables

NOTIFY_PAYLOAD = "notify_payload"
"""The parameter of PostgreSQL's statements that holds the NOTIFY payload (``_notify``)."""

_MESSAGE_PARAMS = (
    "message_id", "topic", "key", "shard", "payload", "content_type", "headers",
    "created_at", "available_at", "event_type",
)


class PublishStatements:
    """Statements for one dialect; ``keyed`` take the seq from the key counter."""

    def __init__(self, tables: OutboxTables, dialect: str, notify_channel: str | None) -> None:
        if dialect not in SUPPORTED_DIALECTS:
            raise ConfigurationError(
                f"unsupported database dialect {dialect!r}; supported: {SUPPORTED_DIALECTS}"
            )
        self.dialect = dialect
        self.notify = notify_channel if dialect == "postgresql" else None
        keys = tables.keys
        upsert = postgresql.insert(keys) if dialect == "postgresql" else sqlite.insert(keys)
        up = upsert.values(topic=bindparam("topic"), key=bindparam("key"), last_seq=1)
        self.bump_seq: Executable = up.on_conflict_do_update(
            index_elements=[keys.c.topic, keys.c.key],
            set_={"last_seq": keys.c.last_seq + 1},
        ).returning(keys.c.last_seq)

        m = tables.messages
        self._row_values: dict[str, Any] = {name: bindparam(name) for name in _MESSAGE_PARAMS}
        self._row_values |= {"attempts": 0, "status": OutboxStatus.PENDING}
        self._messages = m
        self.unkeyed = self._with_notify(insert(m).values(seq=None, **self._row_values))
        self.insert_with_seq: Executable = insert(m).values(seq=bindparam("seq"), **self._row_values)
        if dialect == "postgresql":
            seq = self.bump_seq.cte("next_seq")
            # In INSERT … SELECT the binds don't inherit column types: give them.
            typed = [
                bindparam(name, type_=m.c[name].type) for name in _MESSAGE_PARAMS
            ] + [literal(0, m.c.attempts.type), literal(OutboxStatus.PENDING, m.c.status.type)]
            columns = [*self._row_values, "seq"]
            values = [*typed, seq.c.last_seq]
            self.keyed: Executable | None = self._with_notify(
                insert(m).from_select(columns, select(*values).select_from(seq))
            )
        elif dialect in MYSQL_FAMILY:  # the seq trigger numbers the row
            self.keyed = self.unkeyed
        else:
            self.keyed = None

    def seq_of(self, bumped: Result[Any]) -> int:
        """The seq ``bump_seq`` allotted, from its result."""
        return int(bumped.scalar_one())

    def _with_notify(self, stmt: Insert) -> Executable:
        """``stmt`` and a ``pg_notify`` per inserted row, one statement: the payload is a parameter."""
        if self.notify is None:
            return stmt
        inserted = stmt.returning(self._messages.c.shard).cte("inserted")
        return select(notified(self.notify, bindparam(NOTIFY_PAYLOAD, type_=Text))).select_from(inserted)

