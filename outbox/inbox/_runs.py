"""A key's run: the consecutive messages of one key that one transaction applies.

The scheduler hands a transaction up to ``batch_size`` deliveries, several of
one key when that key is busy. ``Lanes`` sorts them into a queue per key, in
seq order, or in arrival order for a key's unnumbered messages (an unkeyed
delivery is a lane of its own). The transaction step
walks each queue from its head and takes, as the key's *run*, the messages
that follow one another without a gap: they are claimed in one statement,
handled one by one and advance the key once. Whatever breaks a run (a gap, a
second copy of a message in it, a message to park) is looked at again in the
next round of the same transaction, against the key's state after the run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ._delivery import Delivery, KeyedDelivery, KeyId, Lane, OrderedDelivery, lane_of


def _seq(d: Delivery) -> int:
    return d.seq if isinstance(d, OrderedDelivery) else 0


class Lanes:
    """One transaction's deliveries, a queue per key in seq order; for one thread."""

    def __init__(self, deliveries: Iterable[Delivery]) -> None:
        queues: dict[Lane, list[Delivery]] = {}
        for d in deliveries:
            lane = lane_of(d)
            if (queue := queues.get(lane)) is None:
                queues[lane] = [d]
            else:
                queue.append(d)
        # sorted() is stable: copies of one message keep their arrival order.
        self._queues = {lane: deque(sorted(queue, key=_seq) if len(queue) > 1 else queue)
                        for lane, queue in queues.items()}

    def keys(self) -> list[KeyId]:
        """The keys among the lanes, to lock (a key without seqs too: its parked flag counts)."""
        return [queue[0].lane for queue in self._queues.values()
                if queue and isinstance(queue[0], KeyedDelivery)]

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def queues(self) -> list[deque[Delivery]]:
        """The lanes that still hold deliveries; the empty ones are dropped."""
        self._queues = {lane: queue for lane, queue in self._queues.items() if queue}
        return list(self._queues.values())

    def push_front(self, deliveries: Iterable[Delivery]) -> None:
        """Put ``deliveries`` back for the next round, each among its key's in seq order."""
        for d in deliveries:
            lane = lane_of(d)
            self._queues[lane] = deque(sorted([d, *self._queues.get(lane, ())], key=_seq))

    def stop(self, d: Delivery) -> list[Delivery]:
        """Take out what is left of ``d``'s lane: it waits for ``d``, which failed."""
        return list(self._queues.pop(lane_of(d), ()))
