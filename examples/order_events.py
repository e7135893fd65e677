"""The events of the orders topic, shared by the producer (fastapi_orders) and a consumer
(faststream_billing): one pydantic model per event, its type name on the wire registered here.

A new optional field needs nothing more; a breaking change gets a new version and an upcaster
(docs/producer.md, "Evolving an event").
"""

from __future__ import annotations

import pydantic

from outbox import event


@event("orders.OrderCreated")
class OrderCreated(pydantic.BaseModel):
    order_id: int
    customer: str
    total_cents: int


@event("orders.OrderPaid")
class OrderPaid(pydantic.BaseModel):
    order_id: int
    total_cents: int
