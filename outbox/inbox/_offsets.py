"""Which broker offsets may be committed: up to the lowest one not yet finished.

Records of one partition finish out of order (different keys run in
parallel), but a Kafka commit means "everything before this offset is done".
So per partition we keep the offsets received and not finished, in order, and
commit the first of them; when none is open, one past the highest received.
A crash therefore replays at most the unfinished tail, and the inbox drops
what it had already applied as duplicates. Safe to use from several threads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

TopicPartition = tuple[str, int]


@dataclass(slots=True)
class _Partition:
    open: deque[int] = field(default_factory=deque)
    finished: set[int] = field(default_factory=set)
    next_offset: int = 0
    committed: int | None = None

    def position(self) -> int:
        return self.open[0] if self.open else self.next_offset


class OffsetTracker:
    """Open and finished offsets per partition; ``committable()`` is what may be committed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partitions: dict[TopicPartition, _Partition] = {}

    def received(self, positions: Iterable[tuple[TopicPartition, int]]) -> None:
        """Offsets handed to the workers, in the order each partition delivered them."""
        with self._lock:
            for tp, offset in positions:
                part = self._partitions.get(tp)
                if part is None:
                    part = self._partitions[tp] = _Partition()
                part.open.append(offset)
                if offset >= part.next_offset:
                    part.next_offset = offset + 1

    def finished(self, positions: Iterable[tuple[TopicPartition, int]]) -> None:
        """Mark offsets done (their database transaction committed); unknown partitions are ignored."""
        with self._lock:
            touched = set()
            for tp, offset in positions:
                part = self._partitions.get(tp)
                if part is not None:
                    part.finished.add(offset)
                    touched.add(tp)
            for tp in touched:
                part = self._partitions[tp]
                while part.open and part.open[0] in part.finished:
                    part.finished.discard(part.open.popleft())

    def committable(self, only: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Positions that moved since the last ``committed()``: "all before this is done"."""
        with self._lock:
            wanted = self._partitions.keys() if only is None else set(only) & self._partitions.keys()
            result = {}
            for tp in wanted:
                part = self._partitions[tp]
                position = part.position()
                if position != part.committed and (part.open or part.next_offset):
                    result[tp] = position
            return result

    def is_open(self, tp: TopicPartition, offset: int) -> bool:
        """True while ``offset`` of ``tp`` was received and is neither finished nor forgotten."""
        with self._lock:
            part = self._partitions.get(tp)
            return (part is not None and bool(part.open) and part.open[0] <= offset < part.next_offset
                    and offset not in part.finished)

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        with self._lock:
            for tp, offset in offsets.items():
                if tp in self._partitions:
                    self._partitions[tp].committed = offset

    def lag(self) -> dict[TopicPartition, int]:
        """Per partition: records received but not yet covered by a commit."""
        with self._lock:
            return {tp: part.next_offset - (part.committed if part.committed is not None
                                            else (part.open[0] if part.open else part.next_offset))
                    for tp, part in self._partitions.items()}

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop partitions that were revoked; a later assignment starts afresh."""
        with self._lock:
            for tp in tps:
                self._partitions.pop(tp, None)
