"""A delivery as ``inbox_held`` and ``inbox_parked`` store it, and back.

Both tables keep the whole message (its payload, headers and envelope
fields) with where it was read from, so a held or parked message can be
applied later exactly as if it had just arrived.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Row

from ...core._envelope import Message
from .._delivery import Delivery, OrderedDelivery, Origin, delivery


def stored_row(d: Delivery, group: str) -> dict[str, Any]:
    """The columns ``inbox_held`` and ``inbox_parked`` share, for ``d`` of ``group``."""
    msg = d.message
    return {
        "consumer_group": group, "message_id": msg.message_id, "topic": msg.topic,
        "key": msg.key, "seq": msg.seq, "payload": msg.payload,
        "content_type": msg.content_type, "headers": msg.headers,
        "created_at": msg.created_at, "kafka_partition": d.partition,
        "kafka_offset": d.offset, "incarnation": msg.incarnation, "event_type": msg.event_type,
    }


def delivery_from_row(row: Row[Any], received_at: datetime | None, *,
                      origin: Origin = Origin.PARKED) -> Delivery:
    """Rebuild a delivery from an ``inbox_held`` or ``inbox_parked`` row (received now if None).

    ``received_at`` is passed rather than looked up: a row without the
    column (``inbox_parked``) made the lookup raise and catch, per row.
    """
    message = Message.model_construct(
        message_id=row.message_id, topic=row.topic, key=row.key, seq=row.seq,
        payload=row.payload, content_type=row.content_type, headers=row.headers or {},
        created_at=row.created_at, available_at=row.created_at, incarnation=row.incarnation,
        event_type=row.event_type,
    )
    return delivery(message, row.kafka_partition, row.kafka_offset, received_at, origin=origin)


def held_from_row(row: Row[Any]) -> OrderedDelivery:
    """Rebuild a delivery from an ``inbox_held`` row: always keyed and numbered (only those are held)."""
    d = delivery_from_row(row, row.received_at, origin=Origin.HELD)
    if not isinstance(d, OrderedDelivery):
        raise AssertionError(f"inbox_held row {row.message_id} has no key or seq")
    return d
