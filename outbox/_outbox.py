"""``Outbox``: write events in the caller's transaction, never commit for it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from . import _schema
from ._envelope import BYTES, TEXT, new_message_id, serialize_payload, utcnow
from ._errors import (
    ConfigurationError,
    InvalidContentTypeError,
    InvalidDelayError,
    PayloadTooLargeError,
    RecordTooLargeError,
)
from ._schema import DEFAULT_SHARDS as DEFAULT_SHARDS
from ._schema import StoredSchema
from ._sharding import shard_for_key
from ._statements import PublishStatements
from ._tables import OutboxTables
from ._tracing import with_current_context
from ._transactional import wrap
from ._validation import (
    checked_headers,
    checked_key,
    shown,
    validate_content_type,
    validate_identifier,
    validate_topic,
)
from ._wire import envelope_size, header_size

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", Session, AsyncSession)

DEFAULT_MAX_PAYLOAD_BYTES = None
"""No cap on the payload alone: the record limit stored with the tables governs."""
MAX_DELAY = timedelta(days=3650)
"""The longest delay ``publish()`` accepts: ten years, far inside every database's timestamps."""
_MAX_DELAY_SECONDS = MAX_DELAY.total_seconds()


class Outbox:
    """The producer side: ``publish()`` adds an event to the caller's transaction.

    ``bind`` is an ``Engine``, ``AsyncEngine``, ``sessionmaker`` or
    ``async_sessionmaker``; it is used by ``transactional`` to open sessions and
    by ``create_tables``. ``publish`` itself only uses the session it is given.

    The shard count (how the outbox is split among relay processes) is stored
    with the tables and read once, on the first ``publish``; ``shards`` is only
    for ``create_tables`` on a new database, or a check: a different stored
    count raises ``ConfigurationError``. The same holds for ``max_record_bytes``,
    the largest broker record (payload, key, headers and envelope) that
    ``publish()`` accepts and the relays must be able to send: stored with the
    tables (default 1,000,000, what librdkafka and a default broker accept),
    given here only for ``create_tables``, which stores it, or as a check.
    ``max_payload_bytes`` is an optional, tighter cap on the payload alone.
    Safe to share between threads.
    """

    def __init__(
        self,
        bind: Engine | AsyncEngine | sessionmaker[Any] | async_sessionmaker[Any],
        *,
        tables: OutboxTables | None = None,
        prefix: str = "",
        schema: str | None = None,
        shards: int | None = None,
        max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
        max_record_bytes: int | None = None,
        notify_channel: str | None = "outbox",
    ) -> None:
        if isinstance(bind, Engine | AsyncEngine):
            self.engine: Engine | AsyncEngine = bind
        elif isinstance(bind, sessionmaker | async_sessionmaker):
            engine = bind.kw.get("bind")
            if not isinstance(engine, Engine | AsyncEngine):
                raise ConfigurationError("the sessionmaker given to Outbox has no bind engine")
            self.engine = engine
        else:
            raise ConfigurationError(
                f"Outbox needs an Engine, AsyncEngine or (async_)sessionmaker, got {bind!r}"
            )
        self.is_async = isinstance(self.engine, AsyncEngine)
        if isinstance(bind, sessionmaker | async_sessionmaker):
            self._sessions: Any = bind
        elif isinstance(self.engine, AsyncEngine):
            self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        else:
            self._sessions = sessionmaker(self.engine, expire_on_commit=False)

        if tables is not None and (prefix or schema):
            raise ConfigurationError("pass either tables= or prefix=/schema=, not both")
        self.tables = tables or OutboxTables(prefix=prefix, schema=schema)
        self.requested_shards = None if shards is None else _schema.check_shard_count(shards)
        self._stored: StoredSchema | None = None
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

    # -- publishing ---------------------------------------------------------

    def publish(
        self,
        session: Session,
        topic: str,
        payload: object,
        *,
        key: str | int | uuid.UUID | None = None,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
        content_type: str | None = None,
    ) -> uuid.UUID:
        """Add one event to ``session``'s transaction and return its message id.

        Nothing is committed: the event becomes visible to the relay when, and
        only if, the caller's transaction commits. Input outside the contract
        (docs/producer.md, "Input contract") raises a ``MessageValidationError``
        subclass naming the field before any row is written; only the first
        publish of an ``Outbox`` reads the stored settings first. Messages with
        the same ``topic`` and ``key`` get seq 1, 2, 3 … in commit order;
        concurrent writers of one key wait for each other's commit.
        ``content_type`` labels a bytes or str payload (say ``application/avro``);
        other payloads are always JSON.
        """
        if isinstance(session, AsyncSession):
            raise ConfigurationError("publish() got an AsyncSession; use await publish_async()")
        stored = self._stored or self._accept(_schema.read(session.connection(), self.tables))
        params = self._row(topic, payload, key, headers, delay, content_type, stored.max_record_bytes)
        params["shard"] = shard_for_key(params["key"], stored.shard_count)
        if params["key"] is None:
            session.execute(self._sql.unkeyed, params)
        elif self._sql.keyed is not None:  # PostgreSQL (with NOTIFY) and MySQL: one statement
            session.execute(self._sql.keyed, params)
        else:
            params["seq"] = self._sql.seq_of(session.execute(self._sql.bump_seq, params))
            session.execute(self._sql.insert_with_seq, params)
        message_id: uuid.UUID = params["message_id"]
        return message_id

    async def publish_async(
        self,
        session: AsyncSession,
        topic: str,
        payload: object,
        *,
        key: str | int | uuid.UUID | None = None,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
        content_type: str | None = None,
    ) -> uuid.UUID:
        """``publish()`` for an ``AsyncSession``; same guarantees."""
        stored = self._stored or self._accept(
            await session.run_sync(lambda sync: _schema.read(sync.connection(), self.tables)))
        params = self._row(topic, payload, key, headers, delay, content_type, stored.max_record_bytes)
        params["shard"] = shard_for_key(params["key"], stored.shard_count)
        if params["key"] is None:
            await session.execute(self._sql.unkeyed, params)
        elif self._sql.keyed is not None:
            await session.execute(self._sql.keyed, params)
        else:
            params["seq"] = self._sql.seq_of(await session.execute(self._sql.bump_seq, params))
            await session.execute(self._sql.insert_with_seq, params)
        message_id: uuid.UUID = params["message_id"]
        return message_id

    def _row(
        self,
        topic: str,
        payload: object,
        key: object,
        headers: Mapping[str, str] | None,
        delay: timedelta | float | None,
        declared_type: str | None,
        max_record_bytes: int,
    ) -> dict[str, Any]:
        """The row to insert, once every part of the message passed the input contract.

        On every publish's path: texts are encoded once, ASCII not at all, and
        the record size is added up from the lengths found on the way.
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
        if self.max_payload_bytes is not None and len(body) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload for topic {topic!r} is {len(body)} bytes, "
                f"over max_payload_bytes={self.max_payload_bytes}"
            )
        row_headers = with_current_context(user_headers)
        if row_headers is not user_headers:  # a trace context was added: count it too
            header_sizes = header_sizes + [(len(name), len(value)) for name, value in row_headers.items()
                                           if name not in user_headers]
        size = len(body) + key_size + envelope_size(content_type)
        for name_size, value_size in header_sizes:
            size += header_size(name_size, value_size)
        if size > max_record_bytes:
            raise RecordTooLargeError(
                f"the record for topic {topic!r} would be {size} bytes (payload {len(body)} bytes, "
                f"key {key_size}, {len(header_sizes)} header(s) and the envelope), over "
                f"max_record_bytes={max_record_bytes}, the limit stored with the tables"
            )
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
        }

    # -- transactions -------------------------------------------------------

    @contextmanager
    def begin(self) -> Iterator[Session]:
        """A new session in a transaction: committed when the block ends, rolled back on error.

        ``with outbox.begin() as session: outbox.publish(session, …)`` commits
        the business rows and the outbox rows together (sync engines).
        """
        if self.is_async:
            raise ConfigurationError("this Outbox has an AsyncEngine; use async with outbox.begin_async()")
        with self._sessions() as session, session.begin():
            yield session

    @asynccontextmanager
    async def begin_async(self) -> AsyncIterator[AsyncSession]:
        """``begin()`` for an ``AsyncEngine``: ``async with outbox.begin_async() as session:``."""
        if not self.is_async:
            raise ConfigurationError("this Outbox has a sync engine; use with outbox.begin()")
        async with self._sessions() as session, session.begin():
            yield session

    @overload
    def transactional(self, fn: Callable[Concatenate[S, P], R]) -> Callable[P, R]: ...

    @overload
    def transactional(self, fn: Callable[P, R]) -> Callable[P, R]: ...

    def transactional(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Run ``fn`` in a new transaction (``begin()``) and hand it the session.

        ``fn`` takes the session as its first parameter, ``def place(session,
        order)``, and is called without it, ``place(order)``: the signature type
        checkers see. A keyword-only ``session`` (``def place(order, *,
        session)``) works too. Business rows and outbox rows commit together
        when ``fn`` returns and are rolled back together when it raises (the
        exception propagates). Works on plain and ``async def`` functions. A
        caller that already has a session passes ``session=`` itself: ``fn``
        then joins that transaction and the decorator neither begins nor commits.
        """
        return wrap(fn, self.is_async, self.begin, self.begin_async)

    # -- schema -------------------------------------------------------------

    @property
    def shards(self) -> int:
        """The database's shard count (read once from the meta table; sync engines)."""
        return self.load_schema().shard_count

    def load_schema(self, bind: Engine | Connection | None = None) -> StoredSchema:
        """The stored schema version and shard count, read on first call and kept.

        Raises ``SchemaError`` when the tables are missing, older than this
        release or newer, and ``ConfigurationError`` when ``shards`` was given
        and differs from the stored count. ``bind`` defaults to the engine.
        """
        if self._stored is None:
            if isinstance(bind, Connection):
                return self._accept(_schema.read(bind, self.tables))
            engine = bind if bind is not None else self.engine
            if not isinstance(engine, Engine):
                raise ConfigurationError("this Outbox has an AsyncEngine; await load_schema_async()")
            with engine.connect() as conn:
                return self._accept(_schema.read(conn, self.tables))
        return self._stored

    async def load_schema_async(self) -> StoredSchema:
        """``load_schema()`` for an ``AsyncEngine``."""
        if self._stored is None:
            assert isinstance(self.engine, AsyncEngine)
            async with self.engine.connect() as conn:
                return self._accept(await conn.run_sync(_schema.read, self.tables))
        return self._stored

    def _accept(self, stored: StoredSchema) -> StoredSchema:
        _schema.check_same_shards(self.requested_shards, stored.shard_count)
        _schema.check_same_max_record_bytes(self.requested_max_record_bytes, stored.max_record_bytes)
        self._stored = stored
        return stored

    def create_tables(self) -> None:
        """Create the tables that do not exist yet and record the schema version and shard count.

        The shard count is ``shards`` (default 16) on a new database; on an
        existing one a different ``shards`` raises. A given ``max_record_bytes``
        is stored, replacing the old limit (restart the relays, they check it
        against their producer's at start). Tables of an older release
        raise ``SchemaError``: upgrade them with ``upgrade_tables()``.
        """
        if self.is_async:
            raise ConfigurationError("this Outbox has an AsyncEngine; use await create_tables_async()")
        assert isinstance(self.engine, Engine)
        with self.engine.begin() as conn:
            self._accept(_schema.create(conn, self.tables, self.requested_shards,
                                        self.requested_max_record_bytes))

    async def create_tables_async(self) -> None:
        """``create_tables()`` for an ``AsyncEngine``."""
        assert isinstance(self.engine, AsyncEngine)
        async with self.engine.begin() as conn:
            self._accept(await conn.run_sync(_schema.create, self.tables, self.requested_shards,
                                             self.requested_max_record_bytes))

    def upgrade_tables(self) -> tuple[int, int]:
        """Bring the tables of an older release to this one's schema, in place, without losing a row.

        Returns (version before, version after); a current schema is left as it
        is, missing tables are created. Stop publishers and relays first.
        """
        if not isinstance(self.engine, Engine):
            raise ConfigurationError("upgrade_tables() needs a sync Engine")
        self._stored = None
        result = _schema.upgrade(self.engine, self.tables, self.requested_shards,
                                 self.requested_max_record_bytes)
        self.load_schema()
        return result


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
