"""A batch's outcomes decided from the transport's answers: what is published, retried, postponed or failed.

The per-key rules of ``_batch`` on the answer side: a key stops at its first
row that was not delivered (the rest of the key stays pending, untouched); a
retry is scheduled in the timing wheel from the later of the relay's and the
publisher's clocks; a record the broker did not answer about (``unreachable``)
is postponed without an attempt counted, on a short backoff that grows per
batch that left records unanswered (``BROKER_OUTAGE_BACKOFF``). No SQL here:
``Planner.plan`` returns a ``Plan`` that ``BatchRunner`` writes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import tenacity

from transports import Outcome, SendResult

from ..core._envelope import utcnow
from ..core._outage import OutageBackoff, delay_before
from ..core._wheel import TimingWheel
from ._metrics import RelayMetrics
from ._sql import ROW_COLUMNS, Marks, add_mark, empty_marks

# Positions in a fetched row (``_sql.ROW_COLUMNS``).
ROW_ID, ROW_TOPIC, ROW_KEY, ROW_SHARD, ROW_CREATED = (
    ROW_COLUMNS.index(name) for name in ("id", "topic", "key", "shard", "created_at"))


@dataclass(slots=True)
class Plan:
    """A batch's decided outcomes, ready to be written."""

    now: datetime
    published: Marks
    published_topics: dict[str, int]
    retried: Marks
    postponed: Marks
    """Rows to retry without counting an attempt: the broker did not answer about them (an outage)."""
    failed: list[tuple[Any, int, str]]
    stopped: set[tuple[str, str]]
    """Keys whose head was retried or failed: they wait until the write commits."""
    error: str | None
    """The first retriable error."""
    broker_unreachable: bool
    """An outage with no record refused: not the gap-less stop after a refused record, whose
    followers come back purged without an answer from a broker that is up."""


BROKER_OUTAGE_BACKOFF = OutageBackoff(first=0.2)
"""When rows the broker did not answer about are sent again: 0.2 s, doubling per batch that left
records unanswered, at most 5 s."""


class Planner:
    """Decides a batch's outcomes; owns the count of consecutive batches the broker left unanswered."""

    def __init__(self, wheel: TimingWheel[tuple[str, str]], metrics: RelayMetrics,
                 backoff: tenacity.wait.wait_base) -> None:
        self.wheel, self.metrics, self.backoff = wheel, metrics, backoff
        self.outage_batches = 0  # consecutive batches with records the broker did not answer about

    def plan(self, rows: Sequence[Any], results: list[SendResult], owned: dict[int, int],
             unsendable: list[tuple[Any, str]]) -> Plan:
        """Decide every row's outcome (and schedule retries in the wheel); no SQL.

        ``unsendable`` rows were not sent: they fail, and their keys wait like a failed head's.
        """
        retried, postponed = empty_marks(), empty_marks()
        # A record retried for want of an answer waited for an outage, not for its own fault:
        # postponed, no attempt counted, even when others of the batch were delivered. A
        # retriable error the broker returned still counts. Nothing delivered and every retry
        # unanswered: the broker is down (logged by the relay).
        retries = [res for res in results if res.outcome is not Outcome.FAILED]
        outage = bool(retries) and all(
            res.outcome is Outcome.RETRY and res.unreachable for res in retries)
        unanswered = any(res.outcome is Outcome.RETRY and res.unreachable for res in retries)
        outage_delay = BROKER_OUTAGE_BACKOFF.delay(self.outage_batches + 1)
        if unanswered:
            self.outage_batches += 1
        elif results:
            self.outage_batches = 0
        ids: list[int] = []
        shards: list[int] = []
        epochs: list[int] = []
        partitions: list[int | None] = []
        offsets: list[int | None] = []
        published = Marks(ids, shards, epochs, {"kafka_partition": partitions, "kafka_offset": offsets})
        failed: list[tuple[Any, int, str]] = [
            (row, owned[row[ROW_SHARD]], error) for row, error in unsendable]
        published_topics: dict[str, int] = {}
        stopped: set[tuple[str, str]] = {
            (row[ROW_TOPIC], row[ROW_KEY]) for row, _ in unsendable if row[ROW_KEY] is not None}
        error: str | None = None
        now, mono = utcnow(), time.monotonic()
        delivered = Outcome.DELIVERED
        for row, res in zip(rows, results, strict=True):
            key = (row[ROW_TOPIC], row[ROW_KEY]) if row[ROW_KEY] is not None else None
            if key is not None and stopped and key in stopped:
                continue
            shard = row[ROW_SHARD]
            epoch = owned[shard]
            if res.outcome is delivered:
                ids.append(row[ROW_ID])
                shards.append(shard)
                epochs.append(epoch)
                partitions.append(res.partition)
                offsets.append(res.offset)
                topic = row[ROW_TOPIC]
                published_topics[topic] = published_topics.get(topic, 0) + 1
                continue
            if key is not None:
                stopped.add(key)
            if res.outcome is Outcome.FAILED:
                failed.append((row, epoch, res.error or "failed"))
            else:
                error = error or res.error
                delay = outage_delay if res.unreachable else delay_before(self.backoff, _attempts(row) + 1)
                # From the later of the two clocks: a publisher ahead of this relay by more
                # than the delay would otherwise get available_at <= created_at, which the
                # fetch reads as "due, never pushed back" (no backoff, key not held).
                base = max(now, row[ROW_CREATED])
                add_mark(postponed if res.unreachable else retried, row.id, row.shard, epoch,
                         available_at=base + timedelta(seconds=delay), last_error=res.error)
                self.metrics.retried.labels(row.topic).inc()
                # The wheel holds the key back and wakes the relay; the row is the truth.
                wheel_key = key if key is not None else (row.topic, str(row.message_id))
                self.wheel.schedule(wheel_key, mono + delay)
        return Plan(now, published, published_topics, retried, postponed, failed, stopped, error,
                     broker_unreachable=outage and not failed)


def _attempts(row: Any) -> int:
    """The row's attempt count; a hand-written row may hold anything there (SQLite)."""
    attempts = row.attempts
    return attempts if type(attempts) is int and attempts >= 0 else 0
