"""A shard's transactional producer in exactly-once mode, made only while this relay's lease holds.

Making a producer of a shard's ``transactional.id`` (``init_transactions``)
fences every other producer of the id: the rightful owner's too, when this
relay lost the lease without knowing it yet (its lease thread has not noticed,
or it stalled). A relay makes one on a take-over, after a commit whose answer
never came, to isolate a refused record one per request, and when an idle
producer of a fleet is needed again. Each goes through ``ProducerMaker.make``,
which confirms the lease at its epoch in the database (``Leases.confirm``, a
renewal of that one lease) before and after making it, and reads the shard's
progress between the two:

- before: a relay that lost the lease makes no producer, so fences nobody;
- after: a relay that stalled for longer than a TTL between the first
  confirmation and the broker's answer may have fenced a new owner meanwhile.
  The second confirmation fails: its producer is closed unused, it sends
  nothing. Once the second succeeds, no other relay took the shard since this
  one did (epochs only grow), and any later owner takes it after this producer
  was made, so its own producer fences this one, and its take-over's read of
  the progress finds whatever this one committed;
- the read: rows committed under the id and not known to be marked (by an
  earlier owner, or by a relay that made its producer in the window above)
  are named in the progress, and are not sent again; each only while the row of
  its id in this database holds the message the record names (``_ours``). A
  database restored from a backup keeps its incarnation, so its relays use the
  original's ids and read the original's records, whose ids the copy gives to
  other messages once it writes past its backup: those rows are sent, never
  marked unsent.

A take-over (the shard's first producer for its lease epoch) also reads, with the
first confirmation, the topics the shard's lease row names (``_unsettled``): where
the id's transactions may have left records open, the process that wrote them
perhaps gone. The transport's new producer ends what is open on every partition
of them before it is returned, and the second confirmation empties the row.

A rightful owner fenced anyway (by a relay whose producer was made in that
window) learns it from its next transaction (``TransactionOutcome.FENCED``): its
producer is dropped and the next batch makes one again through ``make``. The
confirmation tells the two apart: the owner's succeeds, its new producer fences
the other back and the progress read marks what the other committed; the other
relay's fails, and it sends nothing more under that lease. The owner's shard
waits one batch, not the rest of its lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Protocol

from transports import TransactionalProducer, Transactions
from transports._errors import HeldByOpenTransactionError, RetriableTransportError
from transports._logsafe import safe_logger

from ..core._outage import is_database_outage
from ._progress import counted, identified
from ._sharing import NoProducerSlot, ProducerSlots

log = safe_logger("outbox.relay")

TAKE_OVER_GRACE = 1.0
"""Seconds a batch with no shard ready waits for the other take-overs once one of them made its shard
ready (take-overs started together end about together: the first batch sends most shards)."""

HELD_AGAIN = 5.0
"""Seconds before the take-over of a shard held by an open transaction (``HeldByOpenTransactionError``)
is tried again: such a transaction ends in minutes, and each try makes a producer and writes an empty
record on every partition held; tried at every batch, busy shards' batches would try it back to back
on threads their transactions need."""

HELD_AT_ONCE = 4
"""Take-overs of held shards (``HELD_AGAIN``) under way at once: each holds a thread of the relay's
pool (16 at most) for ``HELD_FOR`` s and more, the pool the busy shards' transactions run on; forty
held shards of forty-eight tried all at once delayed the free shards' rows by up to 5.7 s. The held
shards take turns: one tried is not due again for ``HELD_AGAIN`` s, so the next ones are."""

STOP_LOOK = 0.1
"""Seconds between looks at the run's stop while a batch with no shard ready waits (``await_one``)."""


class ShardLease(Protocol):
    """A shard's lease as exactly-once mode asks it, each call fenced by the epoch
    (``_unsettled.UnsettledTopics``): a renewal, alone or with the topics its row names
    (read at a take-over, emptied once settled, widened ahead of a send)."""

    def confirm(self, shard: int, epoch: int) -> bool: ...

    def taken(self, shard: int, epoch: int) -> frozenset[str] | None: ...

    def settled(self, shard: int, epoch: int) -> bool: ...

    def widen(self, wanted: Mapping[int, tuple[int, Collection[str]]]) -> set[int]: ...


@dataclass
class ShardState:
    """One owned shard's producer for one lease epoch, and its rows committed but not known marked."""

    epoch: int
    producer: TransactionalProducer | None = None
    recovered: bool = False  # the rows its progress named at the take-over marked (``_recover``)
    lost: bool = False  # the lease of this epoch is another relay's: nothing more is sent under it
    parked: bool = False  # its idle producer closed (``Sharing.idle_after``): the next send makes one
    used: float = 0.0
    made: float = 0.0  # when its producer was made (monotonic): kept no longer than a turn (``_sharing``)
    remake_waits: bool = False  # its last ``remake`` failed for no broker's fault: no slot free
    # (``_sharing``), or its settle held by an open transaction (``HeldByOpenTransactionError``)
    # Its rows committed to Kafka and not known marked, each with its message's tag (``_progress``).
    unmarked: dict[int, str] = field(default_factory=dict)
    taking: Future[bool] | None = None  # its take-over (``ProducerMaker.make``) under way on a thread
    taking_since: float = 0.0  # when its last take-over began (monotonic)
    stuck: str | None = None  # why its last take-over failed (logged once a cause), until one succeeds
    stuck_by: type[BaseException] | None = None  # that failure's class: another cause is logged again
    held_until: float = 0.0  # held by an open transaction (not 0): its take-over not tried before then
    cap: int | None = None  # the most records a transaction carries while the broker is slow (``_pace``)
    cap_held_until: float = 0.0  # the cap does not grow before then (monotonic; ``_pace``)
    # The topics its lease row names (``_unsettled``); None until its take-over ended what they
    # may have left open and emptied the row.
    recorded: frozenset[str] | None = None

    def close(self) -> None:
        """Close its producer, if any (a shard dropped: its take-over's producer once made)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None


class ProducerMaker:
    """Makes shards' producers under a confirmed lease, their progress read (module doc).

    ``lease`` renews a shard's lease and says whether it held (with the topics its
    row names at a take-over); ``messages`` gives the tags (``_progress.message_tag``) of
    the messages this database's rows of some ids hold, rows not there left out; ``lock``
    guards every ``ShardState.unmarked``.
    """

    def __init__(self, transactions: Transactions, *, lease: ShardLease,
                 messages: Callable[[Sequence[int]], dict[int, str]],
                 progress_topic: str, timeout: float, transactional_id: Callable[[int], str],
                 lock: threading.Lock, name: str, slots: ProducerSlots | None = None) -> None:
        self._transactions, self._lease, self._messages = transactions, lease, messages
        self._progress_topic, self._timeout = progress_topic, timeout
        self._transactional_id, self._lock, self._name = transactional_id, lock, name
        self._slots = slots  # a fleet's: its shard producers are counted (``_sharing``)

    def make(self, shard: int, state: ShardState, *, one_per_request: bool = False) -> bool:
        """Replace the shard's producer by a new one of its id, the progress read; whether one was made.

        None made when the lease is another's (``state.lost``). Raises
        ``RetriableTransportError`` when the broker, and what the database
        raises when the database did not answer (``state.producer`` is then None);
        ``NoProducerSlot`` when a fleet's slots are all taken, before anything
        else is asked. ``one_per_request``: each broker request holds one record.

        A take-over (``state.recorded`` None) reads the topics the lease row names with
        the first confirmation, has the producer end what is open on every partition of
        them before it is returned, and empties the row with the second (``_unsettled``):
        a settle that fails leaves the row as it was, for the next try.
        """
        if state.producer is not None:
            state.producer.close()
            state.producer = None
        slots, tid = self._slots, self._transactional_id(shard)
        if slots is not None:
            slots.take(tid)  # a slot of the fleet's, the producer's own once it holds it (``_sharing``)
        taking_over = state.recorded is None
        try:
            # Confirmed before it is made either way: a relay that lost the lease fences nobody.
            left_open = self._taken(shard, state) if taking_over else (
                frozenset[str]() if self._confirmed(shard, state) else None)
            made = left_open is not None and self._transactions.transactional(
                tid, self._timeout, one_per_request=one_per_request, left_open=sorted(left_open))
        except BaseException:
            if slots is not None:
                slots.give_back()
            raise
        if not made:
            if slots is not None:
                slots.give_back()
            return False
        producer = slots.held(made) if slots is not None else made
        try:
            named = counted(self._transactions.read_back(self._progress_topic, shard, tid.encode(),
                                                         self._timeout))
            with self._lock:  # its own rows still named are checked alike: ``_recover`` marks them all
                own = dict(state.unmarked)
            ours = self._ours(shard, named, taking_over, own)
            held = self._confirmed(shard, state, settled=taking_over)
        except BaseException:
            producer.close()  # made again, and the progress read again, next time
            raise
        if not held:
            producer.close()
            return False
        if taking_over:
            state.recorded = frozenset()
        with self._lock:
            for row in own.keys() - ours.keys():
                state.unmarked.pop(row, None)
            state.unmarked.update(ours)
        state.producer, state.used = producer, time.monotonic()
        state.made, state.remake_waits = state.used, False
        return True

    def remake(self, shard: int, state: ShardState, *, one_per_request: bool = False) -> bool:
        """``make`` during a batch: an outage leaves the shard without a producer (the next batch
        makes one again, the progress read, before it sends), logged once here for the broker; a
        shard held by an open transaction waits as its take-over does (``held``)."""
        try:
            return self.make(shard, state, one_per_request=one_per_request)
        except Exception as exc:
            if not isinstance(exc, RetriableTransportError) and not is_database_outage(exc):
                raise
            state.recovered = False
            state.remake_waits = isinstance(exc, (NoProducerSlot, HeldByOpenTransactionError))
            if isinstance(exc, HeldByOpenTransactionError):
                held(state, shard, exc, self._name)
            elif isinstance(exc, RetriableTransportError) and not state.remake_waits:
                log.warning("%s: no producer for shard %d: %s", self._name, shard, exc)
            return False

    def _ours(self, shard: int, named: dict[int, str | None], taking_over: bool,
              own: Mapping[int, str]) -> dict[int, str]:
        """The rows of ``named`` (a progress read: id and the tag of the message the record names,
        None from an earlier release's record) and of ``own`` (the rows the shard's state names: this
        relay's commits whose mark it has not seen) whose ids this database's rows hold those
        messages under, with their tags (``_progress.identified``); the others are left to be sent,
        and logged at a take-over: likely a restored database. A row of ``own`` whose id was given
        again (rows deleted by hand after a mark whose commit went unanswered) is dropped."""
        both: dict[int, str | None] = {**own, **named}
        if not both:
            return {}
        held = self._messages(sorted(both)) or {}  # None: the relay is gone (``weakly``)
        ours, _ = identified(both, held)
        others = identified(named, held)[1]
        if others and taking_over:
            log.warning(
                "%s, shard %d: its last progress record names %d rows that this database holds other "
                "messages under (ids %s): they are sent, not marked. Likely a database restored from a "
                "backup, with the original's incarnation: give it its own with "
                "`outbox init-db --new-incarnation`, or its relays and the original's fence each other",
                self._name, shard, len(others),
                ", ".join(str(row) for row in others[:5]) + (", …" if len(others) > 5 else ""))
        return ours

    def _taken(self, shard: int, state: ShardState) -> frozenset[str] | None:
        """A take-over's first confirmation: the lease of ``state.epoch`` renewed, and the topics its
        row names; None (the shard ``lost``) when it is another relay's."""
        recorded = self._lease.taken(shard, state.epoch)
        if recorded is None:
            self._lost(shard, state)
        return recorded

    def _confirmed(self, shard: int, state: ShardState, *, settled: bool = False) -> bool:
        """The lease of ``state.epoch`` renewed (``settled``: its row's topics emptied, what they may
        have left open ended); when it is another relay's, the shard is ``lost``."""
        if (self._lease.settled if settled else self._lease.confirm)(shard, state.epoch):
            return True
        self._lost(shard, state)
        return False

    def _lost(self, shard: int, state: ShardState) -> None:
        state.lost = True
        log.warning("%s no longer holds shard %d's lease of epoch %d: it makes no producer of the shard "
                    "(which would fence the new owner's) and sends nothing more of it",
                    self._name, shard, state.epoch)


def take_turns(due: list[int], owned: dict[int, ShardState]) -> list[int]:
    """The shards of ``due`` whose take-overs start now: every one not held, and of the held ones
    (tried again after ``HELD_AGAIN``) as many as keep ``HELD_AT_ONCE`` of them under way."""
    room = HELD_AT_ONCE - sum(1 for state in owned.values() if state.taking is not None and state.held_until)
    turns = []
    for shard in due:
        if owned[shard].held_until:
            if room <= 0:
                continue
            room -= 1
        turns.append(shard)
    return turns


def await_one(taking: list[Future[bool]], timeout: float, stopping: threading.Event | None = None) -> None:
    """Wait until one of the take-overs ``taking`` made its shard ready (then ``TAKE_OVER_GRACE``
    more for the others) or all ended, ``timeout`` seconds at most (a batch with no shard ready), or
    until ``stopping`` is set (a stop is not held for a take-over)."""
    deadline = time.monotonic() + timeout
    pending = set(taking)
    while pending and time.monotonic() < deadline and not (stopping is not None and stopping.is_set()):
        done, pending = wait(pending, timeout=min(STOP_LOOK, deadline - time.monotonic()),
                             return_when=FIRST_COMPLETED)
        if any(f.exception() is None and f.result() for f in done):
            wait(pending, timeout=TAKE_OVER_GRACE)
            return


def answered_held(state: ShardState) -> bool:
    """Whether the shard's take-over ended held by an open transaction with every request of it answered
    (``HeldByOpenTransactionError.answered``)."""
    taking = state.taking
    if taking is None or not taking.done():
        return False
    error = taking.exception()
    return isinstance(error, HeldByOpenTransactionError) and error.answered


def held(state: ShardState, shard: int, error: HeldByOpenTransactionError, name: str) -> None:
    """The shard's producer could not be made, held by an open transaction (``HeldByOpenTransactionError``):
    its rows wait, tried again in ``HELD_AGAIN`` s; logged once a cause until a take-over succeeds. No broker
    outage: the broker answers, and the transaction ends by its producer or at its timeout."""
    if state.stuck_by is not type(error):  # None until one failed, and after one succeeded
        log.warning("%s cannot take shard %d over yet (%s): its rows wait, the other shards send on, and "
                    "the take-over is tried again every %g s until that transaction ends",
                    name, shard, error, HELD_AGAIN)
    state.stuck, state.stuck_by = str(error), type(error)
    state.held_until = time.monotonic() + HELD_AGAIN


def settle_take_overs(owned: dict[int, ShardState], name: str) -> str | None:
    """Settle the shards' take-overs that ended; the broker's error if one failed for want of it.

    A take-over holds only its shard: one the broker failed (``init_transactions`` timed
    out, a progress read that could not be done) is logged once per shard and cause (the
    failure's class: its message changes with every offset), until one of it succeeds, and
    tried again at the next batch while the other shards send. One held by an open
    transaction (its settle, or its progress read: ``HeldByOpenTransactionError``) is no
    broker's failure: logged once a cause (``held``), tried again after ``HELD_AGAIN`` s, not
    returned. The database's first failure is raised once every ended take-over is settled
    (the step reports it).
    """
    error: str | None = None
    raised: BaseException | None = None
    for shard, state in sorted(owned.items()):
        if state.taking is None or not state.taking.done():
            continue
        failure, state.taking = state.taking.exception(), None
        if isinstance(failure, NoProducerSlot):
            continue  # no broker's fault: logged once for the fleet (``ProducerSlots.take``)
        if failure is None:
            if state.stuck is not None and not state.lost:  # lost: the lease is another's (logged)
                log.info("%s took shard %d over after all; it sends again", name, shard)
            state.stuck, state.stuck_by, state.held_until = None, None, 0.0
        elif isinstance(failure, HeldByOpenTransactionError):
            held(state, shard, failure, name)
        elif isinstance(failure, RetriableTransportError):
            if state.stuck_by is not type(failure):  # once a cause, not a message
                log.warning("%s cannot take shard %d over yet (%s): its rows wait, the other shards "
                            "send on, and the take-over is tried again at each batch", name, shard, failure)
            state.stuck = error = str(failure)
            state.stuck_by, state.held_until = type(failure), 0.0
        elif isinstance(failure, Exception):
            raised = raised or failure
        else:
            raised = failure  # not an error (KeyboardInterrupt, SystemExit): raised at once
            break
    if raised is not None:
        try:
            raise raised
        finally:
            # This frame joins the exception's traceback: holding it here too, it would hold itself (a
            # cycle), and with it the take-over's frames (the producer it made, a librdkafka client)
            # until the cycle collector ran, not until the step's report dropped it.
            raised = failure = None
    return error
