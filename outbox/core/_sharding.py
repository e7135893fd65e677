"""Stable hashing: the same key lands on the same shard and partition everywhere.

The partitioner itself (Kafka's Java ``murmur2``) lives in ``transports``, the
lowest layer that needs it; the relay shard of a key uses the same hash.
"""

from __future__ import annotations

import random

from transports._partitioner import murmur2 as murmur2
from transports._partitioner import partition_for_key as partition_for_key


def shard_for_key(key: str | None, shards: int) -> int:
    """The relay shard of a message: stable per key; unkeyed messages spread at random."""
    if key is None:
        return random.randrange(shards)
    return partition_for_key(key.encode(), shards)
