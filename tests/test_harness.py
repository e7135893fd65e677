"""``OutboxTestHarness``: the real relay and inbox on the in-memory broker, in the test's thread."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Inbox, Message, Outbox, create_engine
from outbox.inbox import Disposition
from outbox.testing import InMemoryBroker, OutboxTestHarness
from transports import Outcome

metadata = sa.MetaData()
applied = sa.Table("applied", metadata, sa.Column("n", sa.Integer, primary_key=True),
                   sa.Column("event", sa.String(20), nullable=False))


@pytest.fixture
def engine(sqlite_db: str) -> Iterator[sa.Engine]:
    engine = create_engine(sqlite_db)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def outbox(engine: sa.Engine) -> Outbox:
    outbox = Outbox(engine)
    outbox.create_tables()
    return outbox


@pytest.fixture
def inbox(engine: sa.Engine) -> Inbox:
    inbox = Inbox(engine, group="billing", retry_backoff=0, max_attempts=2)
    inbox.create_tables()

    @inbox.handler("orders")
    def record(session: Session, message: Message) -> None:
        event = message.json()
        if event["event"] == "poison":
            raise ValueError("cannot bill this")
        session.execute(applied.insert().values(n=message.seq, event=event["event"]))

    return inbox


def publish(outbox: Outbox, *events: str, key: str = "order-1") -> None:
    with Session(outbox.engine) as session, session.begin():
        for event in events:
            outbox.publish(session, "orders", {"event": event}, key=key)


def rows(engine: sa.Engine) -> list[tuple[int, str]]:
    with engine.connect() as connection:
        return [tuple(r) for r in connection.execute(sa.select(applied).order_by(applied.c.n))]


def test_what_a_business_call_published_is_asserted_and_handled_once(
    outbox: Outbox, inbox: Inbox, engine: sa.Engine
) -> None:
    with OutboxTestHarness(outbox, inbox) as h:
        publish(outbox, "created", "paid")
        assert h.published("orders") == []  # nothing is on the broker before the relay ran
        assert h.relay() == 2
        assert [(m.key, m.seq, m.json()) for m in h.published("orders")] == [
            ("order-1", 1, {"event": "created"}), ("order-1", 2, {"event": "paid"})]
        assert h.relay() == 0  # published once: the outbox marked them
        assert h.deliver() == [Disposition.APPLIED, Disposition.APPLIED]
        assert h.deliver() == []  # committed: nothing comes again
        assert rows(engine) == [(1, "created"), (2, "paid")]


def test_a_restarted_consumer_gets_what_was_not_committed_and_the_inbox_drops_it(
    outbox: Outbox, inbox: Inbox, engine: sa.Engine
) -> None:
    """The redelivery after a crash between the database commit and the offset commit."""
    with OutboxTestHarness(outbox, inbox) as h:
        publish(outbox, "created", "paid")
        h.relay()
        source = h.source()
        records = source.poll(10, 0)
        assert [inbox.handle(r) for r in records] == [Disposition.APPLIED] * 2
        source.close()  # "crashed" before committing
        assert h.deliver() == [Disposition.DUPLICATE, Disposition.DUPLICATE]
        assert rows(engine) == [(1, "created"), (2, "paid")]


def test_a_retry_is_published_once_in_order_and_an_outage_keeps_events_in_the_outbox(
    outbox: Outbox,
) -> None:
    with OutboxTestHarness(outbox) as h:
        h.transport.fail(topic="orders", key="order-1", times=2)
        publish(outbox, "created", "paid")
        assert h.relay() == 2 and h.transport.injected == 2
        assert [m.seq for m in h.published("orders")] == [1, 2]
        h.transport.down = True
        publish(outbox, "shipped")
        assert h.relay() == 0 and len(h.published("orders")) == 2 and h.transport.injected == 3
        h.transport.down = False  # the relay puts them off by its outage backoff, as in production
        assert h.relay(wait=10) == 1 and [m.seq for m in h.published("orders")] == [1, 2, 3]


def test_a_final_failure_stops_its_key_only(outbox: Outbox) -> None:
    with OutboxTestHarness(outbox) as h:
        h.transport.fail(key="order-1", outcome=Outcome.FAILED)
        publish(outbox, "created", "paid", key="order-1")
        publish(outbox, "created", key="order-2")
        assert h.relay() == 1 and h.transport.injected == 1
        assert [m.key for m in h.published("orders")] == ["order-2"]


def test_a_failing_handler_parks_its_key_and_the_others_flow(inbox: Inbox, engine: sa.Engine) -> None:
    with OutboxTestHarness(inbox=inbox, partitions=1) as h:
        h.send("orders", {"event": "poison"}, key="a")
        h.send("orders", {"event": "paid"}, key="a")
        h.send("orders", {"event": "created"}, key="b")
        assert h.deliver() == [Disposition.PARKED, Disposition.PARKED, Disposition.APPLIED]
        assert rows(engine) == [(1, "created")]


def test_events_sent_out_of_order_are_held_then_applied_in_seq_order(
    inbox: Inbox, engine: sa.Engine
) -> None:
    broker = InMemoryBroker(partitions=1)
    with OutboxTestHarness(inbox=inbox, broker=broker) as h:
        first = h.send("orders", {"event": "created"}, key="k")
        second = h.send("orders", {"event": "paid"}, key="k")
        assert (first.seq, second.seq) == (1, 2)
    # a second service's broker view: the records swapped on the wire
    swapped = InMemoryBroker(partitions=1)
    for record in reversed(broker.records("orders")):
        swapped.append(record.__class__(record.topic, record.value, record.key, list(record.headers)))
    with OutboxTestHarness(inbox=inbox, broker=swapped) as h:
        assert h.deliver() == [Disposition.HELD, Disposition.APPLIED]
        assert rows(engine) == [(1, "created"), (2, "paid")]


def test_misuse_is_named(outbox: Outbox, engine: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match="outbox must be an Outbox"):
        OutboxTestHarness(cast(Any, engine))
    with OutboxTestHarness(outbox) as h, pytest.raises(ConfigurationError, match="with an inbox"):
        h.deliver()
    with OutboxTestHarness(inbox=Inbox(engine, group="g")) as h, pytest.raises(ConfigurationError,
                                                                               match="handler"):
        h.deliver()
    with OutboxTestHarness() as h, pytest.raises(ConfigurationError, match="with an outbox"):
        h.relay()


def test_inbox_run_consumes_an_in_memory_source_and_commits_what_it_finished(
    inbox: Inbox, engine: sa.Engine
) -> None:
    """The running consumer (``Inbox.run``) on ``h.source()``: applied, committed, and stopped in time."""
    import threading
    import time

    with OutboxTestHarness(inbox=inbox) as h:
        for event in ("created", "paid"):
            h.send("orders", {"event": event}, key="k")
        failures: list[BaseException] = []

        def run() -> None:
            try:
                inbox.run(h.source(), install_signal_handlers=False, stop_timeout=5)
            except BaseException as exc:
                failures.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 10
        while len(rows(engine)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        inbox.stop()
        worker.join(10)
        assert not worker.is_alive() and failures == []
        assert rows(engine) == [(1, "created"), (2, "paid")]
        record = h.broker.records("orders")[-1]
        assert record.partition is not None and record.offset is not None
        assert h.broker.committed("billing", "orders", record.partition) == record.offset + 1
        assert h.deliver() == []  # the group's committed offsets are shared with deliver()


def test_settle_runs_one_batch_and_hands_back_what_waits(inbox: Inbox, engine: sa.Engine) -> None:
    """``settle``: one transaction over the batch (a key's run in seq order, a gap held), and the
    poison's retry handed back with its attempt, to be settled again; nothing sleeps."""
    with OutboxTestHarness(inbox=inbox, partitions=1) as h:
        for event in ("created", "paid", "shipped"):
            h.send("orders", {"event": event}, key="k")
        h.send("orders", {"event": "poison"}, key="p")
        h.send("orders", {"event": "late"}, key="p")
        k1, k2, k3, p1, p2 = h.broker.records("orders")
        settled = h.settle([k3, k1, p1, k2, p2])
        assert [(d.message.key, d.message.seq, disposition) for d, disposition in settled.done] == [
            ("k", 1, Disposition.APPLIED), ("k", 2, Disposition.APPLIED), ("k", 3, Disposition.APPLIED)]
        assert [(d.message.key, d.message.seq, d.attempts.count) for d, _ in settled.later] == [
            ("p", 1, 1), ("p", 2, 0)]  # the failure, then its key behind it (not run, not counted)
        assert rows(engine) == [(1, "created"), (2, "paid"), (3, "shipped")]
        again = h.settle([d for d, _ in settled.later])  # max_attempts=2: the second failure parks
        assert [(d.message.seq, disposition) for d, disposition in again.done] == [(1, Disposition.PARKED)]
        assert [(d.message.seq, delay) for d, delay in again.later] == [(2, 0.0)]  # parks behind it
        assert [(d.message.seq, disposition) for d, disposition in
                h.settle([d for d, _ in again.later]).done] == [(2, Disposition.PARKED)]
        assert [p.seq for p in inbox.parked()] == [1, 2]
        h.send("orders", {"event": "first"}, key="gap")
        second = h.send("orders", {"event": "second"}, key="gap")  # a Message: seq 2, ahead of 1
        assert [disposition for _, disposition in h.settle([second]).done] == [Disposition.HELD]
        assert h.broker.committed("billing", "orders", 0) is None  # settle reads and commits nothing


def test_settle_refuses_what_is_not_a_record_message_or_delivery(inbox: Inbox) -> None:
    with OutboxTestHarness(inbox=inbox) as h, pytest.raises(ConfigurationError, match="got dict"):
        h.settle([cast(Any, {"topic": "orders"})])
    with OutboxTestHarness() as h, pytest.raises(ConfigurationError, match="with an inbox"):
        h.settle([])
