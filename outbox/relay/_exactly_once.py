"""Exactly once on the wire: each shard's batch is one Kafka transaction with its progress record.

The relay's at-least-once send (``Transport.publish``, then mark the rows) sends a
batch again when the relay dies between the broker's acknowledgement and the
mark, or when a relay that lost its lease still has a batch in flight. In this
mode "sent" is Kafka's decision, made by a transaction commit (DESIGN §11,
docs/guarantees.md "Exactly once on the wire"):

- each shard has a transactional producer of its own, ``transactional.id`` =
  ``outbox-{incarnation}-{shard}`` (the incarnation names the outbox's tables:
  one per database, schema or prefix), so the shard lease and Kafka's producer
  fence agree;
- a relay that takes a shard (a new lease epoch) first makes that producer,
  which fences every earlier owner (``init_transactions``: an open transaction
  of the old owner is aborted, a commit under way completed, and anything it
  writes afterwards refused), then reads the shard's last committed progress
  record and marks the rows it names published, without sending them, and
  those of a later transaction the broker split whose records are committed
  (``_progress.counted``), each only while the row of its id holds the message
  the record names (``_shard_producer``: a restored copy of the database reads
  its original's records);
- the shard's rows of a batch and one progress record (key: the
  transactional id; partition: the shard's, modulo the topic's count, so no
  other shard's open transaction holds its read back while the topic has a
  partition per shard; value: the ids of the
  rows committed and not yet known to be marked, with a tag of each one's
  message id from its record's ``outbox-message-id`` header) are one transaction. Rows
  are marked published after the commit; until their mark is known to have
  committed they are named in every later progress record of the shard and
  never sent again while the row of the id holds that message (a fetched row of
  the id holding another, its id given again after a mark whose commit went
  unanswered and a deletion by hand, is sent);
- a record the broker refuses for good aborts its transaction: the shard's
  batch is sent again without it (and without its key's later rows), on a new
  producer of the id (a request of the aborted one, purged in flight, could
  still land in its next transaction), so it alone fails; a transaction that
  cannot commit for want of the broker is aborted and its rows retried as in
  an outage; one given up at its deadline though the broker acknowledged some
  of its records was too big for the broker's pace, and the shard's next
  transactions are smaller (``_pace``), begun until the deadline or a stop;
  a producer fenced by a newer one gives up its batch (its rows are not
  marked); a commit whose answer never came is settled by a new producer of
  the id and the read of the progress, as on a take-over;
- no producer of a shard is made unless the lease, confirmed in the database
  around it, is still this relay's at its epoch, and the progress is read
  again after each (``_shard_producer``): a relay that lost its lease without
  knowing it yet fences no new owner, and sends nothing the new owner
  committed. A rightful owner fenced anyway makes its producer again;
- each take-over runs on a thread of its own and holds only its shard
  (``prepare``): one waiting at another producer's open transaction on its
  progress partition, or for ``init_transactions``, leaves the others sending,
  and is tried again at later batches until it succeeds.

Only the relay's worker thread calls ``prepare``, ``send`` and ``close``;
``send`` runs the shards' transactions on threads of its own, one per shard at
a time; ``marked`` may run on the writer thread (the sets of unmarked rows have
a lock).

A tenant fleet's steps share one thread pool (``Sharing``), and a shard's
producer idle for ``idle_after`` seconds is closed ("parked"): its next batch
makes one of the same id again and reads the progress again (``ProducerMaker.make``).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import partial

from transports import (
    Outcome,
    Record,
    SendResult,
    TransactionOutcome,
    TransactionResult,
    Transactions,
    Transport,
    transport_features,
)
from transports._errors import RetriableTransportError, TopicNotFoundError
from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError
from ..core._validation import validate_topic
from ..core._wire import MESSAGE_ID
from ._pace import paced
from ._progress import UNKNOWN_TAG, message_tag, progress_value, topics_fitting
from ._shard_producer import (
    ProducerMaker,
    ShardLease,
    ShardState,
    answered_held,
    await_one,
    settle_take_overs,
    take_turns,
)
from ._sharing import Sharing
from ._writer import DaemonPool

log = safe_logger("outbox.relay")

DEFAULT_PROGRESS_TOPIC = "outbox-progress"
"""The compacted topic of the shards' progress records, created by the relay if missing."""

FENCING_THREADS = 8
"""Half the relay's threads for its shards (``_threads``): shards taken over are fenced and their
progress read on them in parallel, a batch's shards' transactions run on them."""

ROUNDS = 8
"""Transactions one shard's batch may take when records are refused (each round fails at least one)."""


def transactional_id_of(incarnation: str, shard: int) -> str:
    """The transactional id of a shard's producer: ``outbox-{incarnation}-{shard}`` (module doc)."""
    return f"outbox-{incarnation}-{shard}"


def exactly_once_transport(transport: Transport) -> Transactions:
    """``transport`` if it offers transactions (``TransportFeatures.transactions``); else one clear error
    (naming what a transport that claims them lacks of ``Transactions``: a member added since)."""
    if not transport_features(transport).transactions:
        raise ConfigurationError(
            f"exactly_once needs a transport with Kafka transactions (transports.kafka.KafkaTransport); "
            f"{type(transport).__name__} has none")
    if not isinstance(transport, Transactions):
        lacks = sorted(name for name in vars(Transactions) if not name.startswith("_")
                       and not hasattr(transport, name))
        raise ConfigurationError(f"{type(transport).__name__} claims transactions but lacks what "
                                 f"transports.Transactions asks: {', '.join(lacks) or 'its members'}")
    if not _takes_stopping(transport):
        raise ConfigurationError(
            f"{type(transport).__name__} claims transactions but lacks what transports.Transactions "
            f"asks: ensure_compacted_topic(topic, partitions, timeout, stopping), the run's stop event")
    return transport


def _takes_stopping(transactions: Transactions) -> bool:
    """Whether ``ensure_compacted_topic`` takes the ``stopping`` argument the relay passes (by position):
    one written before it was added failed the run with a ``TypeError`` at the progress-topic check.
    A callable whose signature cannot be read is taken at its word."""
    try:
        inspect.signature(transactions.ensure_compacted_topic).bind("topic", 1, 1.0, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin)
        return True
    return True


def tag_of(record: Record) -> str:
    """The tag (``_progress.message_tag``) of the message a record carries, by its ``outbox-message-id``
    header; ``UNKNOWN_TAG`` for a record without one (none the relay makes): a take-over then sends
    its row again rather than mark a row it cannot tell from another."""
    for name, value in record.headers:
        if name == MESSAGE_ID:
            return message_tag(value.decode(errors="replace"))
    return UNKNOWN_TAG


def wait_each(futures: list[Future[None]]) -> None:
    """Wait for each of ``futures`` in turn; the first exception is raised on.

    No name keeps a future that raised: its exception's traceback holds the frames it passes through,
    so a frame that held the future (``for future in …``, as ``send`` did) held itself through the
    exception, a cycle, and with it the failed shard's frames (the producer its remake made) until
    the cycle collector ran."""
    while futures:
        futures.pop(0).result()


def _close_state(state: ShardState, _: object) -> None:
    """A dropped shard's take-over ended: the producer it made, if any, is closed (``ExactlyOnce._drop``)."""
    state.close()


class ExactlyOnce:
    """A relay's transactional sending, a producer per owned shard (module doc).

    ``mark(shard, epoch, ids)`` marks rows published (fenced by the epoch) in a
    transaction of its own, and says whether the lease still held; ``messages(ids)``
    gives the tags of the messages the database's rows of those ids hold (rows not
    there left out: ``ProducerMaker``); ``lease`` renews
    one lease and says whether it held (``Leases.confirm``), and keeps the topics a
    shard's transactions wrote in its row, ahead of each send (``_unsettled``).
    Each transaction and each broker call around one (fencing, reading the
    progress back) is bounded by the transport's ``transaction_timeout``
    (``KafkaTransport``'s ``delivery_timeout``, 30 s by default). ``stopping``:
    the run's stop; once set, a batch cut into several transactions begins no more.
    """

    def __init__(self, transport: Transport, *, incarnation: str, worker_id: str, shards: int,
                 progress_topic: str, mark: Callable[[int, int, list[int]], bool],
                 messages: Callable[[Sequence[int]], dict[int, str]], lease: ShardLease,
                 sharing: Sharing | None = None, name: str | None = None,
                 stopping: threading.Event | None = None) -> None:
        self._transactions = exactly_once_transport(transport)
        if not incarnation:
            raise ConfigurationError("exactly_once needs the outbox's incarnation: run `outbox init-db` "
                                     "to upgrade the tables")
        self.progress_topic = validate_topic(progress_topic)
        self._incarnation, self._worker_id, self._shards = incarnation, worker_id, shards
        timeout = self._transactions.transaction_timeout
        self._mark, self._timeout, self._lease = mark, timeout, lease
        self._owned: dict[int, ShardState] = {}
        self._lock = threading.Lock()
        self._topic_ready = False
        # Daemon threads (``_writer``): a transaction stuck on a frozen broker must not hold a
        # stopped relay's process alive after ``run`` gave up on it at its stop bound.
        self._sharing = sharing
        self._stopping = stopping or threading.Event()
        self.name = name or f"relay {worker_id}"  # its log lines' subject (a fleet's names the tenant)
        self._pool: DaemonPool | None = sharing.pool if sharing is not None else None
        # The last ``send`` left a shard's rows for no broker's fault (``ShardState.remake_waits``).
        self.held_back = False
        # When the latest take-over that ended held by an open transaction (every request answered)
        # began, until ``answered_held`` takes it (``RelayStep.run``: the broker is up since).
        self.answered_since: float | None = None
        # The maker names ids from the incarnation, not through this publisher: it would hold us, a
        # cycle, and a stopped relay's transport would wait for the cycle collector (transports._weak).
        self._maker = ProducerMaker(self._transactions, lease=lease, messages=messages,
                                    progress_topic=self.progress_topic,
                                    timeout=timeout, lock=self._lock, name=self.name,
                                    transactional_id=partial(transactional_id_of, incarnation),
                                    slots=sharing.slots if sharing is not None else None)

    @property
    def producers(self) -> int:
        """The shard producers open now."""
        return sum(1 for state in self._owned.values() if state.producer is not None)

    def transactional_id(self, shard: int) -> str:
        return transactional_id_of(self._incarnation, shard)

    # -- before a batch: fence and recover the shards taken ----------------------------

    def prepare(self, owned: dict[int, int]) -> tuple[dict[int, int], str | None]:
        """The shards of ``owned`` ready to send, and the broker's error if some could not be made so.

        A shard taken (or taken again: a new epoch) gets its producer, which fences
        every earlier owner, then the rows its last committed progress names are
        marked published. Each take-over runs on a thread of its own and holds only
        its shard: one that waits (its progress read held at another producer's open
        transaction, a broker slow to answer ``init_transactions``) leaves the
        others sending, and one that failed is tried again at the next batch (its
        first failure logged). A batch with no shard ready waits for one
        (``await_one``), or for the stop. A shard held by an open transaction
        (``HeldByOpenTransactionError``: its settle, or its progress read) is no
        broker's failure: its error is not returned, and its take-over is tried again
        after ``HELD_AGAIN`` s (``settle_take_overs``), ``HELD_AT_ONCE`` of them at a time
        (``take_turns``): the pool is the busy shards' too. A shard whose lease this relay
        turned out to have lost sends nothing more until the lease is taken afresh.
        A database error is raised.
        """
        for shard in set(self._owned) - set(owned):
            self._drop(shard)
        for shard, epoch in owned.items():
            state = self._owned.get(shard)
            if state is not None and state.epoch != epoch:
                self._drop(shard)
                state = None
            if state is None:
                self._owned[shard] = ShardState(epoch)
        self._park_idle()
        now = time.monotonic()
        try:
            self._take_over(take_turns([s for s in sorted(owned) if self._owned[s].producer is None
                                        and self._owned[s].taking is None and not self._owned[s].lost
                                        and not self._owned[s].parked and self._owned[s].held_until <= now],
                                       self._owned))
        except RetriableTransportError as exc:
            return {}, str(exc)  # the progress topic cannot be looked up: no shard is taken
        if not any(self._sendable(s) for s in self._owned.values()):
            await_one([s.taking for s in self._owned.values() if s.taking is not None], self._timeout,
                      self._stopping)
        # A take-over held by an open transaction had every request answered: the broker is up since
        # it began (``RelayStep.run``), though no row of its shard is published.
        # (Not through a name bound here: this frame would hold a take-over's exception, and that
        # exception, raised on by ``settle_take_overs``, holds this frame in its traceback: a cycle.)
        self.answered_since = max((s.taking_since for s in self._owned.values() if answered_held(s)),
                                  default=None)
        # A take-over that found the progress topic missing (deleted under the running relay): checked,
        # and made, before the next one; checked once a run, every take-over after found it missing.
        gone = any(s.taking is not None and s.taking.done()
                   and isinstance(s.taking.exception(), TopicNotFoundError) for s in self._owned.values())
        error = settle_take_overs(self._owned, self.name)
        if gone and self._topic_ready:
            self._topic_ready = False
            log.warning("%s: its progress topic %s is gone (deleted?): it is made again before the next "
                        "take-over; rows a transaction committed whose marks had not yet may be sent again",
                        self.name, self.progress_topic)
        ready: dict[int, int] = {}
        for shard, epoch in sorted(owned.items()):
            state = self._owned[shard]
            if not self._sendable(state):
                continue
            if not state.recovered:
                self._recover(shard, state)
            ready[shard] = epoch
        return ready, error

    def answered_held(self) -> float | None:
        """When the latest take-over that ended held by an open transaction since the last call began
        (its every request answered by the broker), or None."""
        since, self.answered_since = self.answered_since, None
        return since

    def is_progress_topic(self, topic: str) -> bool:
        """Whether ``topic`` is this relay's progress topic, or (in a fleet) any outbox's or the name they
        are made from.

        A row is never sent there: keyed by a shard's transactional id, it would be that
        shard's last committed progress, and its take-over would mark the rows it names
        published without sending them.
        """
        if topic == self.progress_topic:
            return True
        base = self._sharing.progress_topic if self._sharing is not None else None
        return base is not None and (topic == base or topic.startswith(f"{base}-"))

    @property
    def waiting(self) -> bool:
        """A shard held waits for the next batch: its take-over under way or to be tried again, or rows
        committed to Kafka not known marked. A loop that polls rarely runs that batch soon anyway."""
        return any(not state.lost and (not self._sendable(state) or state.unmarked)
                   for state in self._owned.values())

    @staticmethod
    def _sendable(state: ShardState) -> bool:
        """Its take-over is done (or its producer parked) and the lease is still this relay's."""
        return state.taking is None and not state.lost and (state.producer is not None or state.parked)

    def _park_idle(self) -> None:
        """Close the producers of shards that sent nothing for ``Sharing.idle_after`` seconds (less while
        other shards wait for a slot: ``Sharing.idle_limit``), and, while shards wait, those kept for a
        whole turn, busy or not: their shards queue for a slot again, behind the waiting ones, through
        a take-over (the progress read again), so a shard that always sends cannot starve the others."""
        if self._sharing is None:
            return
        now = time.monotonic()
        idle_since, turn = now - self._sharing.idle_limit(), self._sharing.turn_limit()
        for state in self._owned.values():
            if state.producer is None or not state.recovered:
                continue
            if state.used < idle_since:
                state.producer.close()
                state.producer, state.parked = None, True
            elif turn is not None and state.made < now - turn:
                state.producer.close()
                state.producer = None

    def check_topic(self) -> bool:
        """Make the progress topic unless it exists; raise ``ConfigurationError`` if it exists and is
        not compacted, ``RetriableTransportError`` if the broker does not answer. False: the run
        stopped first (a stop ends the wait for the broker, which may last the transaction timeout:
        the relay returns at once, and leaves no admin client behind on a thread still waiting)."""
        if not self._topic_ready:
            try:
                self._transactions.ensure_compacted_topic(self.progress_topic, self._shards, self._timeout,
                                                          self._stopping)
            except RetriableTransportError:
                if self._stopping.is_set():
                    return False
                raise
            self._topic_ready = True
        return True

    def _take_over(self, shards: list[int]) -> None:
        """Start making ``shards``' producers (each fencing the shard's earlier owners, made only under
        a confirmed lease) and reading their progress, each on a thread of the pool: at once (many
        shards cost about what one costs), and none waits for another (``prepare``)."""
        if not shards or not self.check_topic():
            return
        pool = self._threads()
        for shard in shards:
            state = self._owned[shard]
            state.recovered, state.taking_since = False, time.monotonic()
            state.taking = pool.submit(partial(self._maker.make, shard, state))

    def _recover(self, shard: int, state: ShardState) -> None:
        """Mark the rows the shard's committed progress names published (a database error raises)."""
        with self._lock:
            named = sorted(state.unmarked)
        # A database outage raises: recovered later. A lease lost meanwhile leaves them named:
        # a batch run on it before the renewal noticed must not send them again.
        if named and self._mark(shard, state.epoch, named):
            log.info("%s, shard %d: %d rows a transaction had committed marked published, not sent again",
                     self.name, shard, len(named))
            self.marked(named)
        state.recovered = True

    def _drop(self, shard: int) -> None:
        state = self._owned.pop(shard, None)
        if state is None:
            return
        taking, state.taking = state.taking, None
        if taking is not None:  # the producer its take-over makes is closed once made
            # Off the state: a take-over that failed holds the state through its exception's traceback
            # (the frames of ``ProducerMaker.make``), and the state held the take-over, and the callback
            # the state, a cycle that kept the failed take-over's producer (a librdkafka client: threads,
            # connections) until the cycle collector ran. The callback holds the state only until it ran.
            taking.add_done_callback(partial(_close_state, state))
        else:
            state.close()

    # -- one batch ---------------------------------------------------------------------

    def send(self, records: Sequence[Record], rows: Sequence[tuple[int, int]]) -> list[SendResult]:
        """Send ``records`` (``rows``: each one's row id and shard) in a transaction per shard.

        Records of rows a committed transaction carried come back delivered without
        being sent (their mark had not committed yet).
        """
        results: list[SendResult | None] = [None] * len(records)
        by_shard: dict[int, list[int]] = {}
        for i, (_, shard) in enumerate(rows):
            if self.is_progress_topic(records[i].topic):
                results[i] = SendResult(Outcome.FAILED, error=(
                    f"topic {records[i].topic!r} is the exactly-once relay's progress topic: a row "
                    f"there could pass for a shard's progress and make a take-over skip rows"))
                continue
            by_shard.setdefault(shard, []).append(i)
        sending = self._recorded(records, [
            (shard, state, {i: rows[i][0] for i in indexes}) for shard, indexes in by_shard.items()
            if (state := self._owned.get(shard)) is not None and state.recovered and not state.lost])
        if len(sending) == 1:
            self._send_shard(*sending[0][:2], records, sending[0][2], results)
        elif sending:
            # Each shard's transaction on a thread of its own: their commits overlap instead of
            # costing one round trip after the other (each shard writes its own results).
            pool = self._threads()
            wait_each([pool.submit(partial(self._send_shard, shard, state, records, ids, results))
                       for shard, state, ids in sending])
        # A parked shard refused a slot when it had rows again waits in the queue for one (through a
        # take-over), and one whose new producer's settle is held by an open transaction waits for it:
        # their rows are retried without an attempt, and no broker is down (``_batch``).
        self.held_back = any(state.remake_waits for _, state, _ in sending)
        # Not sent: its shard is not ready or lost, or its key waits behind a refused record.
        return [r if r is not None else SendResult(Outcome.RETRY, error="not sent", unreachable=True)
                for r in results]

    def _recorded(self, records: Sequence[Record], sending: list[tuple[int, ShardState, dict[int, int]]]
                  ) -> list[tuple[int, ShardState, dict[int, int]]]:
        """The shards of ``sending`` whose lease rows name every topic of their records, once those
        that did not are given them (``_unsettled``), in one transaction, before anything is sent: a
        relay killed at any point later has named each topic it may leave records open on. A shard
        whose lease turned out to be another's is ``lost`` and sends nothing; a database error
        raises, and nothing is sent. A shard sending to the topics it sent to before costs nothing."""
        wanted: dict[int, tuple[int, frozenset[str]]] = {}
        for shard, state, ids in sending:
            named = state.recorded or frozenset()
            topics = frozenset(records[i].topic for i in ids)
            if not topics <= named:
                wanted[shard] = (state.epoch, named | topics)
        if not wanted:
            return sending
        held = self._lease.widen(wanted)
        for shard, (epoch, topics) in wanted.items():
            state = self._owned[shard]
            if shard in held:
                state.recorded = topics
                continue
            state.lost = True
            log.warning("%s no longer holds shard %d's lease of epoch %d: it sends nothing more of it",
                        self.name, shard, epoch)
        return [entry for entry in sending if entry[0] not in wanted or entry[0] in held]

    def _send_shard(self, shard: int, state: ShardState, records: Sequence[Record], ids: dict[int, int],
                    results: list[SendResult | None]) -> None:
        """The shard's records in transactions until committed or given up (module doc)."""
        state.used = started = time.monotonic()
        if state.parked:
            state.parked = False
            if not self._maker.remake(shard, state):
                return  # no producer now: retried, its progress read again first
        todo = list(ids)
        # A key's first record refused for good, by its place: the key's rows after it wait (the
        # rows before it go on; a batch holds a key's rows in order).
        stopped: dict[tuple[str, bytes | None], int] = {}
        isolating = False
        rounds = 0
        while rounds < ROUNDS:
            with self._lock:  # named by the progress (read again with every producer made): never sent again
                for i in todo:  # while its row holds the message committed under its id (``tag_of``)
                    if results[i] is None and (tag := state.unmarked.get(ids[i])) is not None and (
                            tag == tag_of(records[i])):
                        results[i] = SendResult(Outcome.DELIVERED)
            todo = [i for i in todo if results[i] is None and (
                records[i].key is None or i < stopped.get((records[i].topic, records[i].key), i + 1))]
            if not todo or state.producer is None or state.lost:
                break
            # The topics this transaction's progress header may name (``_progress``): rows of the
            # others wait for the shard's next transaction, all of a topic's together.
            topics = topics_fitting((records[i].topic for i in todo), self.progress_topic)
            now = [i for i in todo if records[i].topic in topics][:state.cap]
            refused = self._transaction(shard, state, records, ids, now, results)
            if not refused:
                if (len(now) < len(todo) and time.monotonic() - started < self._timeout
                        and not self._stopping.is_set() and all(
                            (r := results[i]) is not None and r.outcome is Outcome.DELIVERED for i in now)):
                    # Committed: the next topics' (or the cap's) rows in the next transaction. Not
                    # once the run is stopping: the rest waits (no attempt) for the next owner.
                    continue
                break
            rounds += 1
            if len(refused) > 1 and not isolating:
                # The broker refuses a whole request for one record in it: again, one per request.
                isolating = True
                self._maker.remake(shard, state, one_per_request=True)
                continue
            for i, result in refused.items():
                results[i] = result
                key = (records[i].topic, records[i].key)
                stopped[key] = min(i, stopped.get(key, i))
            # The rest again on a new producer, isolating or not: a request of the aborted
            # transaction purged in flight may still reach the broker, late, and with the old
            # producer's epoch it would join its next transaction and commit with it (``_abort``).
            isolating = False
            self._maker.remake(shard, state)
        if isolating and state.producer is not None:
            self._maker.remake(shard, state)

    def _threads(self) -> DaemonPool:
        """The relay's threads for its shards' fences and transactions (made on first use)."""
        if self._pool is None:
            self._pool = DaemonPool(f"outbox-relay-txn-{self._worker_id}",
                                    min(self._shards, FENCING_THREADS * 2))
        return self._pool

    def _transaction(self, shard: int, state: ShardState, records: Sequence[Record], ids: dict[int, int],
                     todo: list[int], results: list[SendResult | None]) -> dict[int, SendResult]:
        """One transaction of ``todo``'s records and the progress; the records refused for good.

        Committed: their results are set. Aborted by refusals: nothing set, the refused
        returned. Otherwise (outage, fenced, unknown): every result set to a retry.
        """
        assert state.producer is not None
        sent_ids = [ids[i] for i in todo]
        sent = {ids[i]: tag_of(records[i]) for i in todo}
        with self._lock:
            carried = {**state.unmarked, **sent}
        value = progress_value(carried, sent_ids, self._worker_id, state.epoch)
        progress = Record(self.progress_topic, value, key=self.transactional_id(shard).encode(),
                          partition=shard)
        began = time.monotonic()
        try:
            answer = state.producer.send([*(records[i] for i in todo), progress])
        except Exception as exc:
            # A bug of the transport's, raised after the commit may have been asked for (it was, once:
            # a read-back's TimeoutError): its fate is unknown. Kept, this producer would send the rows
            # again in its next transaction, which commits whatever of this one the broker left open.
            log.exception("%s: shard %d's transaction raised; its outcome is unknown", self.name, shard)
            answer = TransactionResult(TransactionOutcome.UNKNOWN, [SendResult(
                Outcome.RETRY, error=f"the transaction raised {exc!r}", unreachable=True)] * (len(todo) + 1),
                repr(exc))
        own = dict(zip(todo, answer.results[:-1], strict=True))
        self._pace(shard, state, len(todo), answer, time.monotonic() - began)
        if answer.outcome is TransactionOutcome.COMMITTED:
            with self._lock:
                state.unmarked.update(sent)
            for i, res in own.items():
                results[i] = res
            return {}
        refused = {i: res for i, res in own.items() if res.outcome is Outcome.FAILED}
        if answer.outcome is TransactionOutcome.ABORTED and refused:
            return refused
        # Fenced: by a new owner (this relay lost the lease), or by a relay that lost it and made a
        # producer anyway (``_shard_producer``). Unknown: settled by the next producer of the id.
        # Aborted (for want of the broker, or its progress record refused): the broker may have
        # dropped its abort marker on a data partition (its leader lost then), and this producer's
        # next commit there would end those records committed too, the rows twice on the wire (a
        # kept producer did); a new producer of the id ends them first (``Unsettled``). Either way
        # the next batch makes one, if the lease still holds, and reads the progress: a rightful
        # owner fences the other back, a relay that lost it sends nothing.
        if answer.outcome is TransactionOutcome.FENCED:
            log.warning("%s's producer of shard %d was fenced: it gives up its batch, marks nothing "
                        "of it, and makes one again only if its lease still holds", self.name, shard)
        elif answer.results[-1].outcome is Outcome.FAILED:
            log.error("%s: the progress topic %s refused shard %d's progress record: %s",
                      self.name, self.progress_topic, shard, answer.results[-1].error)
        state.producer.close()
        state.producer, state.recovered = None, False
        # Fenced is nothing the rows did (another producer of the id was made): no attempt counted.
        fenced = answer.outcome is TransactionOutcome.FENCED
        for i, res in own.items():
            results[i] = res if res.outcome is Outcome.RETRY and not fenced else SendResult(
                Outcome.RETRY, error=answer.error or res.error, unreachable=True)
        return {}

    def _pace(self, shard: int, state: ShardState, count: int, answer: TransactionResult,
              took: float) -> None:
        """Size the shard's next transactions to the broker's pace (``_pace.paced``)."""
        cap = paced(state, count, answer, took, self._timeout)
        if cap is not None:  # of its records and its progress record: of the rows' at most ``count``
            log.warning("%s, shard %d: a transaction of %d records was given up after %.0f s with %d of "
                        "them acknowledged: the broker takes them too slowly; the shard's transactions "
                        "now carry at most %d records", self.name, shard, count, took,
                        min(answer.answered, count), cap)

    def marked(self, ids: Iterable[int]) -> None:
        """These rows' published mark committed: no later progress record needs to name them."""
        gone = set(ids)
        with self._lock:
            for state in self._owned.values():
                for row in gone & state.unmarked.keys():
                    del state.unmarked[row]

    def close(self) -> None:
        if self._pool is not None and self._sharing is None:  # a fleet's pool is the fleet's to shut
            self._pool.shutdown(timeout=0)
            self._pool = None
        for shard in list(self._owned):
            self._drop(shard)
