"""A delivery: one consumed record, decoded as far as it can be, on its way through the inbox.

Decoding never raises. A record with CloudEvents ``ce_*`` headers and no outbox
envelope is a CloudEvent from another producer, read as a message
(``_cloudevents``); any other record without an outbox envelope is *foreign*:
read by the group's ``ForeignEnvelope`` (Debezium's event id header,
``_foreign``), handed over unkeyed (``accept``) or parked (``park``), its id
the event id it carries or, lacking one, ``record_identity``: what it is, not
where it sits, so a new record at an offset seen before is a new message. A
record whose envelope is fine but whose payload does not match its content
type is *undecodable*. Foreign and undecodable records become deliveries that
the inbox parks with that reason, so a bad record can never stop the consumer.

The types say what differs. A ``KeyedDelivery`` (keyed, unnumbered: a
CloudEvent or a Debezium event with a key) has a ``lane``: it keeps its key's
arrival order, which is Kafka's partition order, and a failure or a park
holds the rest of its key. An ``OrderedDelivery`` (keyed and numbered: ours)
has a ``seq`` as well and follows its key's seq order. A plain ``Delivery``
(unkeyed, or foreign and parked unread) has neither. ``origin`` says where a delivery
came from (polled, held, parked, handed in) and ``unreadable`` why it is parked
unread; both are fixed when it is built. Only ``attempts`` changes in flight.
On an inbox serving many tenants, ``tenant`` says which one the record names
(``Named``) or that it names none (``Unnamed``); on an inbox of one database it
is None. ``lane_of`` is the one queue a delivery keeps its order in.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime

from transports import Record

from ..core._cloudevents import CloudEventRecordError, cloudevent_to_message, is_cloudevent
from ..core._envelope import BYTES, Message, utcnow
from ..core._foreign import ForeignEnvelope, read_foreign, record_identity, record_time
from ..core._wire import MESSAGE_ID, ForeignRecordError, record_to_message
from ._kinds import ForeignRecords, Reason

ForeignPolicy = ForeignRecords | ForeignEnvelope
"""What becomes of a record without the outbox envelope (``Inbox(foreign_records=…)``)."""


KeyId = tuple[str, str]
"""(topic, key): the unit whose messages apply one at a time, in seq order."""

Position = tuple[tuple[str, int], int]
"""((topic, partition), offset): where a polled record sits in the broker."""

Lane = Hashable
"""A queue in which deliveries keep their order: a ``KeyId``, or one delivery's own."""


class Origin(enum.Enum):
    """Where a delivery came from, which decides what finishing it must also do."""

    CALLER = "caller"
    """Handed in by ``Inbox.handle`` or a test: nobody waits on its offset."""
    POLLED = "polled"
    """Polled by ``Inbox.run``: the offset tracker waits for it to finish (``position``)."""
    HELD = "held"
    """Taken out of ``inbox_held``: its held row is deleted when it is applied or parked."""
    PARKED = "parked"
    """Read from ``inbox_parked`` (listing, replay, discard)."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """Why a delivery is parked unread: its handler is never called."""

    reason: Reason
    """``FOREIGN`` (no outbox envelope) or ``UNDECODABLE`` (payload does not match its content type)."""
    detail: str


@dataclass(frozen=True, slots=True)
class Named:
    """The tenant a record names, on an inbox serving many (served or not: the router decides)."""

    name: str


@dataclass(frozen=True, slots=True)
class Unnamed:
    """A record that names no tenant, on an inbox serving many: it parks in the default database.

    ``why`` says how (no header, ``tenant_of`` returned nothing or raised). It
    does not count in equality: to the scheduler every unnamed record is of one
    tenant, the default database's, so a key's unnamed records keep one order.
    """

    why: str = field(compare=False)


TenantOf = Named | Unnamed
"""Which tenant a delivery is for on an inbox serving many (``Delivery.tenant``)."""


@dataclass(slots=True)
class Attempts:
    """Failed handler attempts of one delivery so far (``RetryLater`` and outages do not count).

    The one part of a delivery that changes while it is in flight: the settle
    stage counts here, and parking stores it.
    """

    count: int = 0
    first_failure_at: datetime | None = None

    def failed(self) -> int:
        """Count one more failure; how many there were."""
        self.count += 1
        if self.first_failure_at is None:
            self.first_failure_at = utcnow()
        return self.count


@dataclass(frozen=True, slots=True, eq=False)
class Delivery:
    """One message in flight, without a key to keep an order in (unkeyed, or foreign and parked unread).

    Build deliveries with ``delivery()``, which gives a keyed message a
    ``KeyedDelivery`` and a keyed, numbered one an ``OrderedDelivery``.
    """

    message: Message
    partition: int | None = None
    offset: int | None = None
    received_at: datetime = field(default_factory=utcnow)
    origin: Origin = Origin.CALLER
    unreadable: Unreadable | None = None
    """Set when it must be parked unread."""
    attempts: Attempts = field(default_factory=Attempts)
    tenant: TenantOf | None = None
    """The tenant it is for on an inbox serving many (``_tenants``); None on an inbox of one database."""

    @property
    def from_held(self) -> bool:
        """Taken out of ``inbox_held``: its held row goes when it is applied or parked."""
        return self.origin is Origin.HELD

    @property
    def position(self) -> Position | None:
        """Its broker position when the offset tracker waits for it (polled by ``Inbox.run``)."""
        if self.origin is not Origin.POLLED or self.partition is None or self.offset is None:
            return None
        return (self.message.topic, self.partition), self.offset


@dataclass(frozen=True, slots=True, eq=False)
class KeyedDelivery(Delivery):
    """A keyed message: applied one at a time in its key's order, parked with its key.

    Without a seq (a CloudEvent, a Debezium event) that order is the order
    of arrival, Kafka's partition order: nothing tells a message missing or
    reordered upstream, but a failure holds the rest of its key, a park parks
    the key, and a replay applies the key's parked messages in arrival order.
    """

    lane: KeyId = field(kw_only=True)
    """(topic, key): the key whose order it keeps and whose parked flag it obeys."""


@dataclass(frozen=True, slots=True, eq=False)
class OrderedDelivery(KeyedDelivery):
    """A keyed, numbered message: subject to its key's seq order as well."""

    seq: int = field(kw_only=True)


def delivery(message: Message, partition: int | None = None, offset: int | None = None,
             received_at: datetime | None = None, *, origin: Origin = Origin.CALLER,
             unreadable: Unreadable | None = None) -> Delivery:
    """A delivery of ``message``: an ``OrderedDelivery`` when it has a key and a seq, a
    ``KeyedDelivery`` when it has a key only.

    A record parked unread as foreign keeps its key for the operator to read, but
    no order: it is parked alone and never replayed.
    """
    received_at = received_at or utcnow()
    key = message.key
    if key is None or (unreadable is not None and unreadable.reason is Reason.FOREIGN):
        return Delivery(message, partition, offset, received_at, origin, unreadable)
    if message.seq is not None:
        return OrderedDelivery(message, partition, offset, received_at, origin, unreadable,
                               lane=(message.topic, key), seq=message.seq)
    return KeyedDelivery(message, partition, offset, received_at, origin, unreadable,
                         lane=(message.topic, key))


def lane_of(d: Delivery) -> Lane:
    """The queue in which ``d`` keeps its order: its key's when it is keyed, else its own.

    The transaction sorts a batch into these (``_runs``) and the settle stage
    keeps a failed message ahead of the rest of its lane.
    """
    return d.lane if isinstance(d, KeyedDelivery) else ("", id(d))


def turn_of(d: Delivery) -> Lane:
    """What the scheduler runs one at a time: ``d``'s (topic, key) when keyed, seq or not; else ``d``.

    Wider than ``lane_of`` by the foreign records parked unread: they keep no
    order, but the scheduler still hands a key's records over one at a time,
    in the order they were submitted. On an inbox serving many tenants the
    tenant is part of it; ``lane_of`` needs no tenant, as one transaction
    serves one.
    """
    key = d.message.key
    turn = (d.message.topic, key) if key is not None else ("", id(d))
    # Tenant A's key "k" and tenant B's key "k" are two keys: each its own order, its own turn.
    return turn if d.tenant is None else (d.tenant, *turn)


def decode(record: Record, *, foreign: ForeignPolicy = ForeignRecords.PARK,
           received_at: datetime | None = None, origin: Origin = Origin.CALLER) -> Delivery:
    """Turn a consumed record into a delivery; never raises."""
    received_at = received_at or utcnow()
    try:
        message = record_to_message(record)
    except ForeignRecordError as exc:
        read = _foreign(record, exc, foreign, received_at, origin)
        if isinstance(read, Delivery):
            return read
        message = read
    if "json" in message.content_type:
        try:
            json.loads(message.payload)
        except ValueError as exc:
            return delivery(message, record.partition, record.offset, received_at, origin=origin,
                            unreadable=Unreadable(Reason.UNDECODABLE,
                                                  f"payload is not valid JSON for content type "
                                                  f"{message.content_type!r}: {exc}"))
    return delivery(message, record.partition, record.offset, received_at, origin=origin)


def _foreign(record: Record, error: ForeignRecordError, foreign: ForeignPolicy, received_at: datetime,
             origin: Origin) -> Message | Delivery:
    """A record our envelope could not read: a CloudEvent, an event of the foreign envelope, or foreign.

    A record with a (broken) ``outbox-message-id`` is ours and broken: parked,
    whatever the policy.
    """
    if any(name.lower() == MESSAGE_ID for name, _ in record.headers or ()):
        return _unread(record, str(error), received_at, origin)
    if is_cloudevent(record.headers):
        return _cloudevent(record, received_at, origin)
    if isinstance(foreign, ForeignEnvelope):
        try:
            return read_foreign(record, foreign)
        except ForeignRecordError as exc:
            return _unread(record, str(exc), received_at, origin)
    if foreign is ForeignRecords.ACCEPT:
        return delivery(_foreign_message(record, key=None), record.partition, record.offset,
                        received_at, origin=origin)
    return _unread(record, str(error), received_at, origin)


def _unread(record: Record, why: str, received_at: datetime, origin: Origin) -> Delivery:
    """``record`` parked unread as foreign, saying ``why``."""
    return delivery(_foreign_message(record, key=_text_key(record)), record.partition, record.offset,
                    received_at, origin=origin, unreadable=Unreadable(Reason.FOREIGN, why))


def _cloudevent(record: Record, received_at: datetime, origin: Origin) -> Message | Delivery:
    """A CloudEvent written by another producer: a message, whatever ``foreign_records`` says.

    One that claims CloudEvents but breaks its rules becomes a delivery parked
    unread as foreign, naming why.
    """
    try:
        return cloudevent_to_message(topic=record.topic, key=record.key, value=record.value,
                                     headers=record.headers)
    except CloudEventRecordError as exc:
        return _unread(record, f"broken CloudEvent: {exc}", received_at, origin)


def _text_key(record: Record) -> str | None:
    """The key of a record we park unread, made storable: UTF-8, no NUL, at most 255 characters."""
    if record.key is None:
        return None
    return record.key.decode("utf-8", "replace").replace("\x00", "\ufffd")[:255] or None


def _foreign_message(record: Record, *, key: str | None) -> Message:
    """A record read as it is: its bytes, its headers as text, the id of what it is."""
    at = record_time(record)
    headers = {}
    for name, raw in record.headers or ():
        headers[name] = raw.decode("utf-8", "replace") if raw is not None else ""
    return Message.model_construct(
        message_id=record_identity(record),
        topic=record.topic, key=key, seq=None,
        payload=record.value if record.value is not None else b"",
        content_type=BYTES, headers=headers, created_at=at, available_at=at,
    )
