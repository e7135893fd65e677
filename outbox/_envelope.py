"""The message envelope: what travels from the outbox table to a consumer."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any, TypeVar

import pydantic
import pydantic_core
import uuid6

from ._errors import UnserializablePayloadError

JSON = "application/json"
BYTES = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def new_message_id() -> uuid.UUID:
    """A UUID version 7: unique, and sortable by creation time."""
    return uuid.UUID(bytes=uuid6.uuid7().bytes)


def utcnow() -> datetime:
    return datetime.now(UTC)


def serialize_payload(payload: object) -> tuple[bytes, str]:
    """Turn a payload into (bytes, content type), or fail naming the culprit.

    Pydantic models and JSON-able values become JSON (datetimes, UUIDs and
    decimals included, through pydantic's encoder); bytes pass through; str is
    sent as UTF-8 text. Anything else fails here, inside ``publish()``.
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), BYTES
    if isinstance(payload, str):
        return payload.encode("utf-8"), TEXT
    if isinstance(payload, pydantic.BaseModel):
        return payload.model_dump_json().encode("utf-8"), JSON
    if isinstance(payload, dict | list | tuple):
        try:
            return pydantic_core.to_json(payload), JSON
        except pydantic_core.PydanticSerializationError as exc:
            raise UnserializablePayloadError(f"payload is not JSON-serialisable: {exc}") from exc
    raise UnserializablePayloadError(
        f"payload must be a pydantic model, dict, list, str or bytes, "
        f"got {type(payload).__name__}: {payload!r:.80}"
    )


class Message(pydantic.BaseModel):
    """One event as the consumer sees it, and as the outbox stored it.

    ``payload`` holds the exact bytes that were sent; ``json()`` and ``parse()``
    decode them. ``seq`` counts 1, 2, 3 … per (topic, key) in commit order and
    is None for unkeyed messages. ``incarnation`` names the outbox database
    that sent it (its ``outbox_meta`` identity): seqs count within one
    incarnation; None on envelopes of releases before it existed.
    """

    model_config = pydantic.ConfigDict(frozen=True)

    message_id: uuid.UUID
    topic: str
    key: str | None = None
    seq: int | None = None
    payload: bytes
    content_type: str = JSON
    headers: dict[str, str] = pydantic.Field(default_factory=dict)
    created_at: datetime
    available_at: datetime
    incarnation: str | None = None

    def json(self) -> Any:  # type: ignore[override]
        """The payload decoded as JSON."""
        return json.loads(self.payload)

    def parse(self, model: type[ModelT]) -> ModelT:
        """The payload validated into a pydantic model."""
        return model.model_validate_json(self.payload)
