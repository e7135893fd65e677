"""``AsyncOutbox``: the ``Outbox`` of an ``AsyncEngine``; ``await publish()`` in the caller's session."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from ..core import _schema
from ..core._errors import ConfigurationError
from ..core._schema import StoredSchema
from ..core._tables import OutboxTables
from ._outbox_base import DEFAULT_MAX_PAYLOAD_BYTES, OutboxBase, engine_of
from ._transactional import wrap_async

P = ParamSpec("P")
R = TypeVar("R")


async def publish_in(
    outbox: OutboxBase,
    session: AsyncSession,
    topic: str,
    payload: object,
    key: str | int | uuid.UUID | None,
    headers: Mapping[str, str] | None,
    delay: timedelta | float | None,
    content_type: str | None,
    event_type: str | None = None,
) -> uuid.UUID:
    """Add one event to ``session``'s transaction (the statements of ``Outbox.publish``, awaited).

    The input is checked here, in the caller's task; the statements run in
    ``run_sync``, where ``session``'s connection (and so its
    ``schema_translate_map``, its tenant) is at hand without a second switch.
    """
    row, size = outbox._checked_row(topic, payload, key, headers, delay, content_type, event_type)
    return await session.run_sync(outbox._write, row, size)


class AsyncOutbox(OutboxBase):
    """The producer side on an ``AsyncEngine``: ``await publish()`` adds an event to the caller's transaction.

    ``bind`` is an ``AsyncEngine`` or an ``async_sessionmaker``; the settings
    and guarantees are ``Outbox``'s. ``Outbox(async_engine)`` still works (its
    ``publish_async``, ``begin_async`` … are these methods); this class says
    which flavour it is in its type, so a type checker sees ``await``.
    Safe to share between the tasks and threads of one event loop.
    """

    engine: AsyncEngine

    def __init__(
        self,
        bind: AsyncEngine | async_sessionmaker[Any],
        *,
        tables: OutboxTables | None = None,
        prefix: str = "",
        schema: str | None = None,
        shards: int | None = None,
        max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
        max_record_bytes: int | None = None,
        notify_channel: str | None = "outbox",
    ) -> None:
        engine = engine_of(bind, "AsyncOutbox")
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError("AsyncOutbox needs an AsyncEngine or async_sessionmaker; "
                                     "use Outbox for a sync Engine")
        super().__init__(engine, tables=tables, prefix=prefix, schema=schema, shards=shards,
                         max_payload_bytes=max_payload_bytes, max_record_bytes=max_record_bytes,
                         notify_channel=notify_channel)
        self._sessions: async_sessionmaker[Any] = (
            bind if isinstance(bind, async_sessionmaker)
            else async_sessionmaker(engine, expire_on_commit=False))

    async def publish(
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
        """``Outbox.publish`` for an ``AsyncSession``: nothing committed, same guarantees."""
        return await publish_in(self, session, topic, payload, key, headers, delay, content_type,
                                event_type)

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[AsyncSession]:
        """``async with outbox.begin() as session:`` committed when the block ends, rolled back on error."""
        async with self._sessions() as session, session.begin():
            yield session

    @overload
    def transactional(
        self, fn: Callable[Concatenate[AsyncSession, P], Awaitable[R]]) -> Callable[P, Awaitable[R]]: ...

    @overload
    def transactional(self, fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]: ...

    def transactional(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``Outbox.transactional`` for ``async def`` functions: a new transaction (``begin()``) per call."""
        return wrap_async(fn, self.begin, "this outbox has an AsyncEngine")

    async def load_schema(self) -> StoredSchema:
        """The stored schema version and shard count, read on first call and kept (``Outbox.load_schema``).

        Those of the tables the engine reaches (through its ``schema_translate_map``, if any).
        """
        kept = self._kept(self.engine.sync_engine)
        if kept is not None:
            return kept
        async with self.engine.connect() as conn:
            return await conn.run_sync(self._settings_at)

    async def create_tables(self) -> None:
        """``Outbox.create_tables`` on the ``AsyncEngine``."""
        async with self.engine.begin() as conn:
            await conn.run_sync(self._create)

    def _create(self, conn: Connection) -> None:
        self._accept(_schema.create(conn, self.tables, self.requested_shards,
                                    self.requested_max_record_bytes), self._destination_of(conn))
