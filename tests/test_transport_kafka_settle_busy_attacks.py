"""Attacks on the settle's wait for its own abort marker (``KafkaTransactionalProducer._not_ended``)
on a busy data topic, on the session's Apache Kafka.

A settle forgets a partition only once its last stable offset (read_committed) is past the settle's
empty record. The last stable offset of a partition is the first offset of the oldest transaction
open there, whoever's: another producer's transaction open there since before the empty record
holds it below, though the settle's own abort marker is written.
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import suppress

import pytest
from _kafka_transactions import stable_and_end
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox import RetriableTransportError
from transports import Record, TransactionOutcome
from transports.kafka import KafkaTransport

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_a_settle_is_not_held_by_another_producers_long_transaction_on_the_data_partition(kafka: str) -> None:
    """A shard's transaction is aborted (a record refused for good); meanwhile another producer of
    the data topic (another shard whose broker is slow, or an application with long transactions:
    a Flink sink holds one open for a whole checkpoint interval, minutes) has a transaction open on
    the same partition. The shard's next producer settles: its empty record is written and aborted,
    its marker written. But the settle waits for the partition's last stable offset to pass its
    empty record, which the other transaction holds below: the settle fails after the producer's
    timeout, again at each try, and the shard sends nothing until the other transaction ends (its
    transaction.timeout.ms, up to 15 minutes by the broker's default cap) though the broker
    answered everything and nothing of the shard's is open there."""
    run = uuid.uuid4().hex[:8]
    tid = f"outbox-settle-busy-{run}-0"
    data, progress, refusing = (f"settle-busy-data-{run}", f"settle-busy-progress-{run}",
                                f"settle-busy-refusing-{run}")
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    for future in admin.create_topics([
            NewTopic(data, 1, 1), NewTopic(progress, 1, 1, config={"cleanup.policy": "compact"}),
            NewTopic(refusing, 1, 1, config={"max.message.bytes": "256"})]).values():
        future.result(30)
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5.0)
    other = Producer({"bootstrap.servers": kafka, "transactional.id": f"another-app-{run}",
                      "transaction.timeout.ms": 300_000, "log_level": 0})
    try:
        first = transport.transactional(tid, 5)
        answer = first.send([Record(data, b"row-0", key=b"a", partition=0),
                             Record(refusing, os.urandom(2000), key=b"big", partition=0),
                             Record(progress, b"progress", key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        first.close()
        other.init_transactions(30)
        other.begin_transaction()
        other.produce(data, b"another producer's row, its transaction long", b"c", 0)
        assert other.flush(10) == 0
        stable, end = stable_and_end(admin, data, 0)
        assert stable < end, "the other transaction is not open on the data partition"
        tries: list[str] = []
        started = time.monotonic()
        taker = None
        while taker is None and time.monotonic() - started < 20:  # four tries' worth at least
            try:
                taker = transport.transactional(tid, 5)
            except RetriableTransportError as exc:
                tries.append(f"{time.monotonic() - started:.1f} s: {exc}")
        assert taker is not None, (
            f"the shard's settle failed {len(tries)} times in {time.monotonic() - started:.0f} s while "
            f"another producer's transaction stays open on {data}[0] (its own marker written): {tries}")
        taker.close()
    finally:
        with_other_aborted(other)
        transport.close()
        admin.delete_topics([data, progress, refusing])


def with_other_aborted(other: Producer) -> None:
    """End the other producer's transaction (best effort), so nothing is held after the test."""
    with suppress(KafkaException):
        other.abort_transaction(10)
    other.flush(1)
