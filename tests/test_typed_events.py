"""Typed events end to end (issue 29): handlers chosen by event type, the unknown/invalid
policy, per-key order across types, versioned events; SQLite and PostgreSQL, sync and async."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, drain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outbox
from outbox import Disposition, Inbox, Message, Outbox, Relay
from outbox.inbox import Reason
from outbox.testing import OutboxTestHarness
from tests.inbox_support import (
    INBOX_KINDS,
    TEST_BUDGET,
    TOPIC,
    AlertLog,
    applied,
    apply_effect,
    apply_effects,
    business,
    dispose,
    for_inbox,
    inbox_bind,
    insert_effect,
    record,
)


class OrderCreated(pydantic.BaseModel):
    order_id: str


class OrderPaid(pydantic.BaseModel):
    order_id: str
    amount: int


def body(model: pydantic.BaseModel) -> bytes:
    return model.model_dump_json().encode()


def created(key: str, seq: int) -> Any:
    return record(TOPIC, key, seq, payload=body(OrderCreated(order_id=key)), event_type="OrderCreated")


def paid(key: str, seq: int, amount: int = 5) -> Any:
    return record(TOPIC, key, seq, payload=body(OrderPaid(order_id=key, amount=amount)),
                  event_type="OrderPaid")


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """Typed dispatch parks, holds and replays messages with their type: all three databases."""
    return proof_db_url


@pytest.fixture(params=INBOX_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_inbox(engine: sa.Engine, kind: str, **options: Any) -> Inbox:
    # TEST_BUDGET: the tests read a whole transaction's outcome through ``handle`` (a held successor
    # applied right after its predecessor); a loaded CI host's async SQLite transaction outlived the
    # default 1 s ``batch_budget``, which deferred the successor to the next sweep() (a CI run).
    box = Inbox(inbox_bind(engine, kind), group="billing", retry_backoff=0.001, retry_backoff_max=0.01,
                alert=AlertLog(), **{"batch_budget": TEST_BUDGET, **options})
    box.create_tables()
    business.create_all(engine)
    return box


@pytest.fixture
def boxes(engine: sa.Engine) -> Iterator[list[Inbox]]:
    made: list[Inbox] = []
    yield made
    for box in made:
        dispose(box)


def typed(inbox: Inbox, fn: Callable[[Any, Any, Message], None]) -> Any:
    """``fn(session, event, message)`` as ``inbox`` wants a typed handler: as is, or async."""
    if not inbox.is_async:
        return fn

    async def handler(session, event, message):  # type: ignore[no-untyped-def]
        return await session.run_sync(lambda s: fn(s, event, message))

    return handler


def typed_batch(inbox: Inbox, fn: Callable[[Any, Any, list[Message]], None]) -> Any:
    if not inbox.is_async:
        return fn

    async def handler(session, events, messages):  # type: ignore[no-untyped-def]
        return await session.run_sync(lambda s: fn(s, events, messages))

    return handler


def test_each_type_goes_to_its_handler_and_a_keys_types_apply_in_seq_order_through_a_failure(
        engine: sa.Engine, kind: str, boxes: list[Inbox]) -> None:
    """OrderCreated and OrderPaid of one key go to two handlers; the second fails once and is
    retried; everything applies once, in seq order (apply_effect refuses any other order)."""
    inbox = make_inbox(engine, kind)
    boxes.append(inbox)
    seen: list[tuple[str, int]] = []
    failures = [1]

    def on_created(session: Any, event: OrderCreated, message: Message) -> None:
        assert type(event) is OrderCreated and event.order_id == message.key
        seen.append(("created", message.seq or 0))
        apply_effect(session, message)

    def on_paid(session: Any, event: OrderPaid, message: Message) -> None:
        assert type(event) is OrderPaid and event.amount == 5
        if failures:
            failures.pop()
            raise RuntimeError("payment service down")
        seen.append(("paid", message.seq or 0))
        apply_effect(session, message)

    inbox.handler(TOPIC, OrderCreated)(typed(inbox, on_created))
    inbox.handler(TOPIC, OrderPaid)(typed(inbox, on_paid))
    assert inbox.handle(created("o1", 1)) is Disposition.APPLIED
    assert inbox.handle(paid("o1", 3)) is Disposition.HELD  # ahead of seq 2
    assert inbox.handle(paid("o1", 2)) is Disposition.APPLIED  # failed once, retried; seq 3 follows
    assert inbox.handle(created("o1", 4)) is Disposition.APPLIED
    assert applied(engine, "o1") == [("o1", 1), ("o1", 2), ("o1", 3), ("o1", 4)]
    assert seen == [("created", 1), ("paid", 2), ("paid", 3), ("created", 4)]


def test_typed_batch_handlers_keep_a_hot_keys_order_across_types(sqlite_db: str, kind: str) -> None:
    """A batch of one key alternating types: each batch handler gets its consecutive run only."""
    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, kind, batch_size=50)
    calls: list[tuple[str, list[int]]] = []

    def on(name: str) -> Callable[[Any, Any, list[Message]], None]:
        def handler(session: Any, events: list[Any], messages: list[Message]) -> None:
            assert len(events) == len(messages)
            calls.append((name, [m.seq or 0 for m in messages]))
            apply_effects(session, messages)
        return handler

    inbox.batch_handler(TOPIC, OrderCreated)(typed_batch(inbox, on("created")))
    inbox.batch_handler(TOPIC, OrderPaid)(typed_batch(inbox, on("paid")))
    records = [created("k", 1), created("k", 2), paid("k", 3), paid("k", 4), created("k", 5)]
    settled = OutboxTestHarness(inbox=inbox).settle(records)
    assert [d for _, d in settled.done] == [Disposition.APPLIED] * 5
    assert calls == [("created", [1, 2]), ("paid", [3, 4]), ("created", [5])]
    assert applied(engine, "k") == [("k", n) for n in range(1, 6)]
    dispose(inbox)
    engine.dispose()


def test_the_untyped_handler_takes_every_other_type_and_untyped_messages(
        engine: sa.Engine, kind: str, boxes: list[Inbox]) -> None:
    inbox = make_inbox(engine, kind)
    boxes.append(inbox)
    got: list[str] = []

    def on_paid(session: Any, event: OrderPaid, message: Message) -> None:
        got.append("typed")
        apply_effect(session, message)

    def fallback(session: Any, message: Message) -> None:
        got.append(f"untyped {message.event_type}")
        apply_effect(session, message)

    inbox.handler(TOPIC, OrderPaid)(typed(inbox, on_paid))
    inbox.handler(TOPIC)(for_inbox(inbox, fallback))
    inbox.handle(created("a", 1))
    inbox.handle(paid("a", 2))
    inbox.handle(record(TOPIC, "a", 3))
    assert got == ["untyped OrderCreated", "typed", "untyped None"]


def test_an_unknown_type_parks_its_key_by_name_and_replay_applies_it_once_handled(
        engine: sa.Engine, kind: str, boxes: list[Inbox]) -> None:
    inbox = make_inbox(engine, kind)
    boxes.append(inbox)
    inbox.handler(TOPIC, OrderPaid)(typed(inbox, lambda s, e, m: apply_effect(s, m)))
    assert inbox.handle(created("a", 1)) is Disposition.PARKED
    assert inbox.handle(paid("a", 2)) is Disposition.PARKED  # behind its parked key: order holds
    assert inbox.handle(record(TOPIC, "b", 1)) is Disposition.PARKED  # no type, no untyped handler
    parked = {(p.key, p.seq): p for p in inbox.parked()}
    assert parked[("a", 1)].reason == Reason.UNKNOWN_EVENT
    assert "OrderCreated" in (parked[("a", 1)].error or "")
    assert parked[("a", 2)].reason == Reason.KEY_PARKED
    assert parked[("b", 1)].reason == Reason.UNKNOWN_EVENT
    assert "no event type" in (parked[("b", 1)].error or "")
    inbox.handler(TOPIC, OrderCreated)(typed(inbox, lambda s, e, m: apply_effect(s, m)))
    inbox.replay(TOPIC, "a")
    assert applied(engine, "a") == [("a", 1), ("a", 2)]


def test_a_payload_its_model_refuses_parks_with_the_validation_error(
        engine: sa.Engine, kind: str, boxes: list[Inbox]) -> None:
    inbox = make_inbox(engine, kind)
    boxes.append(inbox)
    inbox.handler(TOPIC, OrderPaid)(typed(inbox, lambda s, e, m: apply_effect(s, m)))
    bad = record(TOPIC, "a", 1, payload=b'{"order_id": "a", "amount": "lots"}', event_type="OrderPaid")
    assert inbox.handle(bad) is Disposition.PARKED
    [p] = inbox.parked()
    assert p.reason == Reason.INVALID_EVENT and "amount" in (p.error or "") and "OrderPaid" in (p.error or "")
    assert applied(engine) == []


def test_skip_policy_records_unknown_and_invalid_events_as_skipped_with_why(
        engine: sa.Engine, kind: str, boxes: list[Inbox]) -> None:
    inbox = make_inbox(engine, kind, unknown_event="skip")
    boxes.append(inbox)
    inbox.handler(TOPIC, OrderPaid)(typed(inbox, lambda s, e, m: insert_effect(s, m)))
    assert inbox.handle(created("a", 1)) is Disposition.SKIPPED
    assert inbox.handle(record(TOPIC, "a", 2, payload=b"{}", event_type="OrderPaid")) is Disposition.SKIPPED
    assert inbox.handle(paid("a", 3)) is Disposition.APPLIED  # the key went on past them
    m = inbox.tables.inbox_messages
    with engine.connect() as conn:
        notes = dict(conn.execute(sa.select(m.c.seq, m.c.note).where(m.c.outcome == "skipped")).all())
    assert notes[1].startswith("unknown_event:") and "OrderCreated" in notes[1]
    assert notes[2].startswith("invalid_event:") and "amount" in notes[2]
    assert inbox.parked() == []


def test_a_typed_handler_may_take_the_event_alone(sqlite_db: str) -> None:
    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, "sync")
    got: list[OrderPaid] = []
    inbox.handler(TOPIC, OrderPaid)(lambda session, event: got.append(event))
    inbox.handle(paid("a", 1, amount=7))
    assert got == [OrderPaid(order_id="a", amount=7)]
    engine.dispose()


def test_registration_refuses_two_handlers_for_one_type_and_a_bad_policy(sqlite_db: str) -> None:
    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, "sync")
    inbox.handler(TOPIC, OrderPaid)(lambda s, e: None)
    with pytest.raises(outbox.ConfigurationError, match="one handler per event type"):
        inbox.batch_handler(TOPIC, OrderPaid)(lambda s, e: None)
    with pytest.raises(outbox.ConfigurationError, match="must take"):
        inbox.handler(TOPIC, OrderCreated)(lambda s: None)
    with pytest.raises(outbox.ConfigurationError, match="unknown_event"):
        Inbox(engine, group="g", unknown_event="drop")  # type: ignore[arg-type]
    engine.dispose()


# -- versioned events -----------------------------------------------------------------------
# Three releases of one event. v1 (as a producer of the first release wrote it), v2 adds an
# optional field (no new version: old consumers ignore it), v3 renames a field (a new version,
# with an upcaster from v2) and the type (an alias keeps the old name readable).

class PaidV1(pydantic.BaseModel):
    order_id: str
    amount: int


class PaidV2(pydantic.BaseModel):
    order_id: str
    amount: int
    currency: str = "EUR"


@outbox.event("billing.Paid", version=3, aliases=("PaidV1", "PaidV2"))
class PaidV3(pydantic.BaseModel):
    order_id: str
    cents: int
    currency: str = "EUR"


@outbox.upcaster(PaidV3, from_version=2)
def _v2_to_v3(old: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": old["order_id"], "cents": old["amount"] * 100,
            "currency": old.get("currency", "EUR")}


@outbox.event("billing.Paid", version=2)
class OldBillingPaid(pydantic.BaseModel):
    """How the producer of release two named the event once it registered it."""

    order_id: str
    amount: int


def test_a_new_consumer_reads_what_older_producers_wrote(sqlite_db: str, kind: str) -> None:
    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, kind)
    got: list[PaidV3] = []
    inbox.handler(TOPIC, PaidV3)(typed(inbox, lambda s, e, m: got.append(e)))
    # the renamed type with v1's shape: an alias only renames, so it must carry v3's fields
    inbox.handle(record(TOPIC, "a", 1, payload=body(PaidV3(order_id="a", cents=1)), event_type="PaidV1"))
    inbox.handle(record(TOPIC, "a", 2, payload=body(OldBillingPaid(order_id="a", amount=2)),
                        event_type=outbox.event_type_of(OldBillingPaid)))  # billing.Paid.v2, upcast
    inbox.handle(record(TOPIC, "a", 3, payload=body(PaidV3(order_id="a", cents=300, currency="USD")),
                        event_type="billing.Paid.v3"))
    assert got == [PaidV3(order_id="a", cents=1), PaidV3(order_id="a", cents=200),
                   PaidV3(order_id="a", cents=300, currency="USD")]
    assert outbox.event_type_of(PaidV3) == "billing.Paid.v3"
    dispose(inbox)
    engine.dispose()


def test_an_old_consumer_reads_a_new_payload_with_an_extra_field_and_parks_a_new_version(
        sqlite_db: str) -> None:
    """pydantic ignores fields a model does not declare (its default ``extra='ignore'``)."""
    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, "sync")
    got: list[PaidV1] = []
    inbox.handler(TOPIC, PaidV1)(lambda s, e: got.append(e))
    newer = body(PaidV2(order_id="a", amount=3, currency="USD"))
    assert json.loads(newer)["currency"] == "USD"
    assert inbox.handle(record(TOPIC, "a", 1, payload=newer, event_type="PaidV1")) is Disposition.APPLIED
    assert got == [PaidV1(order_id="a", amount=3)]
    # a breaking change is a new type on the wire: the old consumer parks it, it never misreads it
    v3 = record(TOPIC, "a", 2, payload=body(PaidV3(order_id="a", cents=1)), event_type="billing.Paid.v3")
    assert inbox.handle(v3) is Disposition.PARKED
    assert inbox.parked()[0].reason == Reason.UNKNOWN_EVENT
    engine.dispose()


def test_an_upcaster_must_go_between_versions_the_model_has() -> None:
    with pytest.raises(outbox.ConfigurationError, match="from_version"):
        outbox.upcaster(PaidV3, from_version=3)
    with pytest.raises(outbox.ConfigurationError, match="from_version"):
        outbox.upcaster(PaidV1, from_version=1)  # an unregistered model is version 1


# -- the input domain: any model instance publishes and arrives equal, or is refused by name -----

class Reading(pydantic.BaseModel):
    name: str
    value: float
    values: list[float]
    tags: dict[str, str]
    note: str | None = None


ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=ANY_TEXT, value=ANY_FLOAT, values=st.lists(ANY_FLOAT, max_size=3),
       tags=st.dictionaries(ANY_TEXT, ANY_TEXT, max_size=2), note=st.none() | ANY_TEXT)
def test_any_model_instance_arrives_equal_or_is_refused_at_publish_by_name(
        typed_pipeline: tuple[Outbox, Relay, Inbox, list[Any]], name: str, value: float,
        values: list[float], tags: dict[str, str], note: str | None) -> None:
    ob, relay, inbox, got = typed_pipeline
    sent = Reading.model_construct(name=name, value=value, values=values, tags=tags, note=note)
    try:
        with ob.begin() as session:
            ob.publish(session, TOPIC, sent, key="k")
    except outbox.MessageValidationError as exc:
        assert type(exc) is not outbox.MessageValidationError  # a named subclass says what
        assert any(not math.isfinite(f) for f in [value, *values]) or _has_surrogate(
            [name, note, *tags, *tags.values()])
        return
    relay.transport.sent.clear()
    drain(relay)
    [rec] = relay.transport.sent
    assert inbox.handle(rec) is Disposition.APPLIED
    arrived = got.pop()
    assert arrived == sent and type(arrived) is Reading


def _has_surrogate(texts: list[str | None]) -> bool:
    return any(t is not None and any(0xD800 <= ord(c) <= 0xDFFF for c in t) for t in texts)


@pytest.fixture
def typed_pipeline(sqlite_db: str) -> Iterator[tuple[Outbox, Relay, Inbox, list[Any]]]:
    engine = sa.create_engine(sqlite_db)
    ob = Outbox(engine)
    ob.create_tables()
    inbox = Inbox(engine, group="g")
    got: list[Any] = []
    inbox.handler(TOPIC, Reading)(lambda session, event: got.append(event))
    yield ob, Relay(ob, ScriptedTransport(), worker_id="w"), inbox, got
    engine.dispose()


def test_the_test_harness_sends_models_with_their_type_to_typed_handlers(sqlite_db: str) -> None:
    from outbox.testing import OutboxTestHarness

    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, "sync")
    got: list[Any] = []
    inbox.handler(TOPIC, OrderCreated)(lambda s, e: got.append(e))
    inbox.handler(TOPIC, OrderPaid)(lambda s, e: got.append(e))
    with OutboxTestHarness(inbox=inbox, partitions=1) as h:
        h.send(TOPIC, OrderCreated(order_id="a"), key="a")
        h.send(TOPIC, {"order_id": "a", "amount": 3}, key="a", event_type="OrderPaid")
        assert h.deliver() == [Disposition.APPLIED] * 2
    assert got == [OrderCreated(order_id="a"), OrderPaid(order_id="a", amount=3)]
    engine.dispose()


def test_two_classes_cannot_register_one_event_type_but_one_class_defined_again_can() -> None:
    """A second class under a registered type would be read as the first by its handlers."""
    @outbox.event("shop.Clash", version=2)
    class First(pydantic.BaseModel):
        order_id: str

    with pytest.raises(outbox.ConfigurationError, match=r"'shop.Clash.v2' is already sent by .*First"):
        @outbox.event("shop.Clash", version=2)
        class Second(pydantic.BaseModel):
            amount: int

    assert outbox.event_type_of(First) == "shop.Clash.v2"

    def define() -> type[pydantic.BaseModel]:
        @outbox.event("shop.Defined")
        class Again(pydantic.BaseModel):
            n: int
        return Again

    assert outbox.event_type_of(define()) == outbox.event_type_of(define()) == "shop.Defined"


@outbox.event("billing.Credit", version=2)
class RefundV2(pydantic.BaseModel):
    order_id: str
    cents: int


@outbox.upcaster(RefundV2, from_version=1)
def _refund_v1_to_v2(old: Any) -> dict[str, Any]:
    return {"order_id": old.get("order_id"), "cents": old["amount"] * 100}  # .get: no list has it


@pytest.mark.parametrize("payload", [b'["a", 1]', b'{"order_id": "a"}'])
def test_an_upcaster_that_raises_parks_the_message_as_an_invalid_event_at_once(
        sqlite_db: str, kind: str, payload: bytes) -> None:
    """An upcaster is a function of the payload: whatever it raises it raises again, so no retry."""
    engine = sa.create_engine(sqlite_db)
    inbox = make_inbox(engine, kind, max_attempts=5)
    inbox.handler(TOPIC, RefundV2)(typed(inbox, lambda s, e, m: pytest.fail("handler called")))
    assert inbox.handle(record(TOPIC, "a", 1, payload=payload, event_type="billing.Credit")) \
        is Disposition.PARKED
    [p] = inbox.parked()
    assert p.reason == Reason.INVALID_EVENT and "_refund_v1_to_v2" in (p.error or "")
    assert p.attempts == 1
    dispose(inbox)
    engine.dispose()


def test_an_alias_cannot_name_the_models_own_older_version() -> None:
    """Read as is, an alias ``name.v2`` would bypass the v2 upcaster: old JSON misread or parked."""
    with pytest.raises(outbox.ConfigurationError, match=r"\['shop.Ticket.v2'\].*upcaster"):
        @outbox.event("shop.Ticket", version=3, aliases=("shop.Ticket.v2",))
        class Ticket(pydantic.BaseModel):
            seats: int
