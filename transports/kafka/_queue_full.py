"""A record librdkafka's local queue has no room for: wait for room, as for the broker.

``produce()`` raises ``BufferError`` once ``queue.buffering.max.messages`` records (or
``queue.buffering.max.kbytes``) wait in the producer. They drain as the broker acknowledges
them; a broker that is slow or frozen keeps the queue full, which is an outage, not the
record's fault (DESIGN §9). So a full queue is served (``flush``: it also sends what waits
for its linger) and the record produced again until the caller's deadline, the one that
bounds its wait for delivery reports; a queue still full then is the broker not answering
in time (``unreachable``: no attempt counted), as a record with no report by then is. It
used to be waited 0.5 s for, per record: a batch larger than the queue took 0.5 s per
record past the queue on a frozen broker (20 s for 54 records, past a 3 s delivery timeout)
and came back ``RETRY``, an attempt counted per key.

A record that meets a full queue with nothing else in it, twice, is larger than the whole queue
(``queue.buffering.max.kbytes``): it can never be produced with these settings, so it fails.
(Twice: another thread's ``flush`` may have emptied the queue in between, as ``close`` does.)

A ``flush`` here serves delivery reports, so it is where confluent-kafka raises a fatal error
(the gap-less guarantee's stop): it comes out as ``ProducerStopped``, for the caller to
treat the producer as finished, not as this record's own error.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from .._protocol import Outcome, SendResult

STEP = 0.2
"""Seconds between two tries of a record the queue had no room for."""

QUEUE_FULL = "producer queue full: the broker took too few of the records queued ahead of it in time"

LARGER_THAN_QUEUE = ("producer refused the record: larger than its whole queue "
                     "(queue.buffering.max.kbytes)")


class ProducerStopped(KafkaException):
    """A fatal error raised while waiting for room (``args[0]``: its ``KafkaError``)."""


def fatal_error(exc: Exception) -> KafkaError:
    """The error a fatal stop was raised with, out of ``flush`` or ``poll``.

    confluent-kafka raises librdkafka's fatal error (e.g. the gap-less stop) from
    the call serving callbacks, and a delivery callback that runs in the same
    serving pass then ends in ``SystemError`` (it returns with that exception
    pending); both mean the producer is finished.
    """
    if isinstance(exc, KafkaException) and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return KafkaError(KafkaError._FATAL, f"producer stopped: {exc}")


def produce_waiting(producer: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
    """``producer.produce(*args, **kwargs)``, waiting for room in its queue until ``deadline``
    (monotonic); None once produced, else the record's result (module doc). Other errors of
    ``produce`` are raised; a fatal error out of ``flush`` as ``ProducerStopped``."""
    empty = 0
    while True:
        try:
            producer.produce(*args, **kwargs)
            return None
        except BufferError:
            empty = 0 if len(producer) else empty + 1
            if empty == 2:
                return SendResult(Outcome.FAILED, error=LARGER_THAN_QUEUE)
            left = deadline - time.monotonic()
            if left <= 0:
                return SendResult(Outcome.RETRY, error=QUEUE_FULL, unreachable=True)
            if empty:
                continue  # nothing queued: try again at once (module doc)
            try:
                producer.flush(min(STEP, left))
            except (KafkaException, SystemError) as exc:
                raise ProducerStopped(fatal_error(exc)) from None
