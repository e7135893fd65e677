"""``Sharing``: what the exactly-once sending of a tenant fleet's steps shares, so it stays bounded.

A single relay's ``ExactlyOnce`` keeps a producer per owned shard and a thread
pool of its own for as long as it runs. A fleet of 500 tenants of 16 shards
would hold 8,000 producers (each a librdkafka client: threads, sockets,
buffers) and 500 pools. With ``Sharing`` every step's shard transactions and
take-overs run on the fleet's one pool, and a shard's producer that sent
nothing for ``idle_after`` seconds is closed: its next batch makes one of the
same id again (``init_transactions``, fencing nothing alive) and reads the
shard's progress again before it sends (``ExactlyOnce._unpark``).
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass


@dataclass(frozen=True)
class Sharing:
    """A fleet's steps' one pool (shard transactions, take-overs), and seconds a producer may idle."""

    pool: Executor
    idle_after: float

    @staticmethod
    def progress_topic(base: str, incarnation: str) -> str:
        """Each outbox's own: no other's open transaction holds back its take-over's read_committed read."""
        return f"{base}-{incarnation}"
