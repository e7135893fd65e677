"""The orders service: every order emits created -> paid -> shipped, keyed by order id."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .. import Outbox, create_engine

TOPIC = "orders"
EVENTS = ("created", "paid", "shipped")


class OrdersService:
    """Places orders from several threads; each state change is one transaction."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)
        self.outbox = Outbox(self.engine)
        self.orders = sa.Table(
            "orders", self.outbox.tables.metadata,
            sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("customer", sa.String(40), nullable=False),
            sa.Column("total_cents", sa.Integer, nullable=False),
            sa.Column("state", sa.String(10), nullable=False),
        )
        self.outbox.create_tables()
        self.advance = self.outbox.transactional(self._advance)

    def _advance(self, session: Session, order_id: int, event: str) -> None:
        if event == "created":
            session.execute(self.orders.insert().values(
                id=order_id, customer=f"customer-{order_id % 37}",
                total_cents=500 + order_id * 7 % 9000, state="created"))
        else:
            session.execute(self.orders.update().where(self.orders.c.id == order_id)
                            .values(state=event))
        self.outbox.publish(session, TOPIC, {"order_id": order_id, "event": event}, key=order_id)

    def place_all(self, order_ids: list[int], *, threads: int, events_per_second: float,
                  on_event: Callable[[], None]) -> None:
        """Each thread walks its orders step by step, interleaving keys, so events of
        many orders are in flight at once while each order's events stay in sequence.
        The pace is a steady service's, so the relay is killed mid-stream, not after."""
        pause = threads / events_per_second

        def worker(mine: list[int]) -> None:
            rng = random.Random(mine[0] if mine else 0)
            for event in EVENTS:
                rng.shuffle(mine)
                for order_id in mine:
                    self.advance(order_id, event)
                    on_event()
                    time.sleep(pause * rng.uniform(0.5, 1.5))

        chunks = [order_ids[i::threads] for i in range(threads)]
        workers = [threading.Thread(target=worker, args=(c,), name=f"orders-{i}")
                   for i, c in enumerate(chunks)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def counts(self) -> dict[str, int]:
        m = self.outbox.tables.messages
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(m.c.status, sa.func.count()).group_by(m.c.status)).all()
        return dict(rows)
