"""The message envelope: what travels from the outbox table to a consumer."""

from __future__ import annotations

import decimal
import json
import math
import types
import typing
import uuid
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, TypeVar

import pydantic
import pydantic_core
import uuid6

from ._errors import NonStandardJsonError, UnserializablePayloadError

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
    sent as UTF-8 text. Anything else fails here, inside ``publish()``, and so
    does what has no faithful form: a str with a lone surrogate (no UTF-8), and
    JSON that is not standard (``NonStandardJsonError``, see ``standard_json``).
    """
    if isinstance(payload, bytes):
        return bytes(payload), BYTES
    kind = type(payload)  # exact types before BaseModel: isinstance against its ABC metaclass is slow
    if kind is dict or kind is list or kind is tuple:
        return _json(payload, False), JSON
    if isinstance(payload, str):
        try:
            return payload.encode("utf-8"), TEXT
        except UnicodeEncodeError as exc:
            raise UnserializablePayloadError(
                f"str payload is not valid Unicode text: a lone surrogate {payload[exc.start]!r} "
                f"at index {exc.start} has no UTF-8 form") from None
    if isinstance(payload, pydantic.BaseModel):
        return _json(payload, True), JSON
    if isinstance(payload, dict | list | tuple):
        return _json(payload, False), JSON
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload), BYTES
    raise UnserializablePayloadError(
        f"payload must be a pydantic model, dict, list, str or bytes, "
        f"got {type(payload).__name__}: {payload!r:.80}"
    )


def _json(payload: Any, model: bool) -> bytes:
    try:
        body = payload.model_dump_json().encode("utf-8") if model else pydantic_core.to_json(payload)
    except pydantic_core.PydanticSerializationError as exc:
        raise UnserializablePayloadError(f"payload is not JSON-serialisable: {exc}") from exc
    standard_json(body, payload)
    return body


def standard_json(body: bytes, payload: object) -> None:
    """Refuse JSON a consumer would not read back as sent: NaN/Infinity, or a key twice.

    pydantic writes a float NaN or infinity as the non-standard ``NaN`` /
    ``Infinity`` (strict parsers refuse them), or, in a model, as ``null``; and
    ``{1: "a", "1": "b"}`` as an object with the key ``"1"`` twice (a parser
    keeps one value). The fast check parses the body in pydantic's Rust parser
    and writes it again: equal bytes mean no constant and no repeated key. Only
    when they differ does the exact, slower parse say why (or accept). A model's
    NaN turned ``null`` leaves no trace in the body, so when it holds a ``null``
    the payload itself is searched for a float that is not finite.
    """
    try:
        same = pydantic_core.to_json(pydantic_core.from_json(body, allow_inf_nan=False)) == body
    except ValueError:
        same = False
    if not same:
        _strict_parse(body)
    if b"null" in body and (_model_holds_nulled_float(payload) if isinstance(payload, pydantic.BaseModel)
                            else _holds_nulled_float(payload)):
        raise NonStandardJsonError(
            "payload holds a float NaN or infinity, which its model writes as JSON null: "
            "a consumer would read null, not the number; send None, a finite number or a string")


def _strict_parse(body: bytes) -> None:
    def no_constant(name: str) -> None:
        raise NonStandardJsonError(
            f"payload holds a float {name}, which standard JSON cannot express (consumers "
            "refuse it or read another value): send None, a finite number or a string")

    def one_value_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found = dict(pairs)
        if len(found) != len(pairs):
            names = [name for name, _ in pairs]
            twice = next(name for i, name in enumerate(names) if name in names[:i])
            raise NonStandardJsonError(
                f"payload has two keys that both become the JSON key {twice[:40]!r} (say 1 and "
                "'1'): a consumer would see one value, the other lost")
        return found

    try:
        json.loads(body, object_pairs_hook=one_value_per_key, parse_constant=no_constant)
    except RecursionError:
        raise UnserializablePayloadError("payload is nested too deeply to check as JSON") from None
    except NonStandardJsonError:
        raise
    except ValueError as exc:  # an int of over 4,300 digits: Python's reader refuses it
        raise UnserializablePayloadError(
            f"payload cannot be read back as JSON by a consumer (Message.json()): {str(exc)[:120]}"
        ) from None


_LEAVES = frozenset({str, int, bool, type(None), bytes})


def _holds_nulled_float(value: object) -> bool:
    """A float that is not finite, where a model (writing ``null`` for it) keeps it.

    Leaves are recognised by their exact type first and models last: an
    ``isinstance`` against ``BaseModel`` (an ABC's metaclass) costs about a
    microsecond, and this runs on publish's path.
    """
    if type(value) in _LEAVES:
        return False
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_holds_nulled_float(item) for item in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_holds_nulled_float(item) for item in value)
    if isinstance(value, pydantic.BaseModel):
        return _model_holds_nulled_float(value)
    return False


def _model_holds_nulled_float(model: pydantic.BaseModel) -> bool:
    if model.model_config.get("ser_json_inf_nan", "null") != "null":
        return False  # "constants" shows in the body; "strings" is the model's own choice
    decorators = type(model).__pydantic_decorators__
    if (not model.__pydantic_extra__ and not decorators.field_serializers
            and not decorators.model_serializers and _floatless(type(model))):
        return False
    # What the model's own serializers make of its values (a field_serializer may return a NaN),
    # fields, extras and computed fields alike. Serializers declared when_used="json" only
    # are not run in this mode: a NaN only they make is not seen (docs/producer.md).
    return _holds_nulled_float(model.model_dump())


_FLOATLESS: dict[type, bool] = {}
_NO_FLOAT = frozenset({str, int, bool, type(None), bytes, datetime, date, time, timedelta, uuid.UUID,
                       decimal.Decimal})


def _floatless(model: type[pydantic.BaseModel]) -> bool:
    """Whether no field of ``model``, computed ones too, can hold a float (str, int, datetime …).

    Decided once per class (a bounded cache: a service has a handful of models).
    """
    known = _FLOATLESS.get(model)
    if known is None:
        known = (all(_no_float(field.annotation) for field in model.model_fields.values())
                 and all(_no_float(field.return_type) for field in model.model_computed_fields.values()))
        if len(_FLOATLESS) < 1024:
            _FLOATLESS[model] = known
    return known


def _no_float(annotation: Any) -> bool:
    if annotation in _NO_FLOAT:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return all(_no_float(arg) for arg in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _no_float(typing.get_args(annotation)[0])
    return False


class Message(pydantic.BaseModel):
    """One event as the consumer sees it, and as the outbox stored it.

    ``payload`` holds the exact bytes that were sent; ``json()`` and ``parse()``
    decode them. ``seq`` counts 1, 2, 3 … per (topic, key) in commit order and
    is None for unkeyed messages. ``incarnation`` names the outbox database
    that sent it (its ``outbox_meta`` identity): seqs count within one
    incarnation; None on envelopes of releases before it existed.
    ``event_type`` names what the payload is (``publish()`` of a pydantic model
    stores its registered name, ``outbox.event``); None when the producer gave
    none, and on envelopes of releases before typed events.
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
    event_type: str | None = None

    def json(self) -> Any:  # type: ignore[override]
        """The payload decoded as JSON."""
        return json.loads(self.payload)

    def parse(self, model: type[ModelT]) -> ModelT:
        """The payload validated into a pydantic model."""
        return model.model_validate_json(self.payload)
