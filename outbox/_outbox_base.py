"""What both outbox flavours share: the tables, the settings checked at construction, the input contract.

``Outbox`` (sync sessions) and ``AsyncOutbox`` (``AsyncSession``) differ only
in how they talk to the database; everything a message must satisfy before a
row is written, and the settings stored with the tables, are here, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pydantic
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import sessionmaker

from . import _schema
from ._envelope import BYTES, TEXT, new_message_id, serialize_payload, utcnow
from ._errors import (
    ConfigurationError,
    InvalidContentTypeError,
    InvalidDelayError,
    InvalidEventTypeError,
    PayloadTooLargeError,
    RecordTooLargeError,
)
from ._events import event_type_of
from ._schema import StoredSchema
from ._sharding import shard_for_key
from ._statements import PublishStatements
from ._tables import OutboxTables
from ._tracing import with_current_context
from ._validation import (
    checked_event_type,
    checked_headers,
    checked_key,
    shown,
    validate_content_type,
    validate_identifier,
    validate_topic,
)
from ._wire import envelope_size, event_type_size, header_size

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

    def _message(
        self,
        stored: StoredSchema,
        topic: str,
        payload: object,
        key: object,
        headers: Mapping[str, str] | None,
        delay: timedelta | float | None,
        content_type: str | None,
        event_type: str | None = None,
    ) -> dict[str, Any]:
        """The statement parameters of one message: its checked row and its shard."""
        params = self._row(topic, payload, key, headers, delay, content_type, stored.max_record_bytes,
                           event_type)
        params["shard"] = shard_for_key(params["key"], stored.shard_count)
        return params

    def _row(
        self,
        topic: str,
        payload: object,
        key: object,
        headers: Mapping[str, str] | None,
        delay: timedelta | float | None,
        declared_type: str | None,
        max_record_bytes: int,
        event_type: str | None = None,
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
            "event_type": event_type,
        }

    def _accept(self, stored: StoredSchema) -> StoredSchema:
        _schema.check_same_shards(self.requested_shards, stored.shard_count)
        _schema.check_same_max_record_bytes(self.requested_max_record_bytes, stored.max_record_bytes)
        self._stored = stored
        return stored


_UNTYPED = frozenset({dict, list, tuple, bytes, str})


def _event_type(payload: object, given: str | None) -> tuple[str | None, int]:
    """The message's event type and its UTF-8 size: a model's registered type, or ``given``.

    ``given`` labels a payload of another kind (a dict, bytes); given with a
    model, it must be the model's own type: two names for one event is a bug.
    """
    kind = type(payload)
    registered = (None if kind in _UNTYPED or not isinstance(payload, pydantic.BaseModel)
                  else event_type_of(type(payload)))
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
