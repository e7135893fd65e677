"""How an envelope maps to a broker record, and back: defined here and nowhere else.

Record value = the payload bytes; record key = the sharding key in UTF-8;
headers carry the envelope (``outbox-message-id``, ``outbox-seq``,
``content-type``, ``outbox-created-at``, ``outbox-available-at`` when delayed,
``outbox-incarnation``: the identity of the outbox database that sent it, since
the third release; ``outbox-event-type`` when the message has an event type, the
registered name of the model published, since typed events) followed by the
user's headers, which is where W3C ``traceparent`` and ``tracestate`` travel.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from transports import Record

from ._cloudevents import widest_attributes
from ._envelope import Message
from ._errors import OutboxError
from ._validation import MAX_KEY_LENGTH, checked_event_type, validate_content_type

MESSAGE_ID = "outbox-message-id"
SEQ = "outbox-seq"
CONTENT_TYPE = "content-type"
CREATED_AT = "outbox-created-at"
AVAILABLE_AT = "outbox-available-at"
INCARNATION = "outbox-incarnation"
EVENT_TYPE = "outbox-event-type"
ENVELOPE_HEADERS = frozenset({MESSAGE_ID, SEQ, CONTENT_TYPE, CREATED_AT, AVAILABLE_AT, INCARNATION,
                              EVENT_TYPE})
MAX_SEQ = 2**63 - 1  # a BIGINT column

# -- record size, counted as librdkafka counts it for ``message.max.bytes`` ---------------
#
# librdkafka refuses a record at produce() when ``rd_kafka_msg_max_wire_size`` is over
# ``message.max.bytes``: RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD (length 5, attributes 1,
# timestamp delta 10, offset delta 5, key length 5, value length 5, header count 5: the
# widest varints) + key + value + the headers' serialised size, where each header adds
# its name and value and their lengths as zig-zag varints (``rd_kafka_header_add``).
# (The kafka-python transport converts its own count into this one: ``max_record_bytes``.)

RECORD_OVERHEAD = 36


def varint_size(length: int) -> int:
    """Bytes of ``length`` as a zig-zag varint (a non-negative n is encoded as 2n)."""
    return ((length << 1).bit_length() + 6) // 7 or 1


def header_size(name_bytes: int, value_bytes: int) -> int:
    """What one header adds to a record: name, value and both lengths."""
    return name_bytes + value_bytes + varint_size(name_bytes) + varint_size(value_bytes)


def record_size(record: Record) -> int:
    """The size librdkafka checks against ``message.max.bytes`` for ``record``."""
    return (RECORD_OVERHEAD + len(record.value) + (len(record.key) if record.key is not None else 0)
            + sum(header_size(len(name.encode()), len(value) if value is not None else 0)
                  for name, value in record.headers))


INCARNATION_BUDGET = ("outbox-incarnation", 36)  # a UUID's text; the header may not exist yet
# The widest value each envelope header the relay adds can take: a UUID's text, a
# microsecond ISO timestamp with its offset ("2026-11-25T09:16:57.123456+00:00"), a
# BIGINT seq. The content type is added per message, it is known at publish().
_ENVELOPE_WIDEST = ((MESSAGE_ID, 36), (CREATED_AT, 32), (AVAILABLE_AT, 32), (SEQ, 19),
                    INCARNATION_BUDGET)
# A relay in CloudEvents mode (``_cloudevents``) adds the ce_* attributes as well; whether it
# does is the relay's setting, not known at publish(), so every record is counted with them.
ENVELOPE_BUDGET = sum(header_size(len(name), width)
                      for name, width in _ENVELOPE_WIDEST + widest_attributes())
"""Bytes the relay's envelope headers can add to a record, besides ``content-type``."""


def envelope_size(content_type: str) -> int:
    """The most the envelope (every header the relay adds) adds to a record of ``content_type``.

    ``content_type`` is visible ASCII (``validate_content_type``): one byte a character.
    With the per-record overhead, which the envelope's size is counted with.
    """
    return _ENVELOPE_SIZES[len(content_type)]


def event_type_size(event_type_bytes: int) -> int:
    """What the ``outbox-event-type`` header adds to a record, for a type of that many UTF-8
    bytes (0: no type, no header). Like ``content-type``, it is known at publish()."""
    return header_size(len(EVENT_TYPE), event_type_bytes) if event_type_bytes else 0


# By the content type's length (1-100 characters): publish() looks it up, it does not count.
_ENVELOPE_SIZES = [RECORD_OVERHEAD + ENVELOPE_BUDGET + header_size(len(CONTENT_TYPE), length)
                   for length in range(101)]


class ForeignRecordError(OutboxError, ValueError):
    """A record that does not carry an outbox envelope, or carries a broken one."""


def to_record(
    *,
    message_id: uuid.UUID | str,
    topic: str,
    key: str | None,
    seq: int | None,
    payload: bytes,
    content_type: str,
    headers: dict[str, str] | None,
    created_at: datetime,
    available_at: datetime | None = None,
    incarnation: str | None = None,
    event_type: str | None = None,
) -> Record:
    """Build the broker record; the relay calls this per row, so it stays lean.

    ``message_id`` may come as its canonical text (the relay fetches it so).
    ``incarnation`` is the sending database's (``StoredSchema.incarnation``);
    ``event_type`` the row's (None: no ``outbox-event-type`` header).
    """
    wire = [
        (MESSAGE_ID, str(message_id).encode()),
        (CONTENT_TYPE, content_type.encode()),
        (CREATED_AT, created_at.isoformat().encode()),
    ]
    if seq is not None:
        wire.append((SEQ, str(seq).encode()))
    if available_at is not None and available_at != created_at:
        wire.append((AVAILABLE_AT, available_at.isoformat().encode()))
    if incarnation:
        wire.append((INCARNATION, incarnation.encode()))
    if event_type is not None:
        wire.append((EVENT_TYPE, event_type.encode()))
    if headers:
        wire.extend((name, value.encode()) for name, value in headers.items())
    return Record(
        topic=topic,
        key=key.encode() if key is not None else None,
        value=payload,
        headers=wire,
    )


def message_to_record(message: Message) -> Record:
    return to_record(**message.model_dump())


def record_to_message(record: Record) -> Message:
    """Decode a consumed record; raises ``ForeignRecordError`` naming what is missing.

    Envelope headers are known by their name in any case (``Outbox-Seq`` is
    ``outbox-seq``); one that comes twice with two values makes the envelope
    broken, as which one counts would depend on the reader. An envelope header
    without a value (Kafka's null) is one that is not there: Debezium's outbox
    router, sending our table's columns as headers, sends a NULL ``seq`` or
    ``event_type`` so.
    """
    envelope: dict[str, str] = {}
    user: dict[str, str] = {}
    try:
        for name, raw in record.headers or ():
            lowered = name if name in ENVELOPE_HEADERS else name.lower()
            if lowered not in ENVELOPE_HEADERS:
                user[name] = raw.decode() if raw is not None else ""
                continue
            if raw is None:
                continue
            value = raw.decode()
            if envelope.setdefault(lowered, value) != value:
                raise ValueError(f"header {lowered!r} twice with different values")
        if MESSAGE_ID not in envelope:
            raise ForeignRecordError(f"record has no {MESSAGE_ID!r} header: not an outbox message")
        created_at = _instant(envelope[CREATED_AT])
        return Message.model_construct(
            message_id=uuid.UUID(envelope[MESSAGE_ID]),
            topic=record.topic,
            key=_key(record.key),
            seq=_seq(envelope[SEQ]) if SEQ in envelope else None,
            payload=record.value if record.value is not None else b"",
            content_type=validate_content_type(envelope.get(CONTENT_TYPE, "application/octet-stream")),
            headers=user,
            created_at=created_at,
            available_at=_instant(envelope[AVAILABLE_AT]) if AVAILABLE_AT in envelope else created_at,
            incarnation=str(uuid.UUID(envelope[INCARNATION])) if INCARNATION in envelope else None,
            event_type=checked_event_type(envelope[EVENT_TYPE])[0] if EVENT_TYPE in envelope else None,
        )
    except ForeignRecordError:
        raise
    except (KeyError, ValueError, UnicodeDecodeError) as exc:  # InvalidEventTypeError is a ValueError
        raise ForeignRecordError(f"record has a broken outbox envelope: {exc!r}") from exc


# What publish() could never have written is a broken envelope, caught here: stored
# as it is, it would fail the inbox's own INSERT on every redelivery.

def _key(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    key = raw.decode()
    if not key or len(key) > MAX_KEY_LENGTH or "\x00" in key:
        raise ValueError(f"key must be 1-{MAX_KEY_LENGTH} characters without NUL, got {key[:40]!r}")
    return key


def _seq(text: str) -> int:
    seq = int(text)
    if not 1 <= seq <= MAX_SEQ:
        raise ValueError(f"seq {seq} is outside 1..{MAX_SEQ}")
    return seq


def _instant(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    if value.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no UTC offset")
    try:  # stored in UTC: an offset can carry year 1 or 9999 out of datetime's range
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"timestamp {text!r} is out of range once in UTC") from None
