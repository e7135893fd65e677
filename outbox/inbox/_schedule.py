"""Key-ordered parallelism: local queues of work, one per key, served by a thread pool.

Like Confluent Parallel Consumer's KEY mode. Every key has its own queue
(a *lane*); a lane is served by at most one worker at a time, so **messages of
one key are handled one at a time, in the order they were submitted**, while
different keys, even of one partition, run concurrently on up to
``concurrency`` threads. Unkeyed messages each get a lane of their own, so
they run unordered. A scheduler lane is ``turn_of`` a delivery: its key, seq
or not, which is wider than the transaction's ``lane_of`` (keyed and numbered).
A worker takes up to ``batch_size`` deliveries at once and
hands them to ``work`` as one batch (one transaction): the head of each ready
lane it takes, and with what room is left, the deliveries queued behind those
heads (a *run*), so a hot key's backlog costs one transaction per batch, not
one per message. The batch's lanes stay busy until it returns.

A delivery to be tried again later goes back to the head of its lane, and the
lane *waits* on a timer (a hashed timing wheel) instead of a worker sleeping:
a waiting key holds back only itself, and as many stuck keys as there are
workers stall nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

from transports._logsafe import safe_logger

from ..core._wheel import TimingWheel
from ._delivery import Delivery, turn_of

log = safe_logger("outbox.inbox")

Work = Callable[[list[Delivery]], list[tuple[Delivery, float]]]
"""Handles a batch; returns the deliveries to try again, each with its delay in seconds."""

TICK = 0.02


class KeyScheduler:
    """Lanes of deliveries and the workers that drain them. Safe to use from several threads."""

    def __init__(self, work: Work, *, concurrency: int, batch_size: int,
                 on_crash: Callable[[BaseException], None]) -> None:
        self._work = work
        self._concurrency = concurrency
        self._batch_size = batch_size
        self._on_crash = on_crash
        self._cond = threading.Condition()
        self._lanes: dict[Hashable, deque[Delivery]] = {}
        self._ready: deque[Hashable] = deque()
        self._busy: set[Hashable] = set()
        self._waiting: TimingWheel[Hashable] = TimingWheel(tick=TICK, start=time.monotonic())
        self._running: list[Delivery] = []
        self._queued = 0
        self._blocked = 0
        """Queued deliveries in waiting lanes: they cannot run before their timer fires."""
        self._idle = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for n in range(self._concurrency):
            thread = threading.Thread(target=self._serve, name=f"inbox-worker-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        timer = threading.Thread(target=self._tick, name="inbox-timer", daemon=True)
        timer.start()
        self._threads.append(timer)

    def submit(self, deliveries: list[Delivery]) -> None:
        """Queue ``deliveries``; each lane keeps the order they come in."""
        with self._cond:
            for d in deliveries:
                lane = turn_of(d)
                queue = self._lanes.get(lane)
                if queue is None:
                    self._lanes[lane] = deque([d])
                    self._ready.append(lane)
                else:
                    queue.append(d)
                    if lane in self._waiting:
                        self._blocked += 1
            self._queued += len(deliveries)
            # Every waiter, never the first n: the timer thread and the consumer wait on this
            # condition too, for other things; one of them woken in a worker's place waits again
            # and the deliveries sit queued beside idle workers until something else wakes them.
            self._cond.notify_all()

    def in_flight(self) -> int:
        """Deliveries queued, waiting or running."""
        with self._cond:
            return self._queued + len(self._running)

    def runnable(self) -> int:
        """Deliveries queued or running, except those behind a waiting key."""
        with self._cond:
            return self._queued - self._blocked + len(self._running)

    def wait_for_room(self, limit: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._queued - self._blocked + len(self._running) < limit,
                                timeout)

    def drop(self, which: Callable[[Delivery], bool]) -> int:
        """Remove queued and waiting (not running) deliveries that match; returns how many.

        A lane waiting for its head's retry waits on when the head stays (a revoke that takes
        the records of another partition queued behind it leaves it alone); when the head goes,
        what stays runs now.
        """
        dropped = 0
        with self._cond:
            for lane, queue in list(self._lanes.items()):
                keep = deque(d for d in queue if not which(d))
                gone = len(queue) - len(keep)
                if not gone:
                    continue
                dropped += gone
                if keep and keep[0] is queue[0] and lane in self._waiting:
                    self._lanes[lane] = keep
                    self._blocked -= gone
                    continue
                waiting = self._waiting.cancel(lane)
                if waiting:  # its head is gone: let the lane run again now
                    self._blocked -= len(queue)
                    self._busy.discard(lane)
                if keep:
                    self._lanes[lane] = keep
                    if waiting:
                        self._ready.append(lane)
                elif lane in self._busy:
                    self._lanes[lane] = keep
                else:
                    del self._lanes[lane]
                    if not waiting:
                        self._ready.remove(lane)
            self._queued -= dropped
            self._cond.notify_all()
        return dropped

    def wait_idle(self, which: Callable[[Delivery], bool], timeout: float) -> bool:
        """Wait until no running delivery matches; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(which(d) for d in self._running), timeout)

    def stop(self, timeout: float) -> None:
        """Drop queued and waiting work, let running batches finish (up to ``timeout``), end the threads."""
        self.drop(lambda d: True)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _take(self) -> tuple[list[Hashable], list[Delivery]] | None:
        with self._cond:
            self._idle += 1
            self._cond.wait_for(lambda: self._ready or self._stopping)
            self._idle -= 1
            if self._stopping:
                return None
            # Leave work for idle peers: a big batch on one thread would serialise it.
            share = -(-len(self._ready) // (self._idle + 1))
            lanes = self._lanes_of_one_tenant(min(self._batch_size, share))
            room = self._batch_size - len(lanes)
            batch: list[Delivery] = []
            for lane in lanes:  # every head, then the runs behind them while there is room
                queue = self._lanes[lane]
                run = 1 + min(room, len(queue) - 1)
                room -= run - 1
                batch.extend(queue.popleft() for _ in range(run))
            self._busy.update(lanes)
            self._running.extend(batch)
            self._queued -= len(batch)
            return lanes, batch

    def _lanes_of_one_tenant(self, count: int) -> list[Hashable]:
        """Up to ``count`` ready lanes, first come first: the first one's, and more of its tenant.

        A batch is one transaction, in one tenant's database: a batch never
        mixes tenants, so a tenant whose database hangs holds up its own
        lanes only. Without tenants (every ``tenant`` None) it is the first
        ``count`` ready lanes.
        """
        first = self._ready.popleft()
        lanes = [first]
        if count > 1:
            tenant = self._lanes[first][0].tenant
            kept: deque[Hashable] = deque()
            while self._ready and len(lanes) < count:
                lane = self._ready.popleft()
                (lanes if self._lanes[lane][0].tenant == tenant else kept).append(lane)
            self._ready.extendleft(reversed(kept))
        return lanes

    def _serve(self) -> None:
        while (taken := self._take()) is not None:
            lanes, batch = taken
            later: list[tuple[Delivery, float]] = []
            try:
                later = self._work(batch)
            except BaseException as exc:  # a bug, not a message problem: stop the inbox
                log.exception("inbox worker crashed")
                self._on_crash(exc)
            finally:
                self._release(lanes, batch, later)

    def _release(self, lanes: list[Hashable], batch: list[Delivery],
                 later: list[tuple[Delivery, float]]) -> None:
        now = time.monotonic()
        # A lane's deliveries to try again go back to its head in the order given
        # (a failed message, then the run that waits behind it).
        back: dict[Hashable, list[Delivery]] = {}
        delays: dict[Hashable, float] = {}
        for d, delay in later:
            lane = turn_of(d)
            back.setdefault(lane, []).append(d)
            delays[lane] = max(delay, delays.get(lane, 0.0))
        with self._cond:
            running = {id(d) for d in batch}
            self._running = [d for d in self._running if id(d) not in running]
            for lane, returned in back.items():
                if lane not in self._busy and lane in self._ready:
                    self._ready.remove(lane)  # not one of this batch's lanes: it must not run now
                queue = self._lanes.setdefault(lane, deque())
                queue.extendleft(reversed(returned))
                self._queued += len(returned)
                if lane not in self._waiting:
                    self._blocked += len(queue)
                else:
                    self._blocked += len(returned)
                self._busy.add(lane)
                self._waiting.schedule(lane, max(now + delays[lane], self._waiting.deadline(lane) or 0.0))
            for lane in lanes:
                if lane in self._waiting:
                    continue
                self._busy.discard(lane)
                if self._lanes[lane]:
                    self._ready.append(lane)
                else:
                    del self._lanes[lane]
            self._cond.notify_all()

    def _tick(self) -> None:
        """Wake the lanes whose wait is over."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._waiting) > 0 or self._stopping)
                if self._stopping:
                    return
                for lane in self._waiting.advance(time.monotonic()):
                    self._blocked -= len(self._lanes[lane])
                    self._busy.discard(lane)
                    self._ready.append(lane)
                self._cond.notify_all()
            time.sleep(TICK)
