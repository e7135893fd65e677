"""``Sharing``: what the exactly-once sending of a tenant fleet's steps shares, so it stays bounded.

A single relay's ``ExactlyOnce`` keeps a producer per owned shard and a thread
pool of its own for as long as it runs. A fleet of 500 tenants of 16 shards
would hold 8,000 producers (each a librdkafka client: threads, sockets,
buffers) and 500 pools. With ``Sharing`` every step's shard transactions and
take-overs run on the fleet's one pool, and a shard's producer that sent
nothing for ``idle_after`` seconds is closed: its next batch makes one of the
same id again (``init_transactions``, fencing nothing alive) and reads the
shard's progress again before it sends (``ProducerMaker.make``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core._errors import ConfigurationError
from ..core._validation import validate_topic
from ._writer import DaemonPool

MAX_TOPIC_LENGTH = 249


INCARNATION_SUFFIX = 37
"""Characters a tenant's progress topic adds to the fleet's: ``-`` and the 36 of a UUID."""


@dataclass(frozen=True)
class Sharing:
    """A fleet's steps' one pool (shard transactions, take-overs), seconds a producer may idle, and
    the ``progress_topic`` each outbox's own is named after (checked here: refused before any starts)."""

    pool: DaemonPool
    idle_after: float
    progress_topic: str

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
