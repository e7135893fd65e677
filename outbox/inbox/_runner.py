"""The consumer loop behind ``Inbox.run``: poll, schedule by key, settle, commit what is finished.

One thread polls the source, hands deliveries to the key scheduler and
commits offsets; the scheduler's workers run each batch through the settle
stage; a thread of its own sweeps held messages, so that its queries never
hold up the poll. An offset is committed only after
the database transaction of its record and of every earlier record of the
partition committed.

When partitions are revoked, their queued and waiting records are dropped,
their running transactions are waited for, their finished offsets are
committed, and only then does the revoke callback return, so the next owner
starts exactly where this one stopped and sees nothing applied twice. Records
of the partitions this consumer keeps are not touched.

Outages never end the loop: a database that does not answer makes the
deliveries wait (the settle stage), the sweep and the offset commit are tried
again at their next turn, and a broker that does not answer is polled again
after a capped backoff. A broker outage is logged once when it begins (a poll
or an offset commit fails for want of a broker or coordinator, or the source
says it cannot reach its group's coordinator: ``KafkaSource.unavailable``) and
once when it ends: on a commit that succeeds or, with nothing left to commit, on a poll
after which the source says its broker serves it (``KafkaSource.answering``).
A commit that got no answer in time (``CommitUnansweredError``) is told at the
next poll (the one made at the stop, which no poll follows, at once), unless
that poll served a revocation the group asked for (not a loss of the partitions,
``KafkaSource.lost_assignments``: a session that ran out unanswered, as the commit
did): librdkafka held the commit
behind a rebalance waiting for this very poll (the failover campaign's inboxes
logged each such rebalance as an outage "available again after 0.0s"), so the
broker was not down, and the revoked partitions' positions stay uncommitted
(their next owner's redeliveries are dropped as duplicates).

The loop runs on a thread of its own (``outbox.core._stopping``): the caller's
thread only waits, so SIGTERM is seen at once even while librdkafka sits in
an offset commit or a close that a dead broker never answers, and ``run``
returns at most ``stop_timeout`` seconds after the stop.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from transports import Record, Source
from transports._logsafe import safe_logger

from ..core._envelope import utcnow
from ..core._errors import (
    CommitRefusedError,
    CommitUnansweredError,
    CommitUnconfirmedError,
    RetriableTransportError,
)
from ..core._stopping import STOP_TIMEOUT, run_with_stop_bound
from ._delivery import Delivery, Origin
from ._metrics import InboxMetrics
from ._offsets import OffsetTracker, TopicPartition
from ._outage import OutageLog, is_outage
from ._schedule import KeyScheduler
from ._settings import in_flight_limits
from ._settle import Settled

log = safe_logger("outbox.inbox")

COMMIT_INTERVAL = 0.5
SWEEP_INTERVAL = 1.0
REVOKE_TIMEOUT = 30.0

Decode = Callable[..., Delivery]
"""``decode(record, received_at=…, origin=…)``: a record as a delivery, never raising."""



class Settles(Protocol):
    """The settle stage: ``Settler``, or the ``TenantRouter`` sending each batch to its tenant's."""

    def settle(self, deliveries: list[Delivery]) -> Settled: ...


class Sweeps(Protocol):
    """The gap sweep: ``GapSweeper``, or the ``TenantRouter`` sweeping each tenant's in turn."""

    def ready(self) -> Sequence[Delivery]: ...

    def park_stale(self) -> int: ...


class Runner:
    """One ``Inbox.run`` call; not reusable. Returns when ``stop`` is set."""

    def __init__(self, source: Source, *, decode: Decode, settler: Settles, gaps: Sweeps,
                 metrics: InboxMetrics, stop: threading.Event, concurrency: int, batch_size: int,
                 parked_keys: Callable[[], int], install_signal_handlers: bool = True,
                 stop_timeout: float = STOP_TIMEOUT, prepare: Callable[[], None] = lambda: None) -> None:
        self.source = source
        self.decode = decode
        self.settler = settler
        self.gaps = gaps
        self.metrics = metrics
        self.stop = stop
        self.parked_keys = parked_keys
        self.install_signal_handlers = install_signal_handlers
        self.stop_timeout = stop_timeout
        self.prepare = prepare
        self.tracker = OffsetTracker()
        self.revoked: set[TopicPartition] = set()
        self.crash: BaseException | None = None
        self.ended = threading.Event()
        """Set as this run's loop winds down, never cleared: the inbox's stop is cleared when ``run``
        returns, and a sweep thread left behind in a read went on sweeping once the read answered."""
        self.scheduler = KeyScheduler(self._work, concurrency=concurrency, batch_size=batch_size,
                                      on_crash=self._crashed)
        self.max_in_flight, self.max_buffered = in_flight_limits(concurrency, batch_size)
        self.broker = OutageLog("the broker")
        self.database = OutageLog("the database (sweep)")
        self._sweeping: set[object] = set()
        self._sweep_lock = threading.Lock()
        self._poll_again_at = 0.0
        # A commit failed for want of a coordinator: the broker counts as down until one succeeds.
        # An empty poll proves nothing then (librdkafka returns one whether or not anything answers).
        self._commits_failing = False
        # A commit with no answer in time, told at the next poll unless that poll revoked (module doc).
        self._unanswered: CommitUnansweredError | None = None
        self._revoked_in_poll = False
        # What the source says keeps the broker from serving it (``KafkaSource.unavailable``), if it can.
        self._unavailable: Callable[[], str | None] = getattr(source, "unavailable", lambda: None)
        # Times the source lost its partitions, no coordinator asking (``KafkaSource.lost_assignments``).
        self._losses: Callable[[], int] = getattr(source, "lost_assignments", lambda: 0)
        # Whether the source sees its broker answer now (``KafkaSource.answering``), if it can tell:
        # what ends an outage when no commit can (nothing left to commit once the group let go).
        self._answering: Callable[[], bool] = getattr(source, "answering", lambda: True)

    def run(self) -> threading.Thread | None:
        """Consume until ``stop`` is set (or SIGTERM/SIGINT); back at most ``stop_timeout`` s after it.

        Returns the loop's thread when it was left behind still running.
        """
        behind = run_with_stop_bound(self._consume, stop=self.stop.set, stopping=self.stop.is_set,
                                     name="outbox-inbox-consumer", what="the inbox consumer", log=log,
                                     stop_timeout=self.stop_timeout,
                                     install_signal_handlers=self.install_signal_handlers)
        if self.crash is not None:
            # The loop failed and its clean-up (a commit, a close a dead broker never answers) was
            # left behind: the failure is still this run's, never a clean stop (exit 0).
            raise self.crash
        return behind

    def _consume(self) -> None:
        self.prepare()
        if self.stop.is_set():
            self.source.close()
            return
        self.source.on_revoke(self._on_revoke)
        self.scheduler.start()
        sweeper = threading.Thread(target=self._sweep_until_stopped, name="outbox-inbox-sweep",
                                   daemon=True)
        sweeper.start()
        next_commit = time.monotonic()
        try:
            while not self.stop.is_set() and self.crash is None:
                room = self.max_in_flight - self.scheduler.runnable()
                if room <= 0 or self.scheduler.in_flight() >= self.max_buffered:
                    self.scheduler.wait_for_room(self.max_in_flight, 0.1)
                    if self.scheduler.in_flight() >= self.max_buffered:
                        self.stop.wait(0.1)
                else:
                    self._receive(self._poll(min(room, 500)))
                now = time.monotonic()
                if now >= next_commit:
                    self._commit()
                    next_commit = now + COMMIT_INTERVAL
        except BaseException as exc:
            # Kept before the clean-up below, which may never return: run() raises it either way.
            log.error("the inbox consumer failed: %s; stopping", exc)
            self.crash = self.crash or exc
            raise
        finally:
            self.stop.set()
            self.ended.set()
            # Half the stop budget for running transactions and a sweep under way; the rest for the
            # commit and the close.
            budget = min(REVOKE_TIMEOUT, self.stop_timeout / 2)
            deadline = time.monotonic() + budget
            self.scheduler.stop(budget)
            sweeper.join(max(0.0, deadline - time.monotonic()))
            try:
                self._commit()
                self._settle_unanswered(revoked=False)  # no poll comes after this commit to tell
            finally:
                self.source.close()
        if self.crash is not None:
            raise self.crash

    def _poll(self, max_records: int) -> list[Record]:
        if time.monotonic() < self._poll_again_at:
            self.stop.wait(0.05)
            return []
        self._revoked_in_poll = False
        losses = self._losses()
        try:
            records = self.source.poll(max_records, 0.1)
        except RetriableTransportError as exc:
            self._poll_again_at = time.monotonic() + self.broker.failed(exc)
            return []
        finally:
            # A loss is no rebalance: the session ran out with no answer, as the commit did.
            self._settle_unanswered(self._revoked_in_poll and self._losses() == losses)
        problem = self._unavailable()
        if problem is not None:
            self.broker.failed(problem)
        elif not self._commits_failing and (not self.broker.down or self._back()):
            self.broker.answered()
        return records

    def _back(self) -> bool:
        """Once a broker outage was logged, whether a poll may end it: only with nothing left to
        commit (else the next commit tells, as it does after a failed one) and the source saying
        its broker serves it (``KafkaSource.answering``: a fresh report of the consumer in its group).

        "Not unavailable yet" is no answer: ``unavailable`` gives a coordinator a session timeout
        of grace before it calls it gone, so right after a commit outage ended in a revoke it says
        None while the coordinator is still gone. An outage ended early begins again once that
        grace has run out: the failover campaign's inboxes logged one outage of two nodes as two,
        each way, the second ending a moment later, when the nodes were back.
        """
        return not self.tracker.committable() and self._answering()

    def _settle_unanswered(self, revoked: bool) -> None:
        """After a poll: a commit left unanswered is an outage, unless the poll ``revoked``
        partitions (the rebalance the commit waited for, module doc)."""
        unanswered, self._unanswered = self._unanswered, None
        if unanswered is None:
            return
        if revoked:
            self._commits_failing = False  # no news of the broker: the next commit tells
            log.info("an offset commit waited for a rebalance that waited for this consumer's poll (%s): "
                     "no broker outage; the revoked partitions' positions stay uncommitted", unanswered)
        else:
            self.broker.failed(unanswered)

    def _receive(self, records: list[Record]) -> None:
        """Decode a poll's records and hand them to the workers, tracked for the offset commit."""
        if not records:
            return
        received_at = utcnow()
        deliveries = [self.decode(r, received_at=received_at, origin=Origin.POLLED) for r in records]
        for topic, count in Counter(r.topic for r in records).items():
            self.metrics.consumed(topic, count)
        self.tracker.received(position for d in deliveries if (position := d.position) is not None)
        self.scheduler.submit(deliveries)

    def _work(self, batch: list[Delivery]) -> list[tuple[Delivery, float]]:
        try:
            settled = self.settler.settle(batch)
        finally:
            with self._sweep_lock:
                self._sweeping.difference_update(d.message.message_id for d in batch)
        self.tracker.finished(position for d, _ in settled.done if (position := d.position) is not None)
        # A record of a partition that was taken away meanwhile is the next owner's to retry.
        return [(d, delay) for d, delay in settled.later if self._still_mine(d)]

    def _still_mine(self, d: Delivery) -> bool:
        if d.position is None:
            return True
        tp, offset = d.position
        return tp not in self.revoked and self.tracker.is_open(tp, offset)

    def _crashed(self, exc: BaseException) -> None:
        self.crash = exc
        self.stop.set()

    def _commit(self, only: Sequence[TopicPartition] | None = None) -> None:
        offsets = self.tracker.committable(only)
        if offsets:
            try:
                self.source.commit(offsets)
            except CommitRefusedError as exc:
                # Not committed: keep the old position, the next commit (or owner) tries again.
                log.warning("offset commit refused (%s); the positions stay uncommitted", exc)
            except CommitUnconfirmedError:
                pass  # sent, answer later (the source logs a refusal): no news of the broker either way
            except CommitUnansweredError as exc:
                self._commits_failing = True
                self._unanswered = exc  # the broker gone, or a rebalance behind the next poll: it tells
            except RetriableTransportError as exc:
                self._commits_failing = True
                self.broker.failed(exc)
            else:
                self._commits_failing = False
                self.broker.answered()
                self.tracker.committed(offsets)
        elif only is None:
            self._commits_failing = False  # nothing left to commit (revoked meanwhile): polls tell again
        for (topic, partition), lag in self.tracker.lag().items():
            self.metrics.commit_lag(topic, partition, lag)

    def _on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        self._revoked_in_poll = True
        gone = set(partitions)
        self.revoked |= gone
        try:
            def mine(d: Delivery) -> bool:
                return d.position is not None and d.position[0] in gone

            dropped = self.scheduler.drop(mine)
            if not self.scheduler.wait_idle(mine, REVOKE_TIMEOUT):
                log.error("revoke: work on %s still running after %ss; its offsets stay "
                          "uncommitted and the next owner redoes it", sorted(gone), REVOKE_TIMEOUT)
            # A batch that had checked its records were still this consumer's just before the
            # revoke began puts their retries back as it ends, after the first drop.
            dropped += self.scheduler.drop(mine)
            self._commit(list(gone))
            log.info("revoked %s: %d queued records left for the next owner", sorted(gone), dropped)
        finally:
            self.tracker.forget(gone)
            self.revoked -= gone

    def _sweep_until_stopped(self) -> None:
        """The sweep's own thread: its queries never hold up the poll (a slow or frozen database
        would otherwise delay every key's records, and keep the consumer from polling at all)."""
        while not self.stop.is_set() and not self.ended.is_set() and self.crash is None:
            self._sweep()
            self.stop.wait(SWEEP_INTERVAL)

    def _sweep(self) -> None:
        """Apply held messages whose gap filled, park gaps that never fill; outages wait a turn."""
        try:
            for d in self.gaps.ready():
                with self._sweep_lock:
                    if d.message.message_id in self._sweeping:
                        continue  # already queued by an earlier sweep
                    self._sweeping.add(d.message.message_id)
                self.scheduler.submit([d])
            self.gaps.park_stale()
            self.metrics.parked_keys(self.parked_keys())
        except Exception as exc:
            if is_outage(exc):
                self.database.failed(exc)
                return
            log.exception("inbox sweep failed; trying again in %ss", SWEEP_INTERVAL)
            return
        self.database.answered()
