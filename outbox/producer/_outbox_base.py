"""What both outbox flavours share: the tables, the settings checked at construction, the input contract.

``Outbox`` (sync sessions) and ``AsyncOutbox`` (``AsyncSession``) differ only
in how they talk to the database; everything a message must satisfy before a
row is written, and the settings stored with the tables, are here, once.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, cast

import pydantic
from sqlalchemy import Connection, CursorResult, Engine, Pool, Result
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ..core import _schema
from ..core._envelope import BYTES, TEXT, new_message_id, serialize_payload, utcnow
from ..core._errors import (
    ConfigurationError,
    InvalidContentTypeError,
    InvalidDelayError,
    InvalidEventTypeError,
    PayloadTooLargeError,
    RecordTooLargeError,
)
from ..core._events import event_type_of, known_event_type
from ..core._notify import notify_payload
from ..core._schema import StoredSchema
from ..core._sharding import shard_for_key
from ..core._tables import MYSQL_FAMILY, OutboxTables
from ..core._tracing import with_current_context
from ..core._validation import (
    checked_event_type,
    checked_headers,
    checked_key,
    shown,
    validate_content_type,
    validate_identifier,
    validate_topic,
)
from ..core._wire import envelope_size, event_type_size, header_size
from ._statements import NOTIFY_PAYLOAD, PublishStatements

Destination = tuple[Pool, str | None]
"""Where a publish's row goes: a database (its engine's pool) and a schema in it (None: the default).

Keyed by the pool, not by what the server says (``_identity``): two engines on
one database each read its settings once, which costs a read and mixes nothing."""
MAX_DESTINATIONS = 100_000
"""Destinations whose settings an outbox keeps at most (tenant schemas of all databases); then it
starts over."""

DEFAULT_MAX_PAYLOAD_BYTES = None
"""No cap on the payload alone: the record limit stored with the tables governs."""
MAX_DELAY = timedelta(days=3650)
"""The longest delay ``publish()`` accepts: ten years, far inside every database's timestamps."""
_MAX_DELAY_SECONDS = MAX_DELAY.total_seconds()


def engine_of(bind: object, owner: str) -> Engine | AsyncEngine:
    """The engine behind ``bind`` (an engine, or a sessionmaker bound to one), or ``ConfigurationError``."""
    if isinstance(bind, Engine | AsyncEngine):
        return bind
    if isinstance(bind, sessionmaker | async_sessionmaker):
        engine = bind.kw.get("bind")
        if not isinstance(engine, Engine | AsyncEngine):
            raise ConfigurationError(f"the sessionmaker given to {owner} has no bind engine")
        return engine
    raise ConfigurationError(f"{owner} needs an Engine, AsyncEngine or (async_)sessionmaker, got {bind!r}")


class OutboxBase:
    """The settings and the input contract of an outbox; see ``Outbox`` for what each setting means."""

    def __init__(
        self,
        engine: Engine | AsyncEngine,
        *,
        tables: OutboxTables | None,
        prefix: str,
        schema: str | None,
        shards: int | None,
        max_payload_bytes: int | None,
        max_record_bytes: int | None,
        notify_channel: str | None,
    ) -> None:
        self.engine = engine
        if tables is not None and (prefix or schema):
            raise ConfigurationError("pass either tables= or prefix=/schema=, not both")
        self.tables = tables or OutboxTables(prefix=prefix, schema=schema)
        self.requested_shards = None if shards is None else _schema.check_shard_count(shards)
        self._destinations: dict[Destination, StoredSchema] = {}  # the settings of each one published to
        if max_payload_bytes is not None and (
                isinstance(max_payload_bytes, bool) or not isinstance(max_payload_bytes, int)
                or max_payload_bytes <= 0):
            raise ConfigurationError(
                f"max_payload_bytes must be a positive int, got {max_payload_bytes!r}"
            )
        self.requested_max_record_bytes = (
            None if max_record_bytes is None else _schema.check_max_record_bytes(max_record_bytes))
        if notify_channel is not None:
            validate_identifier(notify_channel, "notify channel")
        self.max_payload_bytes = max_payload_bytes
        self.notify_channel = notify_channel
        self._sql = PublishStatements(self.tables, self.engine.dialect.name, notify_channel)

    def _write(self, session: Session, row: dict[str, Any], size: int) -> uuid.UUID:
        """Insert a checked ``row`` of record size ``size`` in ``session``'s transaction.

        The tables are where the session's connection sends them: its
        ``schema_translate_map`` (on the engine, the session's bind or the
        connection) may route the outbox's schema to a tenant's, and the session
        may be another engine's, another database's. So the stored settings
        (shard count, record limit) are those of that destination, read on its
        first publish and kept per destination (``_settings_at``); the record limit is
        checked against them. Runs in ``AsyncSession.run_sync`` for the async
        outbox: its statements, one greenlet switch, as one ``execute`` costs.
        """
        conn = session.connection()
        schema = conn.schema_for_object(self.tables.messages)
        stored = self._destinations.get((conn.engine.pool, schema)) or self._settings_at(conn)
        if size > stored.max_record_bytes:
            raise _too_large(row, size, stored.max_record_bytes)
        shard = row["shard"] = shard_for_key(row["key"], stored.shard_count)
        sql = self._sql
        if sql.notify is not None:
            row[NOTIFY_PAYLOAD] = notify_payload(shard, schema)
        if row["key"] is None:
            self._check_routed(session.execute(sql.unkeyed, row), schema)
        elif sql.keyed is not None:  # PostgreSQL (with NOTIFY) and MySQL: one statement
            self._check_routed(session.execute(sql.keyed, row), schema)
        else:
            bumped = session.execute(sql.bump_seq, row)
            self._check_routed(bumped, schema)
            row["seq"] = sql.seq_of(bumped)
            self._check_routed(session.execute(sql.insert_with_seq, row), schema)  # each: a hook maps one
        message_id: uuid.UUID = row["message_id"]
        return message_id

    def _check_routed(self, result: Result[Any], schema: str | None) -> None:
        """Refuse a row a map of that statement alone sent elsewhere than ``schema``.

        A ``schema_translate_map`` added per statement (a ``do_orm_execute``
        hook, say) reaches the statement but not the connection ``_write``
        read the destination from: the row went to one tenant's tables, sharded and
        size-checked by another's settings. The caller's transaction holds it;
        the error makes the caller roll back, as any error of ``publish()``.
        """
        executed = cast(CursorResult[Any], result).context  # Core DML through a Session: a CursorResult
        translate = executed.execution_options.get("schema_translate_map")
        own = self.tables.schema
        went_to = translate.get(own, own) if translate else own
        if went_to != schema:
            raise ConfigurationError(
                f"publish() read the settings of schema {schema!r}, but a schema_translate_map given to "
                f"this statement alone (a do_orm_execute hook, say) sent the row to {went_to!r}: set "
                "the map on the engine (engine.execution_options(schema_translate_map=...)), on the "
                "session's bind or on its connection, and roll this transaction back")

    def _settings_at(self, conn: Connection) -> StoredSchema:
        """The stored settings of the tables ``conn`` reaches, read now and kept for that destination.

        A destination is (database, schema): the engine's pool, one per database
        (``engine.execution_options(...)`` copies share it), and the outbox's
        schema translated by ``conn``'s ``schema_translate_map``. A session of
        another dialect than the outbox's engine would get statements it cannot
        run: refused here, by name.
        """
        dialect = conn.dialect.name
        if dialect != self._sql.dialect and {dialect, self._sql.dialect} != set(MYSQL_FAMILY):
            raise ConfigurationError(
                f"this outbox was made for a {self._sql.dialect} engine and got a session of a "
                f"{dialect} one: make an outbox per kind of database")
        return self._accept(_schema.read(conn, self.tables), self._destination_of(conn))

    def _destination_of(self, bind: Connection | Engine) -> Destination:
        """(pool, schema) of ``bind``: where its statements send the outbox's tables."""
        if isinstance(bind, Connection):
            return bind.engine.pool, bind.schema_for_object(self.tables.messages)
        translate = bind.get_execution_options().get("schema_translate_map") or {}
        schema = self.tables.schema
        return bind.pool, translate.get(schema, schema)

    def _checked_row(
        self,
        topic: str,
        payload: object,
        key: object,
        headers: Mapping[str, str] | None,
        delay: timedelta | float | None,
        declared_type: str | None,
        event_type: str | None = None,
    ) -> tuple[dict[str, Any], int]:
        """The row to insert and its record size, once every part of the message passed the input contract.

        All but the record limit, which is a setting of the tables the row goes
        to (``_write`` checks it): so bad input is refused before any SQL. On
        every publish's path: texts are encoded once, ASCII not at all, and the
        record size is added up from the lengths found on the way.
        """
        topic = validate_topic(topic)  # ASCII by Kafka's rule: its size is its length
        text_key, key_size = checked_key(key)
        user_headers, header_sizes = checked_headers(headers)
        body, content_type = serialize_payload(payload)
        if declared_type is not None:
            declared_type = validate_content_type(declared_type)
            if content_type not in (BYTES, TEXT):
                raise InvalidContentTypeError(
                    f"content_type={declared_type!r} labels bytes or str payloads; a "
                    f"{type(payload).__name__} payload is always sent as {content_type}"
                )
            content_type = declared_type
        event_type, event_type_bytes = _event_type(payload, event_type)
        if self.max_payload_bytes is not None and len(body) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload for topic {topic!r} is {len(body)} bytes, "
                f"over max_payload_bytes={self.max_payload_bytes}"
            )
        row_headers = with_current_context(user_headers)
        if row_headers is not user_headers:  # a trace context was added: count it too
            header_sizes = header_sizes + [(len(name), len(value)) for name, value in row_headers.items()
                                           if name not in user_headers]
        size = len(body) + key_size + envelope_size(content_type) + event_type_size(event_type_bytes)
        for name_size, value_size in header_sizes:
            size += header_size(name_size, value_size)
        now = utcnow()
        return {
            "message_id": new_message_id(),
            "topic": topic,
            "key": text_key,
            "payload": body,
            "content_type": content_type,
            "headers": row_headers,
            "created_at": now,
            "available_at": now + _as_delay(delay),
            "event_type": event_type,
        }, size

    def _accept(self, stored: StoredSchema, destination: Destination) -> StoredSchema:
        """Keep ``stored`` as the settings of ``destination``, once they agree with the ones asked for."""
        _schema.check_same_shards(self.requested_shards, stored.shard_count)
        _schema.check_same_max_record_bytes(self.requested_max_record_bytes, stored.max_record_bytes)
        if len(self._destinations) >= MAX_DESTINATIONS:  # engines made and dropped without end: start again
            self._destinations.clear()
        self._destinations[destination] = stored
        return stored

    def _kept(self, bind: Connection | Engine) -> StoredSchema | None:
        """The settings kept for ``bind``'s destination, or None before its first read."""
        return self._destinations.get(self._destination_of(bind))

    def _forget_settings(self) -> None:
        """Read every destination's settings again (after an upgrade changed them)."""
        self._destinations.clear()


def _too_large(row: dict[str, Any], size: int, limit: int) -> RecordTooLargeError:
    key = row["key"]
    return RecordTooLargeError(
        f"the record for topic {row['topic']!r} would be {size} bytes (payload {len(row['payload'])} "
        f"bytes, key {0 if key is None else len(key.encode())}, {len(row['headers'])} header(s) and "
        f"the envelope), over max_record_bytes={limit}, the limit stored with the tables")


_UNTYPED = frozenset({dict, list, tuple, bytes, str})


def _event_type(payload: object, given: str | None) -> tuple[str | None, int]:
    """The message's event type and its UTF-8 size: a model's registered type, or ``given``.

    ``given`` labels a payload of another kind (a dict, bytes); given with a
    model, it must be the model's own type: two names for one event is a bug.
    """
    kind = type(payload)
    registered = known_event_type(kind)  # a dict hit for a model class published before
    if registered is None and kind not in _UNTYPED and isinstance(payload, pydantic.BaseModel):
        registered = event_type_of(type(payload))  # isinstance against BaseModel's ABC: ~1 µs
    if given is None:
        return (None, 0) if registered is None else checked_event_type(registered)
    text, size = checked_event_type(given)
    if registered is not None and text != registered:
        raise InvalidEventTypeError(
            f"event_type={shown(text)} contradicts the registered type {registered!r} of the "
            f"{kind.__name__} published: leave event_type out for a model, or register the "
            f"name with @outbox.event")
    return text, size


def _as_delay(delay: timedelta | float | None) -> timedelta:
    """``delay`` as a timedelta from 0 to ``MAX_DELAY``, or ``InvalidDelayError``."""
    if delay is None:
        return timedelta(0)
    if isinstance(delay, bool) or not isinstance(delay, timedelta | int | float):
        raise InvalidDelayError(
            f"delay must be a timedelta or seconds, got {type(delay).__name__}"
        )
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
    if seconds < 0:
        raise InvalidDelayError(f"delay must not be negative, got {shown(delay)}")
    if not seconds <= _MAX_DELAY_SECONDS:  # NaN and infinity fail this test too
        raise InvalidDelayError(
            f"delay must be a finite number of seconds up to {MAX_DELAY.days} days, got {shown(delay)}")
    return delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
