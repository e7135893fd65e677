"""Whether a transaction ended on its partitions: their last stable offsets, read committed.

The coordinator answers a commit or an abort once it decided it, and writes the markers after;
a marker it drops leaves the partition's records open (``_transactions``' module doc). So a
commit is reported committed, and a settle taken for done, only once each partition's last
stable offset is past the transaction's record there. ``StableOffsets`` asks that through the
transport's admin client, replacing a client whose requests fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

FLUSH_STEP = 0.2
"""Seconds between looks at the reports while a transaction's records are sent, and the longest
step between two looks at the last stable offsets."""

DECIDED_FIRST_STEP = 0.002
"""Seconds before a committed transaction's partitions are asked again whether it ended there (doubling
up to ``FLUSH_STEP``): the coordinator writes the markers just after it answers the commit."""

ADMIN_RENEWAL = 1.0
"""Seconds at least between two admin clients a producer has made anew after failed reads."""



class StableOffsets:
    """A producer's reads of last stable offsets. ``admin`` is its transport's shared admin client
    (given the one that failed, a new one). Not safe for several threads (one producer's)."""

    def __init__(self, admin: Callable[[AdminClient | None], AdminClient]) -> None:
        self._admin = admin
        self._renewed = 0.0

    def past(self, offsets: Mapping[tuple[str, int], int], deadline: float, *,
             held_for: float | None = None) -> tuple[dict[tuple[str, int], int | None], str | None]:
        """Wait until each partition's last stable offset (read committed) is past its offset in
        ``offsets`` (the transaction there ended), at most until ``deadline``; the partitions still
        not past it (none: all are), each with its last stable offset last read (None: never read),
        and why, if it is not only that the offset is not past it yet.

        ``held_for``: give up sooner, once every partition left was read and none of their last
        stable offsets moved for that long (held by an open transaction, ``_held``).

        An unread offset is not past it. A client whose request failed is replaced (at most one a
        second, ``_client``): its metadata from before a broker's restart can fail every
        request. ``future.result`` raises concurrent.futures' bare ``TimeoutError`` (not a
        ``KafkaException``) when the broker answers only at its request timeout (gone or frozen right
        after it answered, or a leader the client still names was killed): it once escaped ``send``,
        and the shard's producer then sent the rows again in a transaction that committed what this
        one left open.
        """
        pending = dict(offsets)
        stable: dict[tuple[str, int], int] = {}
        moved = time.monotonic()
        step = DECIDED_FIRST_STEP
        failed: AdminClient | None = None
        while True:
            why: str | None = None
            admin = None
            try:
                admin = self._client(failed)
                failed = None
                asked = admin.list_offsets({TopicPartition(t, p): latest_offset() for t, p in pending},
                                           isolation_level=IsolationLevel.READ_COMMITTED,
                                           request_timeout=max(0.1, deadline - time.monotonic()))
                for tp, future in asked.items():
                    where = (tp.topic, tp.partition)
                    try:
                        offset = future.result(max(0.1, deadline - time.monotonic())).offset
                    except KafkaException as exc:  # unread there (no leader, or the client's view is old)
                        why = f"its last stable offset cannot be read: {exc.args[0].str()}"
                        failed = admin
                        continue
                    if offset > pending[where]:
                        del pending[where]
                    elif stable.get(where) != offset:
                        stable[where], moved = offset, time.monotonic()
            except KafkaException as exc:
                why = f"its last stable offset cannot be read: {exc.args[0].str()}"
                failed = admin
            except TimeoutError:
                why = "its last stable offset cannot be read: no answer in time"
                failed = admin
            if not pending:
                return {}, None
            now = time.monotonic()
            held = (held_for is not None and why is None and now - moved >= held_for
                    and all(where in stable for where in pending))
            if held or now + step >= deadline:
                return {where: stable.get(where) for where in sorted(pending)}, why
            time.sleep(step)
            step = min(2 * step, FLUSH_STEP)

    def _client(self, failed: AdminClient | None) -> AdminClient:
        """The admin client to ask; after ``failed`` failed, a new one (at most one a second): a client's
        metadata from before a broker's restart can fail every request (``FENCED_LEADER_EPOCH``)."""
        if failed is not None and time.monotonic() - self._renewed >= ADMIN_RENEWAL:
            self._renewed = time.monotonic()
        else:
            failed = None
        return self._admin(failed)


def latest_offset() -> Any:
    """``OffsetSpec.latest()``: a partition's end (its last stable offset, read committed)."""
    return OffsetSpec.latest()  # type: ignore[no-untyped-call]  # confluent_kafka leaves it untyped
