"""A service's own unit test, without servers: ``OutboxTestHarness`` on SQLite.

The service below places an order (its row and an ``orders`` event in one
transaction) and bills order events through its inbox. The test asserts that
the business call published the event, then runs the billing handler through
the real inbox. Copy the shape into your service's tests:

    pytest examples/orders_unit_test.py
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Inbox, Message, Outbox, create_engine
from outbox.inbox import Disposition
from outbox.testing import OutboxTestHarness

# -- the service ------------------------------------------------------------------

metadata = sa.MetaData()
orders = sa.Table("orders", metadata, sa.Column("id", sa.Integer, primary_key=True),
                  sa.Column("total_cents", sa.Integer, nullable=False))
invoices = sa.Table("invoices", metadata, sa.Column("order_id", sa.Integer, primary_key=True),
                    sa.Column("amount_cents", sa.Integer, nullable=False))


def place_order(outbox: Outbox, order_id: int, total_cents: int) -> None:
    with Session(outbox.engine) as session, session.begin():
        session.execute(orders.insert().values(id=order_id, total_cents=total_cents))
        outbox.publish(session, "orders", {"event": "placed", "order_id": order_id,
                                           "total_cents": total_cents}, key=order_id)


def billing(inbox: Inbox) -> None:
    @inbox.handler("orders")
    def invoice(session: Session, message: Message) -> None:
        event = message.json()
        session.execute(invoices.insert().values(order_id=event["order_id"],
                                                 amount_cents=event["total_cents"]))


# -- its unit test ----------------------------------------------------------------

def test_placing_an_order_publishes_it_and_billing_invoices_it_once(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'service.db'}")
    metadata.create_all(engine)
    outbox, inbox = Outbox(engine), Inbox(engine, group="billing")
    outbox.create_tables()
    inbox.create_tables()
    billing(inbox)

    with OutboxTestHarness(outbox, inbox) as h:
        place_order(outbox, 42, 990)
        assert h.relay() == 1
        [event] = h.published("orders")
        assert (event.key, event.seq) == ("42", 1)
        assert event.json() == {"event": "placed", "order_id": 42, "total_cents": 990}

        assert h.deliver() == [Disposition.APPLIED]
        with engine.connect() as connection:
            assert connection.execute(sa.select(invoices)).all() == [(42, 990)]
