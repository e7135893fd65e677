"""A delivery: one consumed record, decoded as far as it can be, on its way through the inbox.

Decoding never raises. A record without an outbox envelope is *foreign*; one
whose envelope is fine but whose payload does not match its content type is
*undecodable*. Both become deliveries that the inbox parks with that reason,
so a bad record can never stop the consumer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from transports import Record

from .._envelope import BYTES, Message, utcnow
from .._wire import MESSAGE_ID, ForeignRecordError, record_to_message
from ._kinds import Reason

# Foreign records have no message id; one derived from their broker position
# makes a redelivery of the same record a duplicate instead of a second row.
_FOREIGN_NAMESPACE = uuid.UUID("0b7e4c3e-6f1d-4a53-9a57-2f7f1bd0c0de")


@dataclass(slots=True, eq=False)
class Delivery:
    """One message in flight; ``problem`` is set when it must be parked unread."""

    message: Message
    partition: int | None = None
    offset: int | None = None
    received_at: datetime = field(default_factory=utcnow)
    problem: Reason | None = None
    """``FOREIGN`` or ``UNDECODABLE``: park with this reason, never call the handler."""
    problem_detail: str | None = None
    from_held: bool = False
    """Taken out of ``inbox_held``; its held row is deleted when it is applied or parked."""
    tracked: bool = False
    """Received from a source whose offset tracker waits for it to finish."""
    attempts: int = 0
    """Failed handler attempts so far (``RetryLater`` and outages do not count)."""
    first_failure_at: datetime | None = None

    @property
    def ordered(self) -> bool:
        """Subject to the key's seq order (keyed and numbered)."""
        return self.message.key is not None and self.message.seq is not None

    @property
    def position(self) -> tuple[tuple[str, int], int] | None:
        """((topic, partition), offset) in the broker, when the record came from a tracked source."""
        if not self.tracked:
            return None
        return (self.message.topic, self.partition), self.offset  # type: ignore[return-value]

    @property
    def lane(self) -> tuple[str, str] | None:
        """Deliveries of one lane are handled one at a time; None means unordered."""
        key = self.message.key
        return (self.message.topic, key) if key is not None else None


def decode(record: Record, *, accept_foreign: bool, received_at: datetime | None = None) -> Delivery:
    """Turn a consumed record into a delivery; never raises."""
    received_at = received_at or utcnow()
    try:
        message = record_to_message(record)
    except ForeignRecordError as exc:
        has_envelope = any(name == MESSAGE_ID for name, _ in record.headers or ())
        if accept_foreign and not has_envelope:
            return Delivery(_foreign_message(record, key=None), record.partition, record.offset,
                            received_at)
        return Delivery(_foreign_message(record, key=_text_key(record)), record.partition,
                        record.offset, received_at, problem=Reason.FOREIGN, problem_detail=str(exc))
    if "json" in message.content_type:
        try:
            json.loads(message.payload)
        except ValueError as exc:
            return Delivery(message, record.partition, record.offset, received_at,
                            problem=Reason.UNDECODABLE,
                            problem_detail=f"payload is not valid JSON for content type "
                                           f"{message.content_type!r}: {exc}")
    return Delivery(message, record.partition, record.offset, received_at)


def _text_key(record: Record) -> str | None:
    """The key of a record we park unread, made storable: UTF-8, no NUL, at most 255 characters."""
    if record.key is None:
        return None
    return record.key.decode("utf-8", "replace").replace("\x00", "\ufffd")[:255] or None


def _foreign_message(record: Record, *, key: str | None) -> Message:
    now = utcnow()
    position = f"{record.topic}/{record.partition}/{record.offset}"
    headers = {}
    for name, raw in record.headers or ():
        headers[name] = raw.decode("utf-8", "replace") if raw is not None else ""
    return Message.model_construct(
        message_id=uuid.uuid5(_FOREIGN_NAMESPACE, position),
        topic=record.topic, key=key, seq=None,
        payload=record.value if record.value is not None else b"",
        content_type=BYTES, headers=headers, created_at=now, available_at=now,
    )
