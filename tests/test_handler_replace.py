"""``Inbox.handler(topic, replace=True)``: a test swaps a topic's handler through the public API.

A second handler of a topic (or of an event type) is refused; with ``replace=True`` it takes the
place of the one it collides with, and only that one: the topic's other handlers stay, and the
registration checks (signature, sync or async) hold all the same.
"""

from __future__ import annotations

from collections.abc import Iterator

import pydantic
import pytest
from sqlalchemy.orm import Session

import outbox
from outbox import ConfigurationError, Disposition, Inbox, Message, create_engine
from outbox.testing import OutboxTestHarness


@outbox.event("shop.Paid", aliases=("Paid",))
class Paid(pydantic.BaseModel):
    amount: int


@pytest.fixture
def inbox(sqlite_db: str) -> Iterator[Inbox]:
    engine = create_engine(sqlite_db)
    box = Inbox(engine, group="replace", retry_backoff=0, max_attempts=1)
    box.create_tables()
    yield box
    engine.dispose()


def test_replace_swaps_the_untyped_handler_and_keeps_the_typed_ones(inbox: Inbox) -> None:
    seen: list[str] = []
    inbox.handler("orders")(lambda session, message: seen.append("first"))
    inbox.handler("orders", Paid)(lambda session, event: seen.append(f"paid {event.amount}"))
    with pytest.raises(ConfigurationError, match="already has a handler"):
        inbox.handler("orders")(lambda session, message: None)
    inbox.batch_handler("orders", replace=True)(lambda session, messages: seen.append("second"))
    with OutboxTestHarness(inbox=inbox) as h:
        h.send("orders", {"n": 1}, key="a")
        h.send("orders", Paid(amount=5), key="a")
        assert h.deliver() == [Disposition.APPLIED, Disposition.APPLIED]
    assert seen == ["second", "paid 5"]


@outbox.event("shop.Paid", version=2)
class PaidInCents(pydantic.BaseModel):
    cents: int


@outbox.upcaster(PaidInCents, from_version=1)
def _to_cents(old: dict[str, object]) -> dict[str, object]:
    amount = old["amount"]
    assert isinstance(amount, int)
    return {"cents": amount * 100}


def test_replace_of_a_typed_handler_displaces_it_under_all_its_types(inbox: Inbox) -> None:
    """The new handler reads ``shop.Paid`` (v1, through the upcaster) and v2, not the old alias
    ``Paid``: the old handler goes under every type it took, so ``Paid`` falls to the untyped one."""
    seen: list[str] = []
    inbox.handler("orders", Paid)(lambda session, event: seen.append("old"))
    inbox.handler("orders")(lambda session, message: seen.append(f"untyped {message.event_type}"))
    with pytest.raises(ConfigurationError, match="event type"):
        inbox.handler("orders", PaidInCents)(lambda session, event: None)
    inbox.handler("orders", PaidInCents, replace=True)(lambda session, event: seen.append(f"{event.cents}c"))
    with OutboxTestHarness(inbox=inbox) as h:
        h.send("orders", {"amount": 5}, key="a", event_type="shop.Paid")
        h.send("orders", {"amount": 6}, key="a", event_type="Paid")
        h.send("orders", PaidInCents(cents=7), key="a")
        assert h.deliver() == [Disposition.APPLIED] * 3
    assert seen == ["500c", "untyped Paid", "7c"]


def test_replace_keeps_the_registration_checks(inbox: Inbox) -> None:
    with pytest.raises(ConfigurationError, match=r"\(session, message\)"):
        inbox.handler("orders", replace=True)(lambda message: None)

    async def handle(session: Session, message: Message) -> None:
        pass

    with pytest.raises(ConfigurationError, match="plain function"):
        inbox.handler("orders", replace=True)(handle)
    assert inbox.topics == []  # nothing was registered by a refused replace


def test_replace_with_nothing_registered_registers(inbox: Inbox) -> None:
    inbox.handler("orders", replace=True)(lambda session, message: None)
    assert inbox.topics == ["orders"]
