"""``subscribe``: a FastStream subscriber whose body is ``Inbox.handle``, committed only after it.

Why the subscriber's body is the inbox rather than the user's function: the
inbox runs a handler more than once (retries, a batch redone message by
message), later (a held message applied when its gap fills, by the sweep)
and outside FastStream altogether (``outbox parked replay`` loads the inbox
and re-runs the parked key). Each of those needs the handler on the inbox,
given the inbox's session; a FastStream body can be called only by FastStream,
for a message it is delivering now.

Why it commits itself (``AckPolicy.MANUAL``): FastStream's default,
``AckPolicy.ACK_FIRST``, is the client's auto-commit, which commits records
still in the handler. Its confluent ack commits the consumer's positions
with an asynchronous ``commit()`` that names no offsets; librdkafka reads the
positions when it gets to the request, and by then the subscriber may have
polled the next record, so an unfinished record can be committed (seen once
in tests/test_inbox_faststream.py's crash test). Naming the finished
record's offset cannot commit anything after it.

Why ``Inbox.handle`` runs on a daemon thread of its own rather than
``asyncio.to_thread``: the event loop's default executor is joined when
``asyncio.run`` ends, so a worker thread still waiting out a database outage
(or sitting in a query to a frozen server) would keep the process from
exiting after SIGTERM. The app's stop cancels the body, which sets the
call's ``cancel`` event: ``Inbox.handle`` gives up at its next wait, and a
thread stuck in the driver is left behind without holding the exit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from faststream import AckPolicy, Context

from ..core._errors import ConfigurationError
from ..inbox import Inbox
from ._records import commit_through, record_of
from ._threads import in_daemon_thread

_OURS = ("group_id", "ack_policy", "max_workers", "batch")
"""Subscriber options ``subscribe`` sets itself: the guarantees depend on them."""

_MESSAGE = Context("message")
"""FastStream hands the body its ``KafkaMessage``: the raw record and the consumer to commit on."""

RETRY_PAUSE = 1.0
"""Seconds before a record whose ``Inbox.handle`` raised is delivered again (the inbox's own bug or
missing tables: it waits out outages and parks failing handlers itself)."""


def subscribe(broker: Any, inbox: Inbox, *, topics: Sequence[str] | None = None, **options: Any) -> Any:
    """Subscribe ``inbox`` to ``topics`` (default: every topic with a handler) on ``broker``.

    ``broker`` is a FastStream ``KafkaBroker`` or ``KafkaRouter``, on
    confluent-kafka (``faststream.confluent``) or aiokafka
    (``faststream.kafka``). The subscriber joins the consumer group
    ``inbox.group`` and handles one record at a time, in the order received:
    that keeps a key to one thread, as ``Inbox.handle`` requires.
    ``Inbox.handle`` runs on a worker thread, so the event loop goes on
    (heartbeats, other subscribers, an HTTP app) while a record is retried or
    a database outage is waited out. The record's offset is committed after it
    returned, and only its own: a record cut short by a crash or a shutdown is
    delivered again, and the inbox drops what it had already applied.
    ``options`` go to ``broker.subscriber`` (``auto_offset_reset``,
    ``session_timeout_ms`` …); those the guarantees depend on are refused.
    Returns the subscriber.
    """
    if not type(broker).__module__.startswith(("faststream.confluent", "faststream.kafka")):
        raise ConfigurationError(f"subscribe() needs a FastStream Kafka broker or router "
                                 f"(faststream.confluent or faststream.kafka), got {type(broker).__name__}")
    if clash := sorted(set(options) & set(_OURS)):
        raise ConfigurationError(f"subscribe() sets {', '.join(clash)} itself: one record at a time, "
                                 f"group {inbox.group!r}, committed after the inbox finished it")
    topics = list(topics or inbox.topics)
    if not topics:
        raise ConfigurationError("register at least one @inbox.handler(topic) before subscribe()")
    if missing := sorted(set(topics) - set(inbox.topics)):
        raise ConfigurationError(f"no @inbox.handler for {missing}")
    subscriber = broker.subscriber(*topics, group_id=inbox.group, ack_policy=AckPolicy.MANUAL, **options)

    async def handle_in_inbox(message: Any = _MESSAGE) -> None:
        raw = message.raw_message
        cancel = threading.Event()
        try:
            # Cancelled (the app stopping), this returns at once and commits nothing; the thread
            # gives up at its next wait (or finishes its transaction), and the redelivery is
            # dropped as a duplicate.
            await in_daemon_thread(lambda: inbox.handle(record_of(raw), cancel=cancel))
        except asyncio.CancelledError:
            cancel.set()
            raise
        except Exception:
            await asyncio.sleep(RETRY_PAUSE)
            await message.nack()  # seeks back to this record: it is polled again, nothing skips it
            raise
        await commit_through(message)

    subscriber(handle_in_inbox)
    return subscriber

