"""``OutboxTestHarness``: a service's unit tests, through the real relay and inbox, without servers.

The outbox, the relay and the inbox under test are the real ones on the
test's database (SQLite will do); only the broker is replaced, by
``transports.memory``'s in-memory broker, which passes the same conformance
suites as the Kafka transport and source. So "this business call published
that event" is asserted on what the relay really sent, and "this event does
that" by running the service's handlers through the inbox's real
transaction, dedup and ordering.

Everything runs in the calling thread, one step at a time, so a test decides
what happens when (``relay()``, then ``deliver()``); nothing runs in the
background. ``settle(batch)`` is the finest step: one batch through the
inbox's transaction and settle stage, as a worker of ``Inbox.run`` takes it,
with what became of each message and what waits for a retry. What it
cannot show (timeouts, rebalances under load, client settings) is for
integration tests on a real broker.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic
import tenacity

from transports import Record
from transports._errors import ConfigurationError
from transports.memory import DEFAULT_PARTITIONS, InMemoryBroker, InMemorySource, InMemoryTransport

from ..core._envelope import Message, new_message_id, serialize_payload, utcnow
from ..core._events import event_type_of
from ..core._wire import record_to_message, to_record
from ..inbox import Disposition, Inbox
from ..inbox._delivery import Delivery, decode, delivery
from ..inbox._settle import Settled
from ..producer import Outbox
from ..relay import Relay

_IDLE_BATCHES = 50
"""Batches in a row that publish nothing (retries, an outage) before ``relay()`` gives up for now."""
_NOT_DUE_PAUSE = 0.01
"""Seconds between batches while ``relay(wait=...)`` waits for events that are not due yet."""
_WHEEL_TICK = 0.001
"""The harness relay's clock resolution: a retry due at once waits at most this long."""


class OutboxTestHarness:
    """The relay and the inbox of one service on an in-memory broker; a context manager.

    ``outbox`` (its tables created) is what ``relay()`` publishes from;
    ``inbox`` (its tables created, its handlers registered) is what
    ``deliver()`` hands the records to, as its consumer group. Either may be
    None when the service only produces or only consumes. ``broker`` lets
    several harnesses (two services) share one broker; ``partitions`` is the
    partition count of topics created on first use.

    ``transport`` is the relay's ``InMemoryTransport``: ``transport.fail(...)``
    and ``transport.down`` make the relay see retries, final failures and
    outages. Not thread-safe: one test thread drives it.
    """

    def __init__(self, outbox: Outbox | None = None, inbox: Inbox | None = None, *,
                 broker: InMemoryBroker | None = None, partitions: int = DEFAULT_PARTITIONS) -> None:
        if outbox is not None and not isinstance(outbox, Outbox):
            raise ConfigurationError(f"outbox must be an Outbox, got {type(outbox).__name__}")
        if inbox is not None and not isinstance(inbox, Inbox):
            raise ConfigurationError(f"inbox must be an Inbox, got {type(inbox).__name__}")
        self.outbox = outbox
        self.inbox = inbox
        self.broker = broker if broker is not None else InMemoryBroker(partitions=partitions)
        self.transport = InMemoryTransport(self.broker)
        self._relay: Relay | None = None
        self._source: InMemorySource | None = None
        self._incarnation = str(uuid.uuid4())  # of the "other service" that send() speaks for
        self._seqs: dict[tuple[str, str], int] = {}

    # -- producing ------------------------------------------------------------------

    def relay(self, *, wait: float = 0.0) -> int:
        """Publish every event the outbox holds that is due, as the relay does; returns how many.

        Runs the real ``Relay`` (retries due at once) until a batch finds
        nothing due. A record the transport is told to fail is retried at the
        next batch; when 50 batches in a row publish nothing (a key failing on
        every try), it returns with those events still in the outbox, as a
        relay would wait: ``published`` does not show them. A ``FAILED``
        record stops its key, as in production. A broker ``down`` makes the
        relay put its events off by its outage backoff (0.2 s, doubling, as in
        production): with ``wait`` it goes on for up to that many seconds
        until something is published, e.g. ``relay(wait=5)`` after the broker
        is back, or for a ``delay=`` publish that is not due yet.
        """
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise ConfigurationError(f"wait must be non-negative seconds, got {wait!r}")
        relay = self._relay_for_outbox()
        deadline = time.monotonic() + wait
        total = idle = 0
        while True:
            result = relay.run_once()
            total += result.published
            if result.fetched == 0 and result.held == 0:  # nothing due is left
                if total or time.monotonic() >= deadline:
                    break
                time.sleep(_NOT_DUE_PAUSE)
            elif result.published or result.failed:
                idle = 0
            elif (idle := idle + 1) >= _IDLE_BATCHES and time.monotonic() >= deadline:
                break
            else:  # a retry (due at once) or a key waiting for it: the relay's next tick
                time.sleep(relay.wheel.tick)
        return total

    def _relay_for_outbox(self) -> Relay:
        if self.outbox is None:
            raise ConfigurationError("relay() needs the harness built with an outbox")
        if self._relay is None:
            self._relay = Relay(self.outbox, self.transport, worker_id="outbox-test-harness",
                                backoff=tenacity.wait_none(), wheel_tick=_WHEEL_TICK)
        return self._relay

    def published(self, topic: str, *, key: str | None = None) -> list[Message]:
        """The messages on ``topic`` (only ``key``'s, if given), in the order they were written."""
        messages = [record_to_message(r) for r in self.broker.records(topic)]
        return messages if key is None else [m for m in messages if m.key == key]

    def send(self, topic: str, payload: object, *, key: str | int | uuid.UUID | None = None,
             headers: Mapping[str, str] | None = None, event_type: str | None = None) -> Message:
        """Put an event on the broker as another service's outbox would; returns it.

        For a service that only consumes: its inbox then receives it at
        ``deliver()``. A keyed event gets the key's next seq (1, 2, 3 …). A
        pydantic model is sent with its event type, as ``publish()`` sends it
        (typed handlers are chosen by it); ``event_type`` gives one to another payload.
        """
        body, content_type = serialize_payload(payload)
        if event_type is None and isinstance(payload, pydantic.BaseModel):
            event_type = event_type_of(type(payload))
        text_key = None if key is None else str(key)
        seq = None
        if text_key is not None:
            seq = self._seqs[(topic, text_key)] = self._seqs.get((topic, text_key), 0) + 1
        record = to_record(message_id=new_message_id(), topic=topic, key=text_key, seq=seq, payload=body,
                           content_type=content_type, headers=dict(headers or {}), created_at=utcnow(),
                           incarnation=self._incarnation, event_type=event_type)
        return record_to_message(self.broker.append(record))

    # -- consuming ------------------------------------------------------------------

    def deliver(self) -> list[Disposition]:
        """Hand every record the inbox's group has not consumed yet to the inbox; returns what became of each.

        Each record goes through ``Inbox.handle`` (the real transaction,
        dedup, ordering, retries and parking) and its offset is committed
        once it is finished, as a running inbox does; then held messages
        whose gap filled are applied (``Inbox.sweep``). Calling it again
        delivers only what arrived since.
        """
        inbox = self._inbox()
        if self._source is None:
            self._source = InMemorySource(self.broker, group_id=inbox.group, topics=inbox.topics)
        dispositions: list[Disposition] = []
        while records := self._source.poll(1000, 0):
            for record in records:
                dispositions.append(inbox.handle(record))
                assert record.partition is not None and record.offset is not None
                self._source.commit({(record.topic, record.partition): record.offset + 1})
        inbox.sweep()
        return dispositions

    def settle(self, batch: Iterable[Record | Message | Delivery]) -> Settled:
        """Run ``batch`` through one inbox transaction and settle each message; never sleeps.

        What a worker of ``Inbox.run`` does with the batch the key scheduler
        hands it (up to ``batch_size``; here, whatever the test gives): each
        key's messages applied in seq order in one transaction (a hot key's
        run, held successors that became next), duplicates dropped, messages
        ahead of a gap held, a failure's writes rolled back with the rest of
        its key not run. Returns ``Settled``: ``done`` is each message that
        reached a ``Disposition``; ``later`` each one to try again after a
        delay in seconds (a failure below ``max_attempts``, ``RetryLater``, the
        key's messages behind a failure, a database outage), nothing counted
        for an outage. Hand those back, as they are, in a later ``settle`` (the
        failure's attempts go with it); the harness does not wait for them.

        ``batch`` holds broker records (decoded as the inbox decodes them,
        foreign ones under ``foreign_records``), ``Message``s, or deliveries
        from an earlier ``later``. Unlike ``deliver()``, nothing is read
        from the broker or committed to it.
        """
        inbox = self._inbox(any_topics=True)
        deliveries: list[Delivery] = []
        for item in batch:
            if isinstance(item, Delivery):
                deliveries.append(item)
                continue
            if isinstance(item, Message):
                deliveries.append(delivery(item))
            elif isinstance(item, Record):
                deliveries.append(decode(item, foreign=inbox.foreign))
            else:
                raise ConfigurationError("settle() takes records, messages or deliveries from "
                                         f"an earlier settle(), got {type(item).__name__}")
            inbox.metrics.consumed(deliveries[-1].message.topic)
        return inbox.settler.settle(deliveries)

    def source(self) -> InMemorySource:
        """A new source for the inbox's group, for ``inbox.run(source)`` on a thread of the test's own."""
        inbox = self._inbox()
        return InMemorySource(self.broker, group_id=inbox.group, topics=inbox.topics)

    def _inbox(self, *, any_topics: bool = False) -> Inbox:
        if self.inbox is None:
            raise ConfigurationError("deliver() and settle() need the harness built with an inbox")
        if not any_topics and not self.inbox.topics:
            raise ConfigurationError("register at least one @inbox.handler(topic) before deliver()")
        return self.inbox

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Close the relay and leave the consumer group; the broker's records stay readable."""
        if self._source is not None:
            self._source.close()
            self._source = None
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def __enter__(self) -> OutboxTestHarness:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OutboxTestHarness(outbox={self.outbox!r}, inbox={self.inbox!r}, broker={self.broker!r})"
