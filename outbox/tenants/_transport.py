"""What a tenant's step sends and writes through: the fleet worker's transport and writer.

A fleet's workers share a few transports (``producers``, two by default): a
worker takes a free one for a publish and gives it back after, as a pool
lends connections. One more is made, up to one per worker, when a worker has
waited ``LEND_WAIT`` for one: a publish that is held (a topic whose leader
moves, waited out up to the delivery timeout) holds one tenant's worker, as
with a producer each, not every worker behind it. A tenant's ``RelayStep`` runs on whichever worker took it,
and its ``TenantTransport`` sends through the transport that worker holds for
that publish (``Workers.producer``). Not one per worker: eight workers with a
producer each cost the relay 1.2-1.7x the CPU of eight sharing two, for the
same rows on Apache Kafka (each producer its own librdkafka threads,
connections and first contacts with every partition), and on a host whose
cores the broker and the database share, that CPU is the fleet's throughput
(docs/benchmarks.md, *Eight workers, two producers*). Each
record gets the tenant's name in the header the fleet names, replacing any
header of that name the producer set, in any case: no tenant sends under
another's name. The workers share as many writer threads as there are
workers (``Workers`` is the ``Writer`` its steps take): a tenant's batch
outcomes are written on whichever is free while the worker goes on to the next
tenant's batch. Shared, not one per worker: a quiet tenant's write, handed to
the writer of a worker that had just served a backlog, waited there behind the
backlog's writes of 1,000 rows each (52 and 89 ms traced), and its next step waited
for it. A tenant's two writes in flight may run at once: their rows are
disjoint, and its fetch leaves a write's rows out until it and every earlier
one finished (``relay._batch``). A tenant's writes reach them through its
server's slots (``_slots``), so a server that hangs holds half of them at most.

In exactly-once mode a tenant's shard transactions go through
``TenantTransport.transactional``: its producers stamp the tenant header as
``publish`` does (the records of a transaction are the same records), and the
workers' one ``Sharing`` (a thread pool, idle producers closed) serves every
tenant's ``ExactlyOnce`` (``relay._sharing``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from typing import TypeVar

from transports import (
    ReadBack,
    Record,
    SendResult,
    TransactionalProducer,
    TransactionResult,
    Transactions,
    Transport,
    TransportFeatures,
    transport_features,
)
from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError
from ..core._outage import first_line
from ..core._validation import folded
from ..core._wire import CONTENT_TYPE, header_size
from ..relay._exactly_once import FENCING_THREADS, exactly_once_transport
from ..relay._settings import _positive_seconds
from ..relay._sharing import ProducerSlots, Sharing
from ..relay._writer import DaemonPool

T = TypeVar("T")

log = safe_logger("outbox.relay")

LEND_WAIT = 1.0
"""Seconds a worker waits for a lent transport before another is made (up to one per worker): a
publish of a batch takes milliseconds, so every one being lent that long means publishes are held."""

SAME_TRANSPORT = ("transport() returned the same transport twice: it must make a new one each call "
                  "(a producer is lent to one worker at a time), e.g. lambda: KafkaTransport(...)")

CLOSED = ("the fleet's transports are closed (TenantRelay.close()): a publish after it is refused, "
          "call run() or run_once() before close()")

WRITERS_STOP_WITHIN = 3.0
"""Seconds ``close`` waits for each writer thread to finish what it was given (a frozen database)."""


class Workers:
    """``workers`` threads' transports (lent a publish at a time) and writers; ``bind(i)`` makes
    this thread worker ``i``.

    ``idle_producers_after`` (seconds; False: not exactly-once) and
    ``progress_topic``: the ``Sharing`` of every tenant's step, its pool
    ``FENCING_THREADS`` threads per worker.
    """

    def __init__(self, transports: Sequence[Transport], idle_producers_after: float | bool = False,
                 progress_topic: str = "", *, workers: int | None = None,
                 more: Callable[[], Transport] | None = None, slots: ProducerSlots | None = None) -> None:
        try:
            for made in transports:
                if not callable(getattr(made, "publish", None)):
                    raise ConfigurationError(
                        f"transport() returned {made!r:.80}, which has no publish(records)")
            if len({id(made) for made in transports}) < len(transports):
                raise ConfigurationError(SAME_TRANSPORT)
        except ConfigurationError:
            _close_each(transports)  # made for nothing: their connections are not left open
            raise
        self.transports = list(transports)
        self.workers = workers or len(self.transports)
        self._more = more  # makes another transport when every one has been lent ``LEND_WAIT``
        self._making = threading.Lock()  # guards ``transports``, ``_more`` and ``_pending``
        self._pending = 0  # transports being made now, outside the lock
        # Last in, first out: under a light load one producer serves, its requests fuller and its
        # partitions already written (``transports.kafka._first_contact``).
        self._free: queue.LifoQueue[Transport | None] = queue.LifoQueue()  # None: closed
        self._closed = False
        for made in reversed(self.transports):
            self._free.put(made)
        self.local = threading.local()
        self._writers: DaemonPool | None = None
        self._lock = threading.Lock()
        self.sharing: Sharing | None = None
        if idle_producers_after is not False:
            try:
                idle = _positive_seconds("idle_producers_after", idle_producers_after)
                for made in transports:
                    exactly_once_transport(made)  # one clear error for a transport without transactions
                # Daemon threads: a transaction stuck on a frozen broker must not hold a stopped
                # fleet's process alive after ``run`` gave up on it at its stop bound.
                pool = DaemonPool("outbox-relay-txn", self.workers * FENCING_THREADS)
                self.sharing = (Sharing(pool, idle, progress_topic) if slots is None
                                else Sharing(pool, idle, progress_topic, slots))
            except ConfigurationError:
                self.close()  # the transports made for nothing
                raise

    def bind(self, index: int) -> None:
        self.local.index = index

    @contextmanager
    def bound(self, index: int) -> Iterator[None]:
        """This thread is worker ``index`` until the block ends (``run_once`` on a caller's thread)."""
        before = getattr(self.local, "index", None)
        self.local.index = index
        try:
            yield
        finally:
            self.local.index = before

    def _another(self) -> Transport | None:
        """A transport more, for a worker that waited ``LEND_WAIT``; None once there is one per worker.

        Made outside the lock: a slow factory holds neither ``close`` nor the
        other waiters, and what it makes after ``close`` is closed, never lent.
        None too when the factory fails (logged): the worker then waits for a
        lent one, as it would with no more to make; the failure names nothing of
        the tenant whose publish was waiting, so it must not fail that publish.
        """
        with self._making:
            more = self._more
            if more is None or len(self.transports) + self._pending >= self.workers:
                return None
            self._pending += 1
        try:
            made = more()
        except Exception as exc:
            with self._making:
                self._pending -= 1
            log.warning("fleet: every producer was lent for %.1f s, and another could not be made (%s); "
                        "the worker waits for a lent one", LEND_WAIT, first_line(exc))
            return None
        with self._making:
            self._pending -= 1
            refused = self._refused(made)
            if refused is None and self._more is not None:
                self.transports.append(made)
                log.info("fleet: every producer was lent for %.1f s (publishes held by the broker): "
                         "made another, %d of at most %d", LEND_WAIT, len(self.transports), self.workers)
                return made
            if refused is not None:
                self._more = None  # the factory will not do better next time: no more are made
        if refused is not None:
            log.error("fleet: %s; no more are made, the workers wait for the ones they have", refused)
        else:  # closed meanwhile: none is used after close
            _close(made)
        return None

    def _refused(self, made: object) -> str | None:
        """Why a transport made late cannot be lent (a misuse of the factory), or None."""
        if any(made is known for known in self.transports):
            return SAME_TRANSPORT
        if not callable(getattr(made, "publish", None)):
            return f"transport() returned {made!r:.80}, which has no publish(records)"
        return None

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """Run ``call`` on the first writer free (``relay._writer.Writer``), in the order submitted."""
        writers = self._writers
        if writers is None:
            with self._lock:
                if self._writers is None:
                    self._writers = DaemonPool("outbox-relay-writer", self.workers)
                writers = self._writers
        return writers.submit(call)

    @contextmanager
    def producer(self) -> Iterator[Transport]:
        """A transport no other worker uses until this one gives it back: a publish's.

        Waits while every one is lent: a publish is bounded by its transport's
        delivery timeout, and a broker that is down is probed by one step at a
        time (``RelayOutages``), so the others do not queue here behind it.
        """
        if getattr(self.local, "index", None) is None:
            raise ConfigurationError(
                "a tenant's step sends on the TenantRelay's worker threads: call the fleet's run() or "
                "run_once(), not the tenant's")
        transport = self._lend()
        try:
            yield transport
        finally:
            self._give_back(transport)

    def _lend(self) -> Transport:
        try:
            transport = self._free.get(timeout=LEND_WAIT)
        except queue.Empty:
            made = self._another()  # not ``or``: a transport may define __len__, and be 0
            transport = made if made is not None else self._free.get()
        if transport is not None:
            with self._making:
                if not self._closed:
                    return transport
            self._give_back(transport)  # taken as ``close`` began: closed, not used
        self._free.put(None)  # for the next one waiting
        raise RuntimeError(CLOSED)

    def _give_back(self, transport: Transport) -> None:
        """Free again; or, after ``close``, closed: by the only thread that was using it."""
        with self._making:
            if not self._closed:
                self._free.put(transport)
                return
        _close(transport)

    def close(self) -> None:
        """The writers finish what they were given (seconds at most), then the transports close.

        The free ones now; one still lent (a publish held past ``run``'s stop
        bound) when its publish gives it back, on that thread, within its
        delivery timeout: closed under that publish, a producer was used by two
        threads at once (flushed here while its worker polls it, the worker's
        delivery reports served on this thread). None is made or lent after.
        """
        with self._lock:
            writers, self._writers = self._writers, None
        with self._making:
            self._more, self._closed = None, True  # none made, lent or given back to the free after this
        if writers is not None:
            writers.shutdown(WRITERS_STOP_WITHIN)
        if self.sharing is not None:
            self.sharing.pool.shutdown(timeout=0)  # the steps closed their producers
        while True:
            try:
                made = self._free.get_nowait()
            except queue.Empty:
                break
            if made is not None:
                _close(made)
        self._free.put(None)  # wakes a worker waiting for one: it is refused, and wakes the next


def _close(transport: Transport) -> None:
    """Close ``transport`` if it can be: nothing is outstanding after a publish, unless one was left."""
    close = getattr(transport, "close", None)
    if callable(close):
        close(1.0)


def _close_each(transports: Sequence[Transport]) -> None:
    """Close each of ``transports`` once (a factory may have returned one twice)."""
    for made in {id(made): made for made in transports}.values():
        _close(made)


def made_by(factory: Callable[[], Transport], count: int) -> list[Transport]:
    """``count`` transports from ``factory``; those made are closed if a later call fails."""
    made: list[Transport] = []
    try:
        for _ in range(count):
            made.append(factory())
    except BaseException:
        _close_each(made)
        raise
    return made


class TenantTransport:
    """A tenant's transport: the current worker's, with the tenant header put on every record.

    ``max_record_bytes`` is the producers' limit less the header's size, so a
    tenant whose stored record limit leaves no room for it is refused at start.
    """

    def __init__(self, workers: Workers, header: str | None, name: str) -> None:
        self._workers = workers
        self._header = header
        self._value = name.encode("ascii")
        limits = [getattr(t, "max_record_bytes", None) for t in workers.transports]
        known = [limit for limit in limits if isinstance(limit, int)]
        if known and len(known) == len(limits):
            room = header_size(len(header), len(self._value)) if header else 0
            self.max_record_bytes = min(known) - room
            self.max_record_setting = getattr(workers.transports[0], "max_record_setting",
                                              "its maximum record size") + (
                f", less {room} bytes for the tenant header" if room else "")

    @property
    def features(self) -> TransportFeatures:
        """What its workers' transports promise (transactions included: ``transactional``)."""
        return transport_features(self._workers.transports[0])

    def stamped(self, records: Sequence[Record]) -> Sequence[Record]:
        """``records`` with the tenant header, any header of its name (in any case) replaced."""
        header = self._header
        if header is None:
            return records
        value = self._value
        # In any case: a consumer that looks headers up without case must not find another tenant.
        name = folded(header)
        return [replace(r, headers=[(n, v) for n, v in r.headers if folded(n) != name]
                        + [(header, value)]) for r in records]

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        stamped = self.stamped(records)
        with self._workers.producer() as transport:
            return transport.publish(stamped)

    # -- exactly-once mode (``transports.Transactions``): any worker's transport makes the clients

    @property
    def transaction_timeout(self) -> float:
        return self._transactions().transaction_timeout

    def transactional(self, transactional_id: str, timeout: float, *, one_per_request: bool = False,
                      left_open: Collection[str] = ()) -> TransactionalProducer:
        """A producer of ``transactional_id`` whose every transaction carries the tenant header."""
        return _StampedProducer(self._transactions().transactional(
            transactional_id, timeout, one_per_request=one_per_request, left_open=left_open), self)

    def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float,
                               stopping: threading.Event | None = None) -> None:
        self._transactions().ensure_compacted_topic(topic, partitions, timeout, stopping)

    def read_back(self, topic: str, partition: int, key: bytes, timeout: float) -> ReadBack:
        return self._transactions().read_back(topic, partition, key, timeout)

    def _transactions(self) -> Transactions:
        return exactly_once_transport(self._workers.transports[0])

    def close(self, timeout: float = 10.0) -> None:
        """Nothing: the fleet closes its workers' transports."""


class _StampedProducer:
    """A tenant's transactional producer: the tenant header on every record it sends."""

    def __init__(self, inner: TransactionalProducer, tenant: TenantTransport) -> None:
        self._inner, self._tenant = inner, tenant

    def send(self, records: Sequence[Record]) -> TransactionResult:
        return self._inner.send(self._tenant.stamped(records))

    def close(self) -> None:
        self._inner.close()


_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def checked_header(name: str | None) -> str | None:
    """A tenant header name: 1 to 64 of ``A-Z a-z 0-9 - _ .``, not one the envelope uses (in any case)."""
    if name is None:
        return None
    if (not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= _HEADER_CHARS
            or name.lower().startswith(("outbox-", "ce_", "traceparent", "tracestate"))
            or name.lower() == CONTENT_TYPE):
        raise ConfigurationError(
            f"invalid tenant header {name!r:.80}: use 1 to 64 of letters, digits, '-', '_' or '.', "
            "not an outbox-*, content-type, ce_* or trace header")
    return name
