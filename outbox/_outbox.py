"""``Outbox``: write events in the caller's transaction, never commit for it."""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ._envelope import BYTES, TEXT, new_message_id, serialize_payload, utcnow
from ._errors import (
    ConfigurationError,
    InvalidContentTypeError,
    MessageValidationError,
    PayloadTooLargeError,
)
from ._sharding import shard_for_key
from ._statements import PublishStatements
from ._tables import OutboxTables
from ._validation import (
    normalize_key,
    validate_content_type,
    validate_headers,
    validate_identifier,
    validate_topic,
)

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SHARDS = 16
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024


class Outbox:
    """The producer side: ``publish()`` adds an event to the caller's transaction.

    ``bind`` is an ``Engine``, ``AsyncEngine``, ``sessionmaker`` or
    ``async_sessionmaker``; it is used by ``transactional`` to open sessions and
    by ``create_tables``. ``publish`` itself only uses the session it is given.

    ``shards`` splits the outbox among relay processes; it must be the same for
    every publisher and relay of one database. Safe to share between threads.
    """

    def __init__(
        self,
        bind: Engine | AsyncEngine | sessionmaker[Any] | async_sessionmaker[Any],
        *,
        tables: OutboxTables | None = None,
        prefix: str = "",
        schema: str | None = None,
        shards: int = DEFAULT_SHARDS,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
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
        elif self.is_async:
            self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        else:
            self._sessions = sessionmaker(self.engine, expire_on_commit=False)

        if tables is not None and (prefix or schema):
            raise ConfigurationError("pass either tables= or prefix=/schema=, not both")
        self.tables = tables or OutboxTables(prefix=prefix, schema=schema)
        if not isinstance(shards, int) or not 1 <= shards <= 4096:
            raise ConfigurationError(f"shards must be an int from 1 to 4096, got {shards!r}")
        if not isinstance(max_payload_bytes, int) or max_payload_bytes <= 0:
            raise ConfigurationError(
                f"max_payload_bytes must be a positive int, got {max_payload_bytes!r}"
            )
        if notify_channel is not None:
            validate_identifier(notify_channel, "notify channel")
        self.shards = shards
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
        only if, the caller's transaction commits. Invalid input raises a
        ``MessageValidationError`` subclass before any SQL runs. Messages with
        the same ``topic`` and ``key`` get seq 1, 2, 3 … in commit order;
        concurrent writers of one key wait for each other's commit.
        ``content_type`` labels a bytes or str payload (say ``application/avro``);
        other payloads are always JSON.
        """
        if isinstance(session, AsyncSession):
            raise ConfigurationError("publish() got an AsyncSession; use await publish_async()")
        params = self._row(topic, payload, key, headers, delay, content_type)
        if params["key"] is not None and self._sql.keyed is None:
            params["seq"] = session.execute(self._sql.bump_seq, params).scalar_one()
            session.execute(self._sql.insert_with_seq, params)
        else:
            session.execute(self._sql.keyed if params["key"] is not None else self._sql.unkeyed,
                            params)
        return params["message_id"]

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
        params = self._row(topic, payload, key, headers, delay, content_type)
        if params["key"] is not None and self._sql.keyed is None:
            result = await session.execute(self._sql.bump_seq, params)
            params["seq"] = result.scalar_one()
            await session.execute(self._sql.insert_with_seq, params)
        else:
            await session.execute(
                self._sql.keyed if params["key"] is not None else self._sql.unkeyed, params
            )
        return params["message_id"]

    def _row(
        self,
        topic: str,
        payload: object,
        key: object,
        headers: Mapping[str, str] | None,
        delay: timedelta | float | None,
        declared_type: str | None,
    ) -> dict[str, Any]:
        topic = validate_topic(topic)
        text_key = normalize_key(key)
        user_headers = validate_headers(headers)
        body, content_type = serialize_payload(payload)
        if declared_type is not None:
            declared_type = validate_content_type(declared_type)
            if content_type not in (BYTES, TEXT):
                raise InvalidContentTypeError(
                    f"content_type={declared_type!r} labels bytes or str payloads; a "
                    f"{type(payload).__name__} payload is always sent as {content_type}"
                )
            content_type = declared_type
        if len(body) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload for topic {topic!r} is {len(body)} bytes, "
                f"over max_payload_bytes={self.max_payload_bytes}"
            )
        now = utcnow()
        return {
            "message_id": new_message_id(),
            "topic": topic,
            "key": text_key,
            "shard": shard_for_key(text_key, self.shards),
            "payload": body,
            "content_type": content_type,
            "headers": user_headers,
            "created_at": now,
            "available_at": now + _as_delay(delay),
        }

    # -- transactions -------------------------------------------------------

    def transactional(self, fn: F) -> F:
        """Run ``fn`` in a new transaction, passing the session as ``session=``.

        Business rows and outbox rows commit together when ``fn`` returns and
        are rolled back together when it raises (the exception propagates).
        Works on plain and ``async def`` functions. A caller that already has a
        session passes ``session=`` itself: ``fn`` then joins that transaction
        and the decorator neither begins nor commits.
        """
        if "session" not in inspect.signature(fn).parameters:
            raise ConfigurationError(
                f"{fn.__qualname__} must accept a 'session' keyword argument to be transactional"
            )
        if inspect.iscoroutinefunction(fn):
            if not self.is_async:
                raise ConfigurationError(
                    f"{fn.__qualname__} is async but this Outbox has a sync engine"
                )

            @functools.wraps(fn)
            async def run_async(*args: Any, session: AsyncSession | None = None, **kw: Any) -> Any:
                if session is not None:
                    return await fn(*args, session=session, **kw)
                async with self._sessions() as new_session, new_session.begin():
                    return await fn(*args, session=new_session, **kw)

            return run_async  # type: ignore[return-value]

        if self.is_async:
            raise ConfigurationError(f"{fn.__qualname__} is sync but this Outbox has an AsyncEngine")

        @functools.wraps(fn)
        def run(*args: Any, session: Session | None = None, **kw: Any) -> Any:
            if session is not None:
                return fn(*args, session=session, **kw)
            with self._sessions() as new_session, new_session.begin():
                return fn(*args, session=new_session, **kw)

        return run  # type: ignore[return-value]

    # -- schema -------------------------------------------------------------

    def create_tables(self) -> None:
        """Create every outbox and inbox table that does not exist yet (sync engines)."""
        if self.is_async:
            raise ConfigurationError("this Outbox has an AsyncEngine; use await create_tables_async()")
        self.tables.metadata.create_all(self.engine)  # type: ignore[arg-type]

    async def create_tables_async(self) -> None:
        """``create_tables()`` for an ``AsyncEngine``."""
        assert isinstance(self.engine, AsyncEngine)
        async with self.engine.begin() as conn:
            await conn.run_sync(self.tables.metadata.create_all)


def _as_delay(delay: timedelta | float | None) -> timedelta:
    if delay is None:
        return timedelta(0)
    if isinstance(delay, bool) or not isinstance(delay, timedelta | int | float):
        raise MessageValidationError(
            f"delay must be a timedelta or seconds, got {type(delay).__name__}"
        )
    result = delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
    if result < timedelta(0):
        raise MessageValidationError(f"delay must not be negative, got {delay!r}")
    return result
