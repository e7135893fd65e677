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

A record that meets a full queue with nothing else in it is larger than the whole queue
(``queue.buffering.max.kbytes``): it can never be produced with these settings, so it fails.
"""

from __future__ import annotations

import time
from typing import Any

from .._protocol import Outcome, SendResult

STEP = 0.2
"""Seconds between two tries of a record the queue had no room for."""

QUEUE_FULL = "producer queue full: the broker took too few of the records queued ahead of it in time"

LARGER_THAN_QUEUE = ("producer refused the record: larger than its whole queue "
                     "(queue.buffering.max.kbytes)")


def produce_waiting(producer: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
    """``producer.produce(*args, **kwargs)``, waiting for room in its queue until ``deadline``
    (monotonic); None once produced, else the record's result (module doc). Other errors of
    ``produce`` or ``flush`` are raised."""
    while True:
        try:
            producer.produce(*args, **kwargs)
            return None
        except BufferError:
            if not len(producer):
                return SendResult(Outcome.FAILED, error=LARGER_THAN_QUEUE)
            left = deadline - time.monotonic()
            if left <= 0:
                return SendResult(Outcome.RETRY, error=QUEUE_FULL, unreachable=True)
            producer.flush(min(STEP, left))
