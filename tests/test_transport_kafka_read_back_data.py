"""A take-over's read-back of a transaction that did not commit its progress record, at the data
partitions its progress record names.

Gone: their topic deleted since, or deleted and made again (empty, fewer partitions). What a
read_committed reader can get there is nothing of that transaction; the read-back must say so, not
wait at a partition that no longer has the offset it looks for.

Held: another producer (an application's, writing the same data topic) holds a transaction open
there since before the transaction's record. Nothing tells whether the record is committed until it
ends: the read-back fails (retriable, naming that partition alone: one the other transaction opened
after the record does not hold it), the relay's take-over of the shard is tried again at the next
batch, and once the other transaction ends the answer is the right one, nothing miscounted
meanwhile. Before the read-back read data partitions, such a transaction held no take-over; now it
holds one for as long as it stays open (up to its ``transaction.timeout.ms``), only while the
shard's last transaction did not commit its progress record.

The transaction here is the relay's cut before its commit (the relay killed after producing its
progress record): the id's next producer aborts it, and the read-back finds its progress record
after the last committed one, naming where its data records went.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from _kafka_transactions import wait_until
from confluent_kafka import KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox import RetriableTransportError
from transports import ReadBack, Record, Uncommitted
from transports.kafka import KafkaTransport
from transports.kafka._txn_headers import with_positions, with_topics
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def make(admin: AdminClient, topic: str, partitions: int, **config: str) -> None:
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1,
                                  config=config)])[topic].result(30)
    wait_until(lambda: (t := admin.list_topics(topic, timeout=5).topics.get(topic)) is not None
               and t.error is None and len(t.partitions) == partitions
               and all(p.leader >= 0 for p in t.partitions.values()), 30, f"{topic}'s leaders")


def delete(admin: AdminClient, topic: str) -> None:
    admin.delete_topics([topic])[topic].result(30)
    wait_until(lambda: topic not in admin.list_topics(timeout=5).topics, 30, f"{topic} gone")


def cut_before_commit(bootstrap: str, tid: str, progress: str, rows: list[tuple[str, int]],
                      value: bytes, *, last: bool = True) -> Producer:
    """A transaction of ``tid`` as the relay writes one (its data records, then the progress record
    naming where they went), never committed nor aborted: its producer is dropped, as a relay
    SIGKILLed between the progress record's produce and the commit (``last``: else before that
    produce, once the data records' reports came)."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "log_level": 0,
                         "transaction.timeout.ms": 60_000})
    producer.init_transactions(30)
    producer.begin_transaction()
    reports: list[Message] = []
    for topic, partition in rows:
        producer.produce(topic, b"row", b"k", partition, on_delivery=lambda e, m: reports.append(m))
    assert producer.flush(30) == 0
    if not last:
        return producer
    records = with_topics([*(Record(t, b"row", key=b"k", partition=p) for t, p in rows),
                           Record(progress, value, key=tid.encode(), partition=0)])
    record = with_positions(records, reports)[-1]
    producer.produce(progress, record.value, record.key, 0, headers=list(record.headers))
    assert producer.flush(30) == 0
    return producer  # kept by the caller, never ended: the next producer of the id aborts it


@pytest.fixture
def transport(kafka: str) -> Iterator[KafkaTransport]:
    made = KafkaTransport(bootstrap_servers=kafka)
    try:
        yield made
    finally:
        made.close()


def test_a_transaction_cut_before_its_commit_reads_back_as_committing_nothing_whatever_its_zombie_does(
        kafka: str, transport: KafkaTransport) -> None:
    tid, data, progress = "outbox-cut-0", "cut-data", "cut-progress"
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    make(admin, data, 2)
    make(admin, progress, 1, **{"cleanup.policy": "compact"})
    value = b'{"ids": [1, 2], "sent": [1, 2], "relay": "w", "epoch": 1}'
    cut = cut_before_commit(kafka, tid, progress, [(data, 0), (data, 1)], value)
    taker = transport.transactional(tid, 30)  # fences the cut one: its transaction aborted
    read = transport.read_back(progress, 0, tid.encode(), 30)
    assert read == ReadBack(None, (Uncommitted(value, (False, False)),))
    with pytest.raises(KafkaException):  # the cut relay was only frozen: it wakes and commits, fenced
        cut.commit_transaction(10)
    assert transport.read_back(progress, 0, tid.encode(), 30) == read  # a second take-over: the same
    taker.close()


def test_a_transaction_cut_before_its_progress_record_reads_back_as_nothing_and_is_aborted(
        kafka: str, transport: KafkaTransport) -> None:
    tid, data, progress = "outbox-cut-early-0", "cut-early-data", "cut-early-progress"
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    make(admin, data, 1)
    make(admin, progress, 1, **{"cleanup.policy": "compact"})
    cut = cut_before_commit(kafka, tid, progress, [(data, 0)], b"", last=False)
    taker = transport.transactional(tid, 30)
    assert transport.read_back(progress, 0, tid.encode(), 30) == ReadBack(None, ())
    later = Producer({"bootstrap.servers": kafka, "log_level": 0})
    later.produce(data, b"later", b"k", 0)
    assert later.flush(30) == 0
    seen = read_topic(kafka, data, expected=1, timeout=10, settle=0.5, isolation="read_committed")
    assert [r.value for r in seen] == [b"later"]  # the cut transaction's row aborted, never readable
    taker.close()
    del cut


def test_a_transaction_whose_data_topic_was_deleted_since_reads_back_as_not_committed(
        kafka: str, transport: KafkaTransport) -> None:
    """The read held at the deleted topic's partition until the read-back's timeout ('open
    transactions hold read_committed readers there'), at every take-over: the shard never taken
    over, its rows never sent, for good (its next commit, which would end it, never came)."""
    tid, data, kept, progress = "outbox-gone-0", "gone-data", "gone-kept", "gone-progress"
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    make(admin, data, 1)
    make(admin, kept, 1)
    make(admin, progress, 1, **{"cleanup.policy": "compact"})
    value = b'{"ids": [1, 2], "sent": [1, 2], "relay": "w", "epoch": 1}'
    cut = cut_before_commit(kafka, tid, progress, [(data, 0), (kept, 0)], value)
    taker = transport.transactional(tid, 30)
    delete(admin, data)
    started = time.monotonic()
    read = transport.read_back(progress, 0, tid.encode(), 20)
    assert read == ReadBack(None, (Uncommitted(value, (False, False)),))
    assert time.monotonic() - started < 10
    taker.close()
    del cut


def test_a_transaction_whose_data_topic_was_made_again_smaller_reads_back_as_not_committed(
        kafka: str, transport: KafkaTransport) -> None:
    """Made again empty with one partition of two: partition 1 is gone, and partition 0 ends below
    the offset read (its offset reset to the new start, where the read saw the end and waited)."""
    tid, data, progress = "outbox-again-0", "again-data", "again-progress"
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    make(admin, data, 2)
    make(admin, progress, 1, **{"cleanup.policy": "compact"})
    before = Producer({"bootstrap.servers": kafka, "log_level": 0})
    for _ in range(3):
        before.produce(data, b"earlier", b"e", 0)
    assert before.flush(30) == 0
    value = b'{"ids": [1, 2], "sent": [1, 2], "relay": "w", "epoch": 1}'
    cut = cut_before_commit(kafka, tid, progress, [(data, 0), (data, 1)], value)
    taker = transport.transactional(tid, 30)
    delete(admin, data)
    make(admin, data, 1)
    started = time.monotonic()
    read = transport.read_back(progress, 0, tid.encode(), 20)
    assert read == ReadBack(None, (Uncommitted(value, (False, False)),))
    assert time.monotonic() - started < 10
    taker.close()
    del cut


def test_a_read_back_held_by_another_producers_open_transaction_waits_for_it_and_miscounts_nothing(
        kafka: str, transport: KafkaTransport) -> None:
    tid, data, progress = "outbox-held-0", "held-data", "held-progress"
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    make(admin, data, 2)
    make(admin, progress, 1, **{"cleanup.policy": "compact"})
    other = Producer({"bootstrap.servers": kafka, "transactional.id": "an-application", "log_level": 0,
                      "transaction.timeout.ms": 60_000})
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(data, b"before", b"a", 0)  # open below the relay's record on partition 0
    assert other.flush(30) == 0
    value = b'{"ids": [1, 2], "sent": [1, 2], "relay": "w", "epoch": 1}'
    cut = cut_before_commit(kafka, tid, progress, [(data, 0), (data, 1)], value)
    other.produce(data, b"after", b"a", 1)  # open above the relay's record on partition 1
    assert other.flush(30) == 0
    taker = transport.transactional(tid, 30)
    with pytest.raises(RetriableTransportError, match=rf"{data}\[0\]: open transactions") as held:
        transport.read_back(progress, 0, tid.encode(), 6)
    assert f"{data}[1]" not in str(held.value)
    other.commit_transaction(30)
    read = transport.read_back(progress, 0, tid.encode(), 30)
    assert read == ReadBack(None, (Uncommitted(value, (False, False)),))
    seen = read_topic(kafka, data, expected=2, timeout=10, settle=0.5, isolation="read_committed")
    assert sorted(r.value for r in seen) == [b"after", b"before"]
    taker.close()
    del cut
