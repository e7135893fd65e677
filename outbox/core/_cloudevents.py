"""CloudEvents binary mode (Kafka protocol binding): the envelope as ``ce_*`` headers, and back.

Opt-in on the relay (``Relay(..., cloudevents=CloudEvents(...))`` or
``outbox relay --cloudevents``): each record then carries, besides the
``outbox-*`` envelope that the inbox reads, the CloudEvents 1.0 attributes

======================  ============================================================
``ce_specversion``      ``1.0``
``ce_id``               the message id (UUID text)
``ce_source``           ``CloudEvents.source``: by default ``outbox://<incarnation>``
``ce_type``             the row's event type; the topic when it has none
``ce_time``             ``created_at``, RFC 3339 with its UTC offset
``content-type``        the content type (already sent: ``datacontenttype``)
``ce_outboxseq``        the seq, when the message has one (extension attribute)
``ce_outboxincarnation`` the sending database's identity (extension attribute)
======================  ============================================================

The record key stays the Kafka key (the binding's ``partitionkey``); there is
no ``ce_subject``. The other way, a record with ``ce_*`` headers and no
``outbox-message-id`` is a CloudEvent written by someone else:
``cloudevent_to_message`` decodes it. Its ``ce_id`` need not be a UUID, and
CloudEvents makes (source, id) unique, so the message id is a UUID5 of both:
the same event delivered twice is one message to the inbox's dedup. It has no
seq, so it is never ordered, like any unnumbered message.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ._envelope import BYTES, Message, utcnow
from ._errors import ConfigurationError
from ._validation import checked_event_type, folded, record_key, validate_content_type

SPECVERSION = "1.0"
CE_SPECVERSION = "ce_specversion"
CE_ID = "ce_id"
CE_SOURCE = "ce_source"
CE_TYPE = "ce_type"
CE_TIME = "ce_time"
CE_SEQ = "ce_outboxseq"
CE_INCARNATION = "ce_outboxincarnation"
CE_PREFIX = "ce_"
CE_DATACONTENTTYPE = "ce_datacontenttype"
CE_PARTITIONKEY = "ce_partitionkey"
RELAY_ATTRIBUTES = frozenset({CE_SPECVERSION, CE_ID, CE_SOURCE, CE_TYPE, CE_TIME, CE_SEQ, CE_INCARNATION,
                              CE_DATACONTENTTYPE, CE_PARTITIONKEY})
"""The attributes the relay sets, as ``ce_*`` header names (compared in ASCII lower case,
``folded``): a user header of one of these names is not sent, so no record carries an attribute
twice. ``datacontenttype`` travels as ``content-type`` and ``partitionkey`` as the record key
(the Kafka binding's mapping): an SDK reads a ``ce_datacontenttype`` or ``ce_partitionkey``
header as that attribute too."""

MAX_SOURCE_BYTES = 255
MAX_TYPE_BYTES = 4 * 255
"""The widest ``ce_source`` and ``ce_type`` the record size budget counts (UTF-8 bytes).

``ce_type`` is the event type (at most 255 characters, the ``event_type`` column: 4 bytes
each at most in UTF-8) or the topic (at most 249 ASCII characters)."""

_CONTENT_TYPE = "content-type"  # datacontenttype's header in the Kafka binding (``_wire.CONTENT_TYPE``)

# A URI-reference as a header value: visible ASCII, no space (RFC 3986 characters, unchecked further).
_SOURCE = re.compile(r"[\x21-\x7e]{1,255}")

# (source, id) -> message id: fixed forever, or a redelivered event would be a new message.
CLOUDEVENTS_NAMESPACE = uuid.UUID("6f2a1c8e-0b4d-5e37-9c1a-ce0000000001")

# The widest value of each attribute the relay adds, for the record size budget.
_WIDEST = ((CE_SPECVERSION, len(SPECVERSION)), (CE_ID, 36), (CE_SOURCE, MAX_SOURCE_BYTES),
           (CE_TYPE, MAX_TYPE_BYTES), (CE_TIME, 32), (CE_SEQ, 19), (CE_INCARNATION, 36))


def widest_attributes() -> tuple[tuple[str, int], ...]:
    """(header name, widest value in bytes) of every ``ce_*`` header the relay can add."""
    return _WIDEST


class CloudEventRecordError(ValueError):
    """A record that claims to be a CloudEvent (``ce_specversion``) but is not a valid one."""


@dataclass(frozen=True, slots=True)
class CloudEvents:
    """The relay's CloudEvents binary mode: what ``ce_source`` says.

    ``source`` is a URI-reference of 1-255 visible ASCII characters; None means
    ``outbox://<incarnation>`` (the sending database's identity), which is
    unique per outbox database as the spec asks of a source.
    """

    source: str | None = None

    def __post_init__(self) -> None:
        source = self.source
        if source is not None and (not isinstance(source, str) or not _SOURCE.fullmatch(source)):
            raise ConfigurationError(
                f"CloudEvents source must be a URI-reference of 1-{MAX_SOURCE_BYTES} visible ASCII "
                f"characters without spaces, got {self.source!r:.80}")

    def source_for(self, incarnation: str | None) -> str:
        """``ce_source`` for records of the database ``incarnation``."""
        if self.source is not None:
            return self.source
        return f"outbox://{incarnation or 'unknown'}"


def cloudevent_headers(
    *,
    source: str,
    message_id: uuid.UUID | str,
    topic: str,
    event_type: str | None,
    created_at: datetime,
    seq: int | None,
    incarnation: str | None,
) -> list[tuple[str, bytes]]:
    """The ``ce_*`` headers of one message (``content-type`` travels in the envelope already).

    ``ValueError`` when the event type is wider than the budget publish() counted.
    """
    ce_type = (event_type or topic).encode()
    if len(ce_type) > MAX_TYPE_BYTES:
        raise ValueError(f"event type is {len(ce_type)} bytes in UTF-8, over the {MAX_TYPE_BYTES} "
                         "CloudEvents mode counts in the record size")
    headers = [
        (CE_SPECVERSION, b"1.0"),
        (CE_ID, str(message_id).encode()),
        (CE_SOURCE, source.encode()),
        (CE_TYPE, ce_type),
        (CE_TIME, created_at.isoformat().encode()),
    ]
    if seq is not None:
        headers.append((CE_SEQ, str(seq).encode()))
    if incarnation:
        headers.append((CE_INCARNATION, incarnation.encode()))
    return headers


def is_cloudevent(headers: Iterable[tuple[str, bytes | None]] | None) -> bool:
    """Whether a record's headers claim CloudEvents binary mode (a ``ce_specversion`` header)."""
    return any(folded(name) == CE_SPECVERSION for name, _ in headers or ())


def cloudevent_message_id(source: str, event_id: str) -> uuid.UUID:
    """The message id of the CloudEvent (source, id): stable, so a redelivery is a duplicate.

    The source's length goes first, so that ("a", "bc") and ("ab", "c") differ.
    """
    return uuid.uuid5(CLOUDEVENTS_NAMESPACE, f"{len(source)}:{source}{event_id}")


def cloudevent_to_message(*, topic: str, key: bytes | None, value: bytes | None,
                          headers: Iterable[tuple[str, bytes | None]] | None) -> Message:
    """A CloudEvent in binary mode as a ``Message``; ``CloudEventRecordError`` names what is wrong.

    ``headers`` of the message keep every record header, ``ce_*`` ones included
    (so a handler can read ``ce_id`` and ``ce_source`` as sent). ``event_type``
    is ``ce_type``; ``created_at`` is ``ce_time`` when present, else now.
    """
    found: dict[str, str] = {}
    try:
        for name, raw in headers or ():
            lowered = folded(name)
            attribute = lowered.startswith(CE_PREFIX) or lowered == _CONTENT_TYPE
            # datacontenttype is the content-type header; a ce_ header of its name is that attribute too.
            name = (_CONTENT_TYPE if lowered == CE_DATACONTENTTYPE else lowered) if attribute else name
            text = raw.decode() if raw is not None else ""
            if attribute and found.get(name, text) != text:
                # Which one is the event's? Readers differ (first or last): its id, and so
                # whether a redelivery is a duplicate, would depend on the reader.
                raise CloudEventRecordError(
                    f"CloudEvent has the attribute header {name!r} twice with different values "
                    f"({found[name][:40]!r} and {text[:40]!r})")
            found[name] = text
    except UnicodeDecodeError as exc:
        raise CloudEventRecordError(f"a CloudEvents header is not UTF-8 text: {exc}") from None
    version = found.get(CE_SPECVERSION)
    if version != SPECVERSION:
        raise CloudEventRecordError(f"CloudEvent has specversion {version!r}: only {SPECVERSION!r} is read")
    for required in (CE_ID, CE_SOURCE, CE_TYPE):
        if not found.get(required):
            raise CloudEventRecordError(f"CloudEvent has no {required!r} header (a required attribute)")
    created_at = utcnow()
    if CE_TIME in found:
        try:
            created_at = datetime.fromisoformat(found[CE_TIME])
        except ValueError:
            raise CloudEventRecordError(
                f"ce_time {found[CE_TIME][:40]!r} is not an RFC 3339 timestamp") from None
        if created_at.tzinfo is None:
            raise CloudEventRecordError(f"ce_time {found[CE_TIME][:40]!r} has no UTC offset")
        try:  # stored in UTC: an offset can carry year 1 or 9999 out of datetime's range
            created_at = created_at.astimezone(UTC)
        except OverflowError:
            raise CloudEventRecordError(
                f"ce_time {found[CE_TIME][:40]!r} is out of range once in UTC") from None
    try:  # stored as the message's event type (a 255-character column): what publish() accepts
        event_type = checked_event_type(found[CE_TYPE])[0]
    except ValueError as exc:
        raise CloudEventRecordError(f"ce_type: {exc}") from None
    content_type = found.get(_CONTENT_TYPE, BYTES)
    try:
        content_type = validate_content_type(content_type)
    except ValueError as exc:
        raise CloudEventRecordError(str(exc)) from None
    fields: dict[str, Any] = {
        "message_id": cloudevent_message_id(found[CE_SOURCE], found[CE_ID]),
        "topic": topic, "key": _key(key), "seq": None,
        "payload": value if value is not None else b"",
        "content_type": content_type,
        "headers": {name: text for name, text in found.items() if name != _CONTENT_TYPE},
        "created_at": created_at, "available_at": created_at, "event_type": event_type,
    }
    return Message.model_construct(**fields)


def _key(raw: bytes | None) -> str | None:
    return record_key(raw, lambda why: CloudEventRecordError("CloudEvent's " + why))
