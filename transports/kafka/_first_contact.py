"""A producer's first record to a partition goes alone: the broker checks order only after it.

Apache Kafka takes a producer id's first batch on a partition at any sequence
number (``_implied``). Pipelined, a new producer's first request to a partition
refused for a passing reason (the topic just created, a leader moving) lets the
request behind it be written first: a key's later record lands ahead of its
earlier one, and the earlier one, reported delivered without an offset, is sent
again behind it (``_implied``). The inbox puts such a key back in order; a plain
consumer would not. So before a batch is pipelined, each partition this producer
has not written to lately gets one of the batch's records sent alone, and the
batch's other records for it go once that one is written: from then on the broker
refuses any request out of sequence and librdkafka retries in order.

"Lately": a broker forgets a producer id on a partition ``producer.id.expiration.ms``
(a day by default) after its last write there, or once retention deleted all it
wrote there. A partition this producer has not written to for ``PROVEN_FOR``
seconds is contacted afresh; one round trip more for a partition that quiet.
"""

from __future__ import annotations

PROVEN_FOR = 300.0
"""Seconds a write to a partition vouches for the broker still knowing the producer there."""

NOT_FIRST = "not sent: its partition's first record from this producer was not written"


class WrittenPartitions:
    """Where a producer's records were written lately: (topic, partition) -> when, monotonic."""

    def __init__(self) -> None:
        self._at: dict[tuple[str, int], float] = {}

    def proven(self, where: tuple[str, int], now: float) -> bool:
        at = self._at.get(where)
        return at is not None and now - at < PROVEN_FOR

    def note(self, where: tuple[str, int], now: float) -> None:
        self._at[where] = now

    def clear(self) -> None:
        """A new producer id: the broker knows it nowhere yet."""
        self._at.clear()
