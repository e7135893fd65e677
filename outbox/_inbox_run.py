"""The consumer loop behind ``Inbox.run``: poll, schedule by key, commit what is finished.

One thread (the caller's) polls the source, hands deliveries to the key
scheduler and commits offsets; the scheduler's workers run the transactions.
An offset is committed only after the database transaction of its record and
of every earlier record of the partition committed. When partitions are
revoked, their queued records are dropped, their running transactions are
waited for (retry waits are abandoned), their finished offsets are committed,
and only then does the revoke callback return, so the next owner starts
exactly where this one stopped and sees nothing applied twice.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from transports import Record, Source

from ._envelope import utcnow
from ._inbox_delivery import Delivery, decode
from ._inbox_offsets import OffsetTracker, TopicPartition
from ._inbox_retry import Abandoned
from ._inbox_schedule import KeyScheduler

if TYPE_CHECKING:
    from ._inbox import Inbox

log = logging.getLogger("outbox.inbox")

COMMIT_INTERVAL = 0.5
SWEEP_INTERVAL = 1.0
REVOKE_TIMEOUT = 30.0


class Runner:
    """One ``Inbox.run`` call; not reusable."""

    def __init__(self, inbox: Inbox, source: Source, *, install_signal_handlers: bool) -> None:
        self.inbox = inbox
        self.source = source
        self.tracker = OffsetTracker()
        self.revoked: set[TopicPartition] = set()
        self.crash: BaseException | None = None
        self.scheduler = KeyScheduler(self._work, concurrency=inbox.concurrency,
                                      batch_size=inbox.batch_size, on_crash=self._crashed)
        self.max_in_flight = max(1000, 4 * inbox.concurrency * inbox.batch_size)
        self.install_signal_handlers = install_signal_handlers
        self._sweeping: set[object] = set()
        self._sweep_lock = threading.Lock()

    def run(self) -> None:
        previous = self._install_signals()
        inbox = self.inbox
        default_abandon, inbox.retrier.should_abandon = inbox.retrier.should_abandon, self._abandon
        self.source.on_revoke(self._on_revoke)
        self.scheduler.start()
        next_commit = next_sweep = time.monotonic()
        try:
            while not inbox.stopping and self.crash is None:
                room = self.max_in_flight - self.scheduler.in_flight()
                if room <= 0:
                    self.scheduler.wait_for_room(self.max_in_flight, 0.1)
                else:
                    self._receive(self.source.poll(min(room, 500), 0.1))
                now = time.monotonic()
                if now >= next_commit:
                    self._commit()
                    next_commit = now + COMMIT_INTERVAL
                if now >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + SWEEP_INTERVAL
        finally:
            inbox.stop()  # interrupts retry waits of running work
            self.scheduler.stop(REVOKE_TIMEOUT)
            try:
                self._commit()
            finally:
                self.source.close()
                self._restore_signals(previous)
                inbox.retrier.should_abandon = default_abandon
        if self.crash is not None:
            raise self.crash

    def _receive(self, records: list[Record]) -> None:
        """Decode a poll's records and hand them to the workers, tracked for the offset commit."""
        if not records:
            return
        received_at = utcnow()
        accept_foreign = self.inbox.accept_foreign
        deliveries = [decode(r, accept_foreign=accept_foreign, received_at=received_at) for r in records]
        for d in deliveries:
            d.tracked = True
        for topic, count in Counter(r.topic for r in records).items():
            self.inbox.metrics.consumed(topic, count)
        self.tracker.received(((r.topic, r.partition), r.offset) for r in records)  # type: ignore[misc]
        self.scheduler.submit(deliveries)

    def _work(self, batch: list[Delivery]) -> None:
        try:
            done = self.inbox.retrier.settle(batch)
        except Abandoned:
            done = []
        finally:
            with self._sweep_lock:
                self._sweeping.difference_update(d.message.message_id for d in batch)
        # Only what reached a disposition is finished; an abandoned record keeps its
        # partition's commit behind it, whatever else its batch carried.
        self.tracker.finished(((d.message.topic, d.partition), d.offset)  # type: ignore[misc]
                              for d, _ in done if d.tracked)

    def _abandon(self, d: Delivery) -> bool:
        return self.inbox.stopping or (d.tracked and (d.message.topic, d.partition) in self.revoked)

    def _crashed(self, exc: BaseException) -> None:
        self.crash = exc

    def _commit(self, only: Sequence[TopicPartition] | None = None) -> None:
        offsets = self.tracker.committable(only)
        if offsets:
            self.source.commit(offsets)
            self.tracker.committed(offsets)
        for (topic, partition), lag in self.tracker.lag().items():
            self.inbox.metrics.commit_lag(topic, partition, lag)

    def _on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        gone = set(partitions)
        self.revoked |= gone
        try:
            def mine(d: Delivery) -> bool:
                return d.tracked and (d.message.topic, d.partition) in gone

            dropped = self.scheduler.drop(mine)
            if not self.scheduler.wait_idle(mine, REVOKE_TIMEOUT):
                log.error("revoke: work on %s still running after %ss; its offsets stay "
                          "uncommitted and the next owner redoes it", sorted(gone), REVOKE_TIMEOUT)
            self._commit(list(gone))
            log.info("revoked %s: %d queued records left for the next owner", sorted(gone), dropped)
        finally:
            self.tracker.forget(gone)
            self.revoked -= gone

    def _sweep(self) -> None:
        gaps = self.inbox.gaps
        for d in gaps.ready():
            with self._sweep_lock:
                if d.message.message_id in self._sweeping:
                    continue  # already queued by an earlier sweep
                self._sweeping.add(d.message.message_id)
            self.scheduler.submit([d])
        gaps.park_stale()
        self.inbox.metrics.parked_keys(self.inbox.admin.parked_key_count())

    def _install_signals(self) -> dict[int, object]:
        if not self.install_signal_handlers or threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: self.inbox.stop())
        return previous

    def _restore_signals(self, previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
