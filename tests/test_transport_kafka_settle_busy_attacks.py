"""Attacks on the settle's wait for its own abort marker (``KafkaTransactionalProducer._end_open``)
on a busy data topic, on the session's Apache Kafka.

A settle forgets a partition only once its last stable offset (read_committed) is past the settle's
empty record. The last stable offset of a partition is the first offset of the oldest transaction
open there, whoever's: another producer's transaction open there since before the empty record
holds it below, though the settle's own abort marker is written. Without DescribeProducers (KIP-664)
that cannot be told from the id's own marker dropped, so the shard must not commit there until it
reads past; what the settle says, and how soon it gives up and goes on, is what is tested here.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import pytest
from _kafka_transactions import stable_and_end, wait_until
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox import HeldByOpenTransactionError, RetriableTransportError
from transports import Record, TransactionOutcome
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TIMEOUT = 10.0  # the transport's delivery_timeout: a held settle gives up well before it


@dataclass
class Busy:
    """A shard id whose transaction was aborted, and another producer's transaction open since on the
    data partition that transaction wrote."""

    tid: str
    data: str
    progress: str
    transport: KafkaTransport
    other: Producer
    admin: AdminClient
    first: int
    """The offset of the other transaction's first record on the data partition."""


@pytest.fixture
def busy(kafka: str) -> Iterator[Busy]:
    run = uuid.uuid4().hex[:8]
    tid = f"outbox-settle-busy-{run}-0"
    data, progress, refusing = (f"settle-busy-data-{run}", f"settle-busy-progress-{run}",
                                f"settle-busy-refusing-{run}")
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    for future in admin.create_topics([
            NewTopic(data, 1, 1), NewTopic(progress, 1, 1, config={"cleanup.policy": "compact"}),
            NewTopic(refusing, 1, 1, config={"max.message.bytes": "256"})]).values():
        future.result(30)
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=TIMEOUT)
    other = Producer({"bootstrap.servers": kafka, "transactional.id": f"another-app-{run}",
                      "transaction.timeout.ms": 300_000, "log_level": 0})
    try:
        first = transport.transactional(tid, TIMEOUT)
        answer = first.send([Record(data, b"row-0", key=b"a", partition=0),
                             Record(refusing, os.urandom(2000), key=b"big", partition=0),
                             Record(progress, b"progress", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        first.close()
        other.init_transactions(30)
        other.begin_transaction()
        offsets: list[int] = []
        other.produce(data, b"another producer's row, its transaction long", b"c", 0,
                      on_delivery=lambda error, message: offsets.append(message.offset()))
        assert other.flush(10) == 0 and len(offsets) == 1
        yield Busy(tid, data, progress, transport, other, admin, offsets[0])
    finally:
        with_other_aborted(other)
        transport.close()
        admin.delete_topics([data, progress, refusing])


def test_a_settle_held_by_another_producers_transaction_says_so_and_goes_on_once_it_ends(
        busy: Busy, kafka: str) -> None:
    """A shard's transaction is aborted (a record refused for good); meanwhile another producer of
    the data topic (another shard whose broker is slow, or an application with long transactions:
    a Flink sink holds one open for a whole checkpoint interval, minutes) has a transaction open on
    the same partition. The shard's next producer settles: its empty record is written and aborted,
    its marker written, but the partition's last stable offset stays at the other transaction's
    first record. The settle raises ``HeldByOpenTransactionError`` (no broker outage), naming the
    partition, its last stable offset and the settle's record, and both possible causes; it gives up
    well within the producer's timeout (not holding its caller's thread for all of it at each try).
    Once the other transaction ends, the next settle succeeds at once and the shard's row is
    committed once (read_committed)."""
    stable, end = stable_and_end(busy.admin, busy.data, 0)
    assert stable < end, "the other transaction is not open on the data partition"
    started = time.monotonic()
    with pytest.raises(HeldByOpenTransactionError) as held:
        busy.transport.transactional(busy.tid, TIMEOUT)
    took = time.monotonic() - started
    message = str(held.value)
    assert isinstance(held.value, RetriableTransportError)  # retried, by those who know only that
    # Held at the other transaction's first record; the settle's own record after everything before it.
    said = re.search(rf"{busy.data}\[0\] has its last stable offset at {busy.first}, below the empty record "
                     rf"the settle aborted at offset (\d+): either another producer's transaction has been "
                     rf"open there since before offset (\d+)", message)
    assert said is not None, message
    assert int(said[1]) == int(said[2]) >= end > busy.first
    assert "or the broker dropped this id's own abort marker there" in message
    assert "transaction.timeout.ms" in message
    assert f"abort --topic {busy.data} --partition 0 --start-offset {busy.first}" in message
    assert "may have dropped its marker" not in message
    assert took < TIMEOUT, f"a held settle took {took:.1f} s, the producer's whole timeout"
    # Still held at the next try: the shard commits nothing there meanwhile.
    with pytest.raises(HeldByOpenTransactionError):
        busy.transport.transactional(busy.tid, TIMEOUT)

    busy.other.abort_transaction(30)
    started = time.monotonic()
    taker = busy.transport.transactional(busy.tid, TIMEOUT)
    took = time.monotonic() - started
    try:
        assert took < TIMEOUT, f"the settle took {took:.1f} s once the other transaction ended"
        answer = taker.send([Record(busy.data, b"row-0", key=b"a", partition=0),
                             Record(busy.progress, b"progress", key=busy.tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.COMMITTED, answer
    finally:
        taker.close()
    on_wire = read_topic(kafka, busy.data, expected=1, settle=1.0, isolation="read_committed")
    assert [r.value for r in on_wire] == [b"row-0"]  # once: not the aborted copy, nor the other's row


def with_other_aborted(other: Producer) -> None:
    """End the other producer's transaction (best effort), so nothing is held after the test."""
    with suppress(KafkaException):
        other.abort_transaction(10)
    other.flush(1)


def test_a_settle_whose_other_transaction_ends_during_its_wait_goes_on_in_the_same_try(busy: Busy) -> None:
    """The other producer's transaction is aborted right after the settle's empty record landed on
    the data partition (the settle then waits for the last stable offset): that same settle sees the
    offset move past its record and succeeds, no ``HeldByOpenTransactionError``."""
    _, end = stable_and_end(busy.admin, busy.data)
    made: list[Any] = []
    failed: list[Exception] = []

    def settle() -> None:
        try:
            made.append(busy.transport.transactional(busy.tid, TIMEOUT))
        except RetriableTransportError as exc:
            failed.append(exc)

    thread = threading.Thread(target=settle, daemon=True)
    thread.start()
    wait_until(lambda: stable_and_end(busy.admin, busy.data)[1] > end, 30, "the settle's empty record")
    busy.other.abort_transaction(30)
    thread.join(30)
    assert failed == [] and len(made) == 1, failed
    answer = made[0].send([Record(busy.data, b"row-0 again", key=b"a", partition=0),
                           Record(busy.progress, b"progress", key=busy.tid.encode(), partition=0)])
    assert answer.outcome is TransactionOutcome.COMMITTED, answer
    made[0].close()
