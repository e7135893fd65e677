"""Records another producer writes: who they are, and the envelope an inbox may read them by.

A record without the outbox envelope carries no id of ours. Two ways give it one:

- **Its own id, in a header** (``ForeignEnvelope``): Debezium's outbox event
  router puts the outbox row's event id in the ``id`` header, the aggregate id
  in the record key, and the type (when placed there) in a header of its own.
  ``read_foreign`` reads such a record into a ``Message`` whose id is that
  event id: the id itself when it is a UUID (in any spelling: ``3E0A…`` and
  ``3e0a…`` are one event), else a UUID5 of its bytes. A redelivered event is
  then a duplicate whatever its offset, and an event our relay sent (its
  ``outbox-message-id`` taken as Debezium's ``id`` column) keeps its id across
  a move from one relay to the other.
- **What it is** (``record_identity``), for a record with no id at all: a
  UUID5 of a SHA-256 over its topic, key, value, headers and timestamp. The
  same stored record read again (a redelivery, a rewound consumer) is the same
  message; a new record at an offset seen before (a topic deleted and created
  again, a move to another cluster) is a new one. What it cannot tell apart
  are two records equal in all of those, timestamps to the millisecond: they
  are one message (docs/consumer.md, "Foreign records").

Header names are matched in any ASCII case (``ID`` is ``id``, ``_validation.folded``):
a header is known by its name, not its spelling. A header the envelope reads that a record carries
twice with two values makes the record unreadable, as readers differ on which
one counts (so would the event's identity).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from transports import Record

from ._cloudevents import CE_SPECVERSION
from ._envelope import BYTES, JSON, Message, utcnow
from ._errors import ConfigurationError
from ._validation import checked_event_type, folded, record_key, validate_content_type
from ._wire import CONTENT_TYPE, ENVELOPE_HEADERS, ForeignRecordError

# Both fixed forever: a redelivery must get the id its first delivery got.
RECORD_NAMESPACE = uuid.UUID("9a3f61d2-4c0e-5b8d-a1f7-0f0e1c2d3b4a")
"""Namespace of ``record_identity``: the UUID5 of a record's contents."""
EVENT_ID_NAMESPACE = uuid.UUID("5d0c9e7b-2a41-5f63-8e19-d6b2c4a8f01e")
"""Namespace of an event id that is not a UUID: the UUID5 of its bytes."""

_HEADER_NAME_MAX = 200


def record_identity(record: Record) -> uuid.UUID:
    """The id of a record that carries none: the same for the same record, read again or elsewhere.

    Every part is written with its length first (None apart from empty), so no
    two different records give one digest; the partition and offset are left
    out, as they say where a record is, not what it is.
    """
    digest = hashlib.sha256()

    def part(data: bytes | None) -> None:
        if data is None:
            digest.update(b"\xff")
        else:
            digest.update(len(data).to_bytes(8, "big"))
            digest.update(data)

    part(record.topic.encode())
    part(record.key)
    part(record.value)
    part(None if record.timestamp_ms is None else str(record.timestamp_ms).encode())
    for name, value in record.headers or ():
        part(name.encode("utf-8", "surrogateescape"))
        part(value)
    return uuid.uuid5(RECORD_NAMESPACE, digest.hexdigest())


# A UUID's spellings, in any case: 8-4-4-4-12 hex digits, in braces, as a URN, or 32 digits.
# Not uuid.UUID's parser alone: it drops hyphens, braces and "urn:"/"uuid:" wherever they
# are, so "----" + 32 digits, another event's id, would be read as that UUID.
_CANONICAL = rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_UUID_SPELLING = re.compile(rb"(?i)" + _CANONICAL + rb"|\{" + _CANONICAL + rb"\}|urn:uuid:" + _CANONICAL
                            + rb"|[0-9a-f]{32}")


def event_id(raw: bytes) -> uuid.UUID:
    """The message id of a foreign event id: the UUID it spells, else a UUID5 of its bytes."""
    if _UUID_SPELLING.fullmatch(raw):
        return uuid.UUID(raw.decode("ascii").lower())  # the shape is checked: the parser reads it right
    return uuid.uuid5(EVENT_ID_NAMESPACE, raw.hex())


@dataclass(frozen=True, slots=True)
class ForeignEnvelope:
    """How an inbox reads records another producer writes: ``Inbox(foreign_records=ForeignEnvelope(…))``.

    ``id_header`` names the header that carries the event id (Debezium's
    outbox event router: ``id``), ``type_header`` the one that carries the
    event type, if any (the router's ``table.fields.additional.placement``,
    e.g. ``type:header:type``); both are matched in any case. The record key
    is the message key. ``content_type`` is what the payload is when the
    record has no ``content-type`` header of its own. A record read this way
    is a message without a seq: identified by its event id (a redelivery is a
    duplicate), applied one at a time per key in partition order, parked with
    its key and replayed like ours. A record without the id header is parked
    as foreign, naming it.
    """

    id_header: str = "id"
    type_header: str | None = None
    content_type: str = BYTES

    def __post_init__(self) -> None:
        _header_name("id_header", self.id_header)
        if self.type_header is not None:
            _header_name("type_header", self.type_header)
            if folded(self.type_header) == folded(self.id_header):
                raise ConfigurationError(f"id_header and type_header are one header "
                                         f"({self.id_header!r}): name two")
        try:
            validate_content_type(self.content_type)
        except ValueError as exc:
            raise ConfigurationError(f"ForeignEnvelope content_type: {exc}") from None

    @classmethod
    def debezium(cls, *, id_header: str = "id", type_header: str | None = "type") -> ForeignEnvelope:
        """Debezium's outbox event router: the event id in ``id``, the type (if placed) in ``type``,
        a JSON payload (the ``payload`` column, ``jsonb``, sent by a ``StringConverter``)."""
        return cls(id_header=id_header, type_header=type_header, content_type=JSON)

    def describe(self) -> str:
        """How this envelope reads a record, for an error message."""
        typed = f", type in {self.type_header!r}" if self.type_header else ""
        return f"ForeignEnvelope(id in {self.id_header!r}{typed})"


def _header_name(field: str, name: object) -> None:
    if (not isinstance(name, str) or not name.strip() or name != name.strip() or not name.isprintable()
            or len(name) > _HEADER_NAME_MAX):
        raise ConfigurationError(f"ForeignEnvelope {field} must be a header name (1-{_HEADER_NAME_MAX} "
                                 f"printable characters), got {name!r:.80}")
    if folded(name) in ENVELOPE_HEADERS:
        raise ConfigurationError(f"ForeignEnvelope {field} {name!r} is an outbox envelope header: "
                                 "records that carry it are read as ours")
    if folded(name) == CE_SPECVERSION:
        raise ConfigurationError(f"ForeignEnvelope {field} {name!r} is CloudEvents' specversion: "
                                 "records that carry it are read as CloudEvents, never by this envelope")


def read_foreign(record: Record, envelope: ForeignEnvelope) -> Message:
    """Read a record without the outbox envelope by ``envelope``; ``ForeignRecordError`` names what is wrong.

    The message keeps every record header but ``content-type`` (the id and type
    headers too, as sent). A tombstone (no value) is a message with an empty
    payload of type ``application/octet-stream``: whatever the envelope says the
    payload is, there is none.
    """
    id_name = folded(envelope.id_header)
    type_name = folded(envelope.type_header) if envelope.type_header is not None else None
    found: dict[str, bytes] = {}
    headers: dict[str, str] = {}
    for name, raw in record.headers or ():
        lowered = folded(name)
        value = raw if raw is not None else b""
        # A type or content-type without a value (Kafka's null) is not there, as in our envelope:
        # the router sends a NULL column so. An id without one is an empty id (no event to read).
        if lowered in (id_name, type_name, CONTENT_TYPE) and (raw is not None or lowered == id_name):
            if found.get(lowered, value) != value:
                raise ForeignRecordError(
                    f"record has the header {name!r} twice with different values: which one is the "
                    f"event's depends on the reader ({envelope.describe()})")
            found[lowered] = value
        if lowered == CONTENT_TYPE:
            continue
        headers[name] = value.decode("utf-8", "replace")
    raw_id = found.get(id_name)
    if raw_id is None:
        raise ForeignRecordError(f"record has no {envelope.id_header!r} header: no event id to read it "
                                 f"by ({envelope.describe()})")
    if not raw_id:
        raise ForeignRecordError(f"record's {envelope.id_header!r} header is empty: no event id to read "
                                 f"it by ({envelope.describe()})")
    fields: dict[str, Any] = {
        "message_id": event_id(raw_id), "topic": record.topic, "key": _key(record.key), "seq": None,
        "payload": record.value if record.value is not None else b"",
        "content_type": _content_type(found.get(CONTENT_TYPE), envelope, record.value is None),
        "headers": headers, "event_type": _event_type(found.get(type_name) if type_name else None),
    }
    fields["created_at"] = fields["available_at"] = record_time(record)
    return Message.model_construct(**fields)


def record_time(record: Record) -> datetime:
    """The record's timestamp (the producer's or the broker's), or now when it has none."""
    if record.timestamp_ms is None:
        return utcnow()
    try:
        return datetime.fromtimestamp(record.timestamp_ms / 1000, UTC)
    except (OverflowError, OSError, ValueError):  # a timestamp past year 9999, or before year 1
        return utcnow()


def _key(raw: bytes | None) -> str | None:
    return record_key(raw, lambda why: ForeignRecordError("" + why))


def _content_type(raw: bytes | None, envelope: ForeignEnvelope, tombstone: bool) -> str:
    if tombstone:
        return BYTES
    if raw is None:
        return envelope.content_type
    try:
        return validate_content_type(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ForeignRecordError(f"record's content-type header: {exc}") from None


def _event_type(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return checked_event_type(raw.decode())[0]
    except (UnicodeDecodeError, ValueError) as exc:  # InvalidEventTypeError is a ValueError
        raise ForeignRecordError(f"record's type header is no event type: {exc}") from None

