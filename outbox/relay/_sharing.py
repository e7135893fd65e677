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
shard's take-over waits for a slot (tried again at each of its tenant's
batches), and while shards wait, producers idle for ``PRESSED_IDLE_AFTER``
seconds are closed to make room.
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

PRESSED_IDLE_AFTER = 1.0
"""Seconds a shard producer may idle while another shard waits for a slot, before it is closed."""

PRESSED_FOR = 5.0
"""Seconds after a refused slot during which the slots count as pressed (``ProducerSlots.pressed``)."""


class NoProducerSlot(RetriableTransportError):
    """Every slot is taken: the shard's take-over is tried again at its tenant's next batch."""


class ProducerSlots:
    """How many shard producers are open in the fleet, at most ``limit``; thread-safe.

    ``take`` a slot before making a producer, and the producer ``held`` gives
    it back when it is closed, once: closing is the only way a producer ends,
    so the count cannot drift from the producers open. The first refusal is
    logged, and the end of the shortage once slots are free again.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not limit >= 1:
            raise ConfigurationError(f"max_shard_producers must be an int of at least 1, got {limit!r}")
        self.limit = limit
        self._open = 0
        self._refused_at: float | None = None
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        return self._open

    def pressed(self) -> bool:
        """Whether a shard was refused a slot in the last ``PRESSED_FOR`` seconds."""
        refused = self._refused_at
        return refused is not None and time.monotonic() - refused < PRESSED_FOR

    def take(self) -> None:
        """One slot, or ``NoProducerSlot``."""
        with self._lock:
            if self._open < self.limit:
                self._open += 1
                return
            first = self._refused_at is None
            self._refused_at = time.monotonic()
        if first:
            log.warning("the fleet holds %d shard producers open, its max_shard_producers: shards taken "
                        "now wait for one to close (producers idle for %.0f s close while they wait)",
                        self.limit, PRESSED_IDLE_AFTER)
        raise NoProducerSlot(f"all {self.limit} shard producer slots are taken (max_shard_producers)")

    def give_back(self) -> None:
        with self._lock:
            self._open -= 1
            ended = self._refused_at is not None and self._open <= self.limit // 2
            if ended:
                self._refused_at = None
        if ended:
            log.info("the fleet's shard producers are down to %d of %d: no shard waits for a slot",
                     self._open, self.limit)

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
