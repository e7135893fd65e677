"""``Outbox``: write events in the caller's transaction, never commit for it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ..core import _schema
from ..core._errors import ConfigurationError
from ..core._schema import DEFAULT_SHARDS as DEFAULT_SHARDS
from ..core._schema import StoredSchema
from ..core._tables import OutboxTables
from ._async_outbox import AsyncOutbox, publish_in
from ._outbox_base import DEFAULT_MAX_PAYLOAD_BYTES, MAX_DELAY, OutboxBase, engine_of
from ._transactional import wrap_async, wrap_sync

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "DEFAULT_SHARDS", "MAX_DELAY", "Outbox"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", Session, AsyncSession)


class Outbox(OutboxBase):
    """The producer side: ``publish()`` adds an event to the caller's transaction.

    ``bind`` is an ``Engine`` or a ``sessionmaker``; it is used by
    ``transactional`` to open sessions and by ``create_tables``. ``publish``
    itself only uses the session it is given. For an ``AsyncEngine`` use
    ``AsyncOutbox``; ``Outbox(async_engine)`` still works as it did, through
    the ``*_async`` methods below (which are ``AsyncOutbox``'s).

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
        engine = engine_of(bind, "Outbox")
        super().__init__(engine, tables=tables, prefix=prefix, schema=schema, shards=shards,
                         max_payload_bytes=max_payload_bytes, max_record_bytes=max_record_bytes,
                         notify_channel=notify_channel)
        self.engine: Engine | AsyncEngine = engine
        self._async: AsyncOutbox | None = None
        if isinstance(engine, AsyncEngine):  # chosen once: every async call goes to AsyncOutbox
            self._async = AsyncOutbox(bind if isinstance(bind, async_sessionmaker) else engine,
                                      tables=self.tables, shards=shards, max_payload_bytes=max_payload_bytes,
                                      max_record_bytes=max_record_bytes, notify_channel=notify_channel)
        self._sessions: sessionmaker[Any] | None = None  # an AsyncEngine's are AsyncOutbox's
        if isinstance(bind, sessionmaker):
            self._sessions = bind
        elif isinstance(engine, Engine):
            self._sessions = sessionmaker(engine, expire_on_commit=False)

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
        event_type: str | None = None,
    ) -> uuid.UUID:
        """Add one event to ``session``'s transaction and return its message id.

        Nothing is committed: the event becomes visible to the relay when, and
        only if, the caller's transaction commits. Input outside the contract
        (docs/producer.md, "Input contract") raises a ``MessageValidationError``
        subclass naming the field before any SQL, but for the record limit, a
        setting of the tables the row goes to: read on the first publish to
        each schema or database, and kept. The tables are where the session's
        connection sends them: a ``schema_translate_map`` (on the engine, the
        session's bind or the connection) routes them to a tenant's schema, and
        each tenant's stored shard count and record limit apply to its rows
        (docs/tenants.md). Messages with
        the same ``topic`` and ``key`` get seq 1, 2, 3 … in commit order;
        concurrent writers of one key wait for each other's commit.
        ``content_type`` labels a bytes or str payload (say ``application/avro``);
        other payloads are always JSON. A pydantic model is sent with its event
        type (``outbox.event``; its class's name unless registered), which typed
        handlers are chosen by; ``event_type`` gives one to a dict, str or bytes
        payload (docs/producer.md, "Typed events").
        """
        if isinstance(session, AsyncSession):
            raise ConfigurationError(
                "publish() got an AsyncSession; use AsyncOutbox, or await publish_async()")
        return self._write(session, *self._checked_row(topic, payload, key, headers, delay, content_type,
                                                       event_type))

    # -- transactions -------------------------------------------------------

    @contextmanager
    def begin(self) -> Iterator[Session]:
        """A new session in a transaction: committed when the block ends, rolled back on error.

        ``with outbox.begin() as session: outbox.publish(session, …)`` commits
        the business rows and the outbox rows together (sync engines).
        """
        if self._sessions is None:
            raise ConfigurationError("this Outbox has an AsyncEngine; use async with outbox.begin_async() "
                                     "(or AsyncOutbox)")
        with self._sessions() as session, session.begin():
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
        exception propagates). Works on plain functions, and on ``async def`` ones when the
        outbox has an ``AsyncEngine`` (``AsyncOutbox.transactional``). A
        caller that already has a session passes ``session=`` itself: ``fn``
        then joins that transaction and the decorator neither begins nor commits.
        """
        if self._async is not None:
            return wrap_async(fn, self._async.begin, "this Outbox has an AsyncEngine")
        return wrap_sync(fn, self.begin, "this Outbox has a sync engine")

    # -- schema -------------------------------------------------------------

    @property
    def shards(self) -> int:
        """The database's shard count (read once from the meta table; sync engines)."""
        return self.load_schema().shard_count

    def load_schema(self, bind: Engine | Connection | None = None) -> StoredSchema:
        """The stored schema version and shard count, read on first call and kept.

        Those of the tables ``bind`` reaches (default: the engine): its database,
        and the schema its ``schema_translate_map`` gives the tables; each such
        destination is read once. Raises ``SchemaError`` when the tables are missing,
        older than this release or newer, and ``ConfigurationError`` when
        ``shards`` was given and differs from the stored count.
        """
        where = bind if bind is not None else self.engine
        if not isinstance(where, Engine | Connection):
            raise ConfigurationError("this Outbox has an AsyncEngine; await load_schema_async()")
        kept = self._kept(where)
        if kept is not None:
            return kept
        if isinstance(where, Connection):
            return self._settings_at(where)
        with where.connect() as conn:
            return self._settings_at(conn)

    def create_tables(self) -> None:
        """Create the tables that do not exist yet and record the schema version and shard count.

        The shard count is ``shards`` (default 16) on a new database; on an
        existing one a different ``shards`` raises. A given ``max_record_bytes``
        is stored, replacing the old limit (restart the relays, they check it
        against their producer's at start). Tables of an older release
        raise ``SchemaError``: upgrade them with ``upgrade_tables()``.
        """
        if not isinstance(self.engine, Engine):
            raise ConfigurationError("this Outbox has an AsyncEngine; use await create_tables_async()")
        with self.engine.begin() as conn:
            self._accept(_schema.create(conn, self.tables, self.requested_shards,
                                        self.requested_max_record_bytes), self._destination_of(conn))

    def upgrade_tables(self) -> tuple[int, int]:
        """Bring the tables of an older release to this one's schema, in place, without losing a row.

        Returns (version before, version after); a current schema is left as it
        is, missing tables are created. Stop publishers and relays first.
        """
        if not isinstance(self.engine, Engine):
            raise ConfigurationError("upgrade_tables() needs a sync Engine")
        self._forget_settings()
        result = _schema.upgrade(self.engine, self.tables, self.requested_shards,
                                 self.requested_max_record_bytes)
        self.load_schema()
        return result

    # -- an Outbox on an AsyncEngine: the names of earlier releases, now AsyncOutbox's ----------

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
        event_type: str | None = None,
    ) -> uuid.UUID:
        """``publish()`` for an ``AsyncSession``; same guarantees (``AsyncOutbox.publish``)."""
        return await publish_in(self, session, topic, payload, key, headers, delay, content_type,
                                event_type)

    def begin_async(self) -> AbstractAsyncContextManager[AsyncSession]:
        """``begin()`` for an ``AsyncEngine``: ``async with outbox.begin_async() as session:``."""
        return self._async_outbox().begin()

    async def load_schema_async(self) -> StoredSchema:
        """``load_schema()`` for an ``AsyncEngine``."""
        outbox = self._async_outbox()
        kept = self._kept(outbox.engine.sync_engine)
        return kept if kept is not None else self._accept(
            await outbox.load_schema(), self._destination_of(outbox.engine.sync_engine))

    async def create_tables_async(self) -> None:
        """``create_tables()`` for an ``AsyncEngine``."""
        outbox = self._async_outbox()
        await outbox.create_tables()
        self._accept(await outbox.load_schema(), self._destination_of(outbox.engine.sync_engine))

    def _async_outbox(self) -> AsyncOutbox:
        if self._async is None:
            raise ConfigurationError("this Outbox has a sync engine; use with outbox.begin()")
        return self._async
