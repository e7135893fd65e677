"""A row is never sent to a progress topic in exactly-once mode (issue 36 attack): without a broker.

Keyed by a shard's transactional id, such a row would be that shard's last committed progress and a
take-over would mark the rows it names published without sending them (the broker proof:
``test_relay_exactly_once_attacks.py::…a_row_addressed_to_the_progress_topic…``). In a fleet every
tenant's progress topic is ``<progress_topic>-<incarnation>``: a row of one tenant addressed to
another's could forge that one's progress.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from outbox.relay._exactly_once import ExactlyOnce
from outbox.relay._sharing import Sharing
from outbox.relay._writer import DaemonPool
from transports import Outcome, Record
from transports.kafka import KafkaTransport


class AnyLease:
    """Every lease held, nothing recorded (``ShardLease``): these tests send nothing."""

    def confirm(self, shard: int, epoch: int) -> bool:
        return True

    def taken(self, shard: int, epoch: int) -> frozenset[str] | None:
        return frozenset()

    def settled(self, shard: int, epoch: int) -> bool:
        return True

    def widen(self, wanted: Mapping[int, tuple[int, Collection[str]]]) -> set[int]:
        return set(wanted)


def step(sharing: Sharing | None, progress_topic: str) -> ExactlyOnce:
    transport = KafkaTransport(bootstrap_servers="127.0.0.1:1", delivery_timeout=1.0)
    return ExactlyOnce(transport, incarnation="inc", worker_id="w", shards=2, progress_topic=progress_topic,
                       mark=lambda *_: True, messages=lambda _: {}, lease=AnyLease(), sharing=sharing)


def test_a_row_to_the_relays_progress_topic_fails_alone_and_is_not_sent() -> None:
    eo = step(None, "progress")
    rows = [Record("progress", b'{"ids": [2, 3]}', key=b"outbox-inc-1"), Record("orders", b"{}", key=b"k")]
    results = eo.send(rows, [(1, 0), (2, 1)])  # neither shard taken: the other row waits
    assert results[0].outcome is Outcome.FAILED and "progress topic" in (results[0].error or "")
    assert results[1].outcome is Outcome.RETRY


def test_in_a_fleet_a_row_to_any_tenants_progress_topic_is_refused() -> None:
    pool = DaemonPool("test-reserved", 1)
    try:
        eo = step(Sharing(pool, 60.0, "outbox-progress"), "outbox-progress-inc")
        assert eo.is_progress_topic("outbox-progress-inc")
        assert eo.is_progress_topic("outbox-progress-2b1f0c7e-other-tenant")
        assert eo.is_progress_topic("outbox-progress")  # a single relay's default
        assert not eo.is_progress_topic("outbox-progressive")
        assert not eo.is_progress_topic("orders")
    finally:
        pool.shutdown(timeout=0)
