"""``Sharing``: what the exactly-once sending of a tenant fleet's steps shares, so it stays bounded.

A single relay's ``ExactlyOnce`` keeps a producer per owned shard and a thread
pool of its own for as long as it runs. A fleet of 500 tenants of 16 shards
would hold 8,000 producers (each a librdkafka client: threads, sockets,
buffers) and 500 pools. With ``Sharing`` every step's shard transactions and
take-overs run on the fleet's one pool, and a shard's producer that sent
nothing for ``idle_after`` seconds is closed: its next batch makes one of the
same id again (``init_transactions``, fencing nothing alive) and reads the
shard's progress again before it sends (``ProducerMaker.make``).

Closing idle producers bounds them only as far as the tenants go quiet: a
fleet whose tenants all send at once would still take a producer per shard.
A process cannot hold that many: each confluent-kafka client takes one of the
process's 1,024 thread-local keys (``pthread_key_create``), and the 1,013th
client made in one process fails with "Failed to initialize thread local
storage" whoever makes it, the fleet's plain producers and an inbox's
consumer included; each also runs three or four librdkafka threads. So the
fleet's shard producers count against ``ProducerSlots``: past its limit a
shard's take-over waits for a slot in a queue, first come first served (tried
again at each of its tenant's batches), and while shards wait, producers idle
for ``PRESSED_IDLE_AFTER`` seconds or kept for ``PRESSED_TURN`` are closed to
make room: their shards queue again (``ExactlyOnce._park_idle``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from transports import Record, TransactionalProducer, TransactionResult
from transports._errors import RetriableTransportError
from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError
from ..core._validation import validate_topic
from ._writer import DaemonPool

log = safe_logger("outbox.relay")

MAX_TOPIC_LENGTH = 249


INCARNATION_SUFFIX = 37
"""Characters a tenant's progress topic adds to the fleet's: ``-`` and the 36 of a UUID."""


DEFAULT_MAX_SHARD_PRODUCERS = 500
"""Shard producers a fleet's process holds open at most: half the clients a process can make, the
rest left for its other clients (its plain producers, the take-overs' progress readers, an inbox)."""

MOST_SHARD_PRODUCERS = 900
"""The highest ``max_shard_producers`` taken: a process makes about 1,012 clients, and needs some."""

PRESSED_IDLE_AFTER = 1.0
"""Seconds a shard producer may idle while another shard waits for a slot, before it is closed."""

PRESSED_TURN = 10.0
"""Seconds a shard producer is kept, busy or not, while another shard waits for a slot: then it is
closed between two batches, and its shard queues for a slot again (``ExactlyOnce._park_idle``)."""

WAITER_EXPIRY = 60.0
"""Seconds a shard keeps its place in the queue for a slot without asking again (a shard that stopped
waiting, its tenant removed or its lease lost, must not hold up the others)."""


class NoProducerSlot(RetriableTransportError):
    """No slot for this shard now: its take-over is tried again at its tenant's next batch, in turn."""


class ProducerSlots:
    """How many shard producers are open in the fleet, at most ``limit``, and the shards waiting for
    one, first come first served; thread-safe.

    ``take(who)`` a slot before making a producer, and the producer ``held``
    gives it back when it is closed, once: closing is the only way a producer
    ends, so the count cannot drift from the producers open. A shard refused
    joins the queue (``who``: its transactional id) and is served before any
    shard that asks later; one that does not ask again within
    ``WAITER_EXPIRY`` loses its place. While shards wait the slots are
    ``pressed``: producers are then closed sooner (``Sharing.idle_limit``) and
    taken turns at (``PRESSED_TURN``). The start and the end of a shortage are
    logged, once each.
    """

    def __init__(self, limit: int) -> None:
        if (isinstance(limit, bool) or not isinstance(limit, int)
                or not 1 <= limit <= MOST_SHARD_PRODUCERS):
            raise ConfigurationError(
                f"max_shard_producers must be an int from 1 to {MOST_SHARD_PRODUCERS}, got {limit!r:.40} "
                f"(a process holds about 1,000 confluent-kafka clients: more processes serve more shards)")
        self.limit = limit
        self._open = 0
        self._waiting: dict[str, float] = {}  # who -> when it last asked, in the order they came
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        return self._open

    def pressed(self) -> bool:
        """Whether a shard waits for a slot."""
        with self._lock:
            return bool(self._live_waiters())

    def take(self, who: str) -> None:
        """A slot for ``who``, or ``NoProducerSlot`` (``who`` then waits in the queue)."""
        with self._lock:
            waiters = self._live_waiters()
            free = self.limit - self._open
            ahead = waiters.index(who) if who in self._waiting else len(waiters)
            if ahead < free:
                self._open += 1
                ended = self._waiting.pop(who, None) is not None and not self._waiting
            else:
                began, self._waiting[who] = not self._waiting, time.monotonic()
        if ahead < free:
            if ended:
                log.info("the fleet's shard producers: no shard waits for a slot any more (%d of %d open)",
                         self._open, self.limit)
            return
        if began:
            log.warning("the fleet holds %d shard producers open, its max_shard_producers: the shards taken "
                        "now wait their turn (while they wait, producers idle for %.0f s or open for %.0f s "
                        "are closed)", self.limit, PRESSED_IDLE_AFTER, PRESSED_TURN)
        raise NoProducerSlot(f"all {self.limit} shard producer slots are taken (max_shard_producers): "
                             f"{len(self._waiting)} shards wait")

    def _live_waiters(self) -> list[str]:
        """The shards waiting, first come first; those that stopped asking dropped (under the lock)."""
        stale = time.monotonic() - WAITER_EXPIRY
        for who in [w for w, asked in self._waiting.items() if asked < stale]:
            del self._waiting[who]
        return list(self._waiting)

    def give_back(self) -> None:
        with self._lock:
            self._open -= 1

    def held(self, producer: TransactionalProducer) -> TransactionalProducer:
        """``producer``, which gives its slot back when it is closed."""
        return _Slotted(producer, self)


class _Slotted:
    """A shard producer holding a slot of ``ProducerSlots`` until it is closed."""

    def __init__(self, producer: TransactionalProducer, slots: ProducerSlots) -> None:
        self._producer, self._slots = producer, slots
        self._closed = False
        self._lock = threading.Lock()

    def send(self, records: Sequence[Record]) -> TransactionResult:
        return self._producer.send(records)

    def close(self) -> None:
        with self._lock:
            closed, self._closed = self._closed, True
        if closed:
            return
        try:
            self._producer.close()
        finally:
            self._slots.give_back()


@dataclass(frozen=True)
class Sharing:
    """A fleet's steps' one pool (shard transactions, take-overs), seconds a producer may idle, the
    ``progress_topic`` each outbox's own is named after (checked here: refused before any starts), and
    the slots of its shard producers."""

    pool: DaemonPool
    idle_after: float
    progress_topic: str
    slots: ProducerSlots = field(default_factory=lambda: ProducerSlots(DEFAULT_MAX_SHARD_PRODUCERS))

    def idle_limit(self) -> float:
        """Seconds a shard producer may idle now: ``idle_after``, less while shards wait for a slot."""
        return min(self.idle_after, PRESSED_IDLE_AFTER) if self.slots.pressed() else self.idle_after

    def turn_limit(self) -> float | None:
        """Seconds a shard producer may be kept at all now: ``PRESSED_TURN`` while shards wait, else None."""
        return PRESSED_TURN if self.slots.pressed() else None

    def __post_init__(self) -> None:
        validate_topic(self.progress_topic)
        if len(self.progress_topic) > MAX_TOPIC_LENGTH - INCARNATION_SUFFIX:
            raise ConfigurationError(
                f"progress_topic {self.progress_topic!r:.80} has {len(self.progress_topic)} characters: each "
                f"tenant's adds -<incarnation> ({INCARNATION_SUFFIX}), so a fleet's has at most "
                f"{MAX_TOPIC_LENGTH - INCARNATION_SUFFIX}")

    def topic_for(self, incarnation: str) -> str:
        """Each outbox's own: no other's open transaction holds back its take-over's read_committed read."""
        return f"{self.progress_topic}-{incarnation}"
