"""A transactional producer the exactly-once relay drops ends when the relay drops it, not when
Python's cycle collector runs.

The relay makes a new producer of a shard's transactional id after every transaction that did not
commit, at every take-over, for held shards, for a fleet's parked shards; each one it drops is a
librdkafka client (three or more threads, a connection to every broker, buffers). An attack saw
them pile up between collections: the cycle collector freed them, not the relay. Found:

- a take-over that raised (its lease confirmation failed after it made its producer) was raised
  on by ``settle_take_overs`` from a name of its frame, and ``ExactlyOnce.prepare`` held it in
  the name of a comprehension's ``:=``: both frames are in the exception's traceback, so the
  exception held itself, and through the take-over's frames the producer it made;
- a shard dropped while its take-over ran kept the take-over (``ShardState.taking``) and gave it
  a done-callback that holds the shard: a take-over that then failed held the shard through its
  exception's traceback (``ProducerMaker.make``'s frame), a cycle, with the producer it made;
- a batch of several shards waited for their transactions ``for future in …``: the future whose
  shard raised (a remake's lease check) stayed in ``send``'s frame, which its exception's
  traceback holds, with the failed shard's frames and the producer its remake made;
- and ``KafkaTransactionalProducer.close`` only flushed: the client went with the object's last
  reference, and anything that kept the object (a traceback, a log record a handler keeps, as
  pytest's does) kept the client.

Every test runs with the cycle collector off: what is not freed by its reference count stays,
visibly. A librdkafka client is counted by its main thread (``rdk:main``, one per client).
librdkafka's mock cluster, made here: no JVM.
"""

from __future__ import annotations

import gc
import os
import threading
import uuid
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import pytest
from _mock_faults import MockCluster
from _relay_helpers import wait_for
from confluent_kafka import KafkaError

from outbox import RetriableTransportError
from outbox.relay._exactly_once import ExactlyOnce, tag_of
from transports import Outcome, Record, TransactionOutcome, TransactionResult
from transports.kafka import KafkaTransactionalProducer, KafkaTransport

pytestmark = pytest.mark.any_kafka  # librdkafka's mock cluster, made by the module

TIMEOUT = 5.0
TOO_LARGE = b"v" * 2_000_000  # over the producer's message.max.bytes: refused at produce(), for good


class LeaseCheckFailed(Exception):
    """What a lease confirmation raises here: the database's error, raised on by ``prepare``."""


class RaisesAfterItsCommit:
    """A transactional producer whose ``send`` commits, then raises (a transport's bug: a read-back's
    ``TimeoutError`` once did): the relay takes the transaction's fate for unknown."""

    def __init__(self, producer: KafkaTransactionalProducer) -> None:
        self.producer = producer

    def send(self, records: Sequence[Record]) -> TransactionResult:
        answer = self.producer.send(records)
        raise TimeoutError(f"after the transaction ended {answer.outcome.name}")

    def close(self) -> None:
        self.producer.close()


class Confirming:
    """The relay's shard leases (``ShardLease``) as one ``confirm(shard, epoch)``: each of a take-over's
    two confirmations and of a remake's is one call of it (nothing is recorded: the row names no topic),
    a send's widening none."""

    def __init__(self, confirm: Any) -> None:
        self.confirm = confirm

    def taken(self, shard: int, epoch: int) -> frozenset[str] | None:
        return frozenset() if self.confirm(shard, epoch) else None

    def settled(self, shard: int, epoch: int) -> bool:
        return bool(self.confirm(shard, epoch))

    def widen(self, wanted: Mapping[int, tuple[int, Collection[str]]]) -> set[int]:
        return set(wanted)


class Transport(KafkaTransport):
    """The Kafka transport on the mock cluster, which answers no DescribeConfigs: the progress topic is
    made by a record (auto-created). The transactional producers it makes are kept, weakly; while
    ``raising`` is set, each is given out as one that raises after its commit."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(bootstrap_servers=bootstrap, delivery_timeout=TIMEOUT, log_level=0)
        self.made: list[weakref.ref[KafkaTransactionalProducer]] = []
        self.raising = False

    def transactional(self, transactional_id: str, timeout: float, **kwargs: Any) -> Any:
        try:
            producer = super().transactional(transactional_id, timeout, **kwargs)
        except BaseException:
            newest = self._made.get(transactional_id)
            if newest is not None:
                self.made.append(weakref.ref(newest))
            raise
        self.made.append(weakref.ref(producer))
        return RaisesAfterItsCommit(producer) if self.raising else producer

    def ensure_compacted_topic(self, topic: str, partitions: int, timeout: float,
                               stopping: threading.Event | None = None) -> None:
        [made] = self.publish([Record(topic, b"", key=b"made")])
        assert made.outcome is Outcome.DELIVERED, made


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=1) as mock:
        yield mock


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cycle collector off: what the test drops is freed at once or stays, visibly."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def transport(cluster: MockCluster) -> Iterator[Transport]:
    """A transport whose shared clients (its producer, the commit check's admin client) are made
    before the test counts clients."""
    transport = Transport(cluster.bootstrap)
    warm = transport.transactional(f"warm-{uuid.uuid4().hex[:8]}", TIMEOUT)
    topic = f"warm-{uuid.uuid4().hex[:8]}"
    assert warm.send([Record(topic, b"w", key=b"w")]).outcome is TransactionOutcome.COMMITTED
    warm.close()
    del warm
    transport.made.clear()
    yield transport
    transport.close()


def clients() -> int:
    """librdkafka clients alive in this process: each runs one ``rdk:main`` thread."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == "rdk:main"
        except OSError:  # a thread that ended meanwhile
            continue
    return count


def alive(made: Sequence[weakref.ref[KafkaTransactionalProducer]]) -> list[KafkaTransactionalProducer]:
    return [p for ref in made if (p := ref()) is not None]


def names() -> tuple[str, str, str]:
    """A transactional id, a data topic and a progress topic no other test uses."""
    tag = uuid.uuid4().hex[:8]
    return f"outbox-{tag}-0", f"orders-{tag}", f"progress-{tag}"


# -- the transport: ``close`` ends the client, whoever still holds the producer -------------------

@pytest.mark.parametrize("ending", ["committed", "aborted", "settle failed"])
def test_a_closed_transactional_producer_has_no_client_though_it_is_still_held(
        cluster: MockCluster, transport: Transport, no_collector: None, ending: str) -> None:
    """Held here as a traceback, a log record or a cycle would hold it: its client is gone at close."""
    tid, topic, _ = names()
    before = clients()
    producer = transport.transactional(tid, TIMEOUT)
    assert clients() == before + 1
    held: object
    if ending == "committed":
        assert producer.send([Record(topic, b"v", key=b"k")]).outcome is TransactionOutcome.COMMITTED
        producer.close()
        held = producer
    else:
        result = producer.send([Record(topic, TOO_LARGE, key=b"k"), Record(topic, b"v", key=b"j")])
        assert result.outcome is TransactionOutcome.ABORTED, result
        producer.close()
        held = producer
        if ending == "settle failed":
            # The next producer of the id ends what the aborted one wrote: refused, its settle fails,
            # and the transport closes it; the exception (its traceback) still holds it.
            cluster.fail_produce(KafkaError.MSG_SIZE_TOO_LARGE)
            try:
                transport.transactional(tid, TIMEOUT)
            except RetriableTransportError as exc:
                held = exc
            else:
                pytest.fail("the settle did not fail")
            assert len(alive(transport.made)) == 2  # both held: the aborted one here, the other by `held`
    assert clients() <= before, (f"{ending}: {clients() - before} librdkafka client(s) of closed producers "
                                 f"still run while the producer is referenced")
    assert held is not None


# -- the relay: what it drops is freed when it drops it --------------------------------------------

def relay(transport: Transport, confirm: Any, progress: str, stopping: threading.Event | None = None,
          ) -> ExactlyOnce:
    return ExactlyOnce(transport, incarnation=progress.removeprefix("progress-"), worker_id="w", shards=1,
                       progress_topic=progress, mark=lambda *_: True, messages=lambda _: {},
                       lease=Confirming(confirm), stopping=stopping)


def test_a_take_over_whose_lease_check_raises_after_its_producer_was_made_frees_that_producer(
        transport: Transport, no_collector: None) -> None:
    """The confirmation after the producer is made raises (the database's error): ``prepare`` raises it
    on, and once it is handled nothing holds the producer."""
    _, _, progress = names()
    calls: list[int] = []

    def confirm(shard: int, epoch: int) -> bool:
        calls.append(shard)
        if len(calls) == 2:
            raise LeaseCheckFailed("the database did not answer")
        return True

    eo = relay(transport, confirm, progress)
    before = clients()
    try:
        eo.prepare({0: 1})
    except LeaseCheckFailed:
        pass
    else:
        pytest.fail("prepare did not raise the lease check's error")
    assert len(calls) == 2 and len(transport.made) == 1
    try:
        assert not alive(transport.made), "the take-over's producer is held by a reference cycle"
        assert clients() <= before, "the take-over's producer still runs its librdkafka client"
        ready, error = eo.prepare({0: 1})  # tried again: the shard is taken
        assert ready == {0: 1} and error is None
        assert eo.producers == 1 and clients() == before + 1
    finally:
        eo.close()
    assert clients() <= before


def test_a_shard_dropped_while_its_take_over_runs_is_freed_with_its_producer_once_the_take_over_fails(
        transport: Transport, no_collector: None) -> None:
    """The lease is lost while the take-over runs; the take-over then fails after it made its producer."""
    _, _, progress = names()
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def confirm(shard: int, epoch: int) -> bool:
        calls.append(shard)
        if len(calls) == 2:
            entered.set()
            release.wait(30)
            raise LeaseCheckFailed("the database did not answer")
        return True

    stopping = threading.Event()
    stopping.set()  # prepare does not wait for the take-over it starts
    eo = relay(transport, confirm, progress, stopping)
    before = clients()
    try:
        assert eo.prepare({0: 1}) == ({}, None)
        assert entered.wait(30), "the take-over did not make its producer"
        assert len(alive(transport.made)) == 1 and clients() > before
        assert eo.prepare({}) == ({}, None)  # the shard dropped while its take-over runs
        release.set()
        wait_for(lambda: not alive(transport.made), 10,
                 "the dropped shard's failed take-over to free the producer it made")
        assert clients() <= before
    finally:
        release.set()
        eo.close()


def test_a_batch_whose_shard_raises_frees_the_producer_that_shards_remake_made(
        transport: Transport, no_collector: None) -> None:
    """Two shards send at once, on the relay's threads. Shard 0's record is refused; the producer its
    remake makes is confirmed no more (the database raises): ``send`` raises that on, and once it is
    handled nothing holds that producer."""
    _, topic, progress = names()
    confirmed: dict[int, int] = {}

    def confirm(shard: int, epoch: int) -> bool:
        confirmed[shard] = confirmed.get(shard, 0) + 1
        if shard == 0 and confirmed[shard] == 4:  # a take-over's two, then the remake's second
            raise LeaseCheckFailed("the database did not answer")
        return True

    eo = ExactlyOnce(transport, incarnation=progress.removeprefix("progress-"), worker_id="w", shards=2,
                     progress_topic=progress, mark=lambda *_: True, messages=lambda _: {},
                     lease=Confirming(confirm))
    before = clients()
    try:
        assert eo.prepare({0: 1, 1: 1}) == ({0: 1, 1: 1}, None)
        taken = len(transport.made)
        records = [Record(topic, TOO_LARGE, key=b"k"), Record(topic, b"v", key=b"j"),
                   Record(topic, b"v", key=b"other shard's")]
        try:
            eo.send(records, [(1, 0), (2, 0), (3, 1)])
        except LeaseCheckFailed:
            pass
        else:
            pytest.fail("send did not raise the lease check's error")
        assert confirmed[0] == 4 and len(transport.made) == taken + 1
        assert transport.made[-1]() is None, "the remake's producer is held by a reference cycle"
        assert clients() == before + 1  # shard 1's producer
    finally:
        eo.close()
    assert clients() <= before


def test_the_producers_a_shard_drops_after_a_transaction_that_did_not_commit_have_no_client(
        cluster: MockCluster, transport: Transport, no_collector: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """A record refused aborts the shard's transaction; the new producer of its id fails its settle (its
    empty record refused too) and the shard waits without one. Both dropped producers' clients are gone,
    though the log record of the failed settle (kept by ``caplog``, as any record-keeping handler would)
    holds the second; the first, held by nothing, is freed."""
    _, topic, progress = names()
    eo = relay(transport, lambda *_: True, progress)
    before = clients()
    try:
        assert eo.prepare({0: 1}) == ({0: 1}, None)
        assert clients() == before + 1
        cluster.fail_produce(KafkaError.MSG_SIZE_TOO_LARGE)  # the next producer's settle
        records = [Record(topic, TOO_LARGE, key=b"k"), Record(topic, b"v", key=b"j")]
        results = eo.send(records, [(1, 0), (2, 0)])
        assert [r.outcome for r in results] == [Outcome.FAILED, Outcome.RETRY], results
        assert "no producer for shard 0" in caplog.text
        assert eo.producers == 0 and len(transport.made) == 2
        first, second = transport.made
        assert first() is None, "the producer of the aborted transaction is held after the relay dropped it"
        assert clients() <= before, (f"{clients() - before} librdkafka client(s) of the producers the shard "
                                     f"dropped still run")
        del first, second
        ready, error = eo.prepare({0: 1})  # its next batch: a producer again, its settle done
        assert ready == {0: 1} and error is None and clients() == before + 1
    finally:
        eo.close()
    assert clients() <= before


def test_a_shard_whose_transaction_raised_keeps_no_client_of_the_producer_it_dropped(
        transport: Transport, no_collector: None, caplog: pytest.LogCaptureFixture) -> None:
    """The shard's transaction commits and its producer's ``send`` then raises: an unknown outcome, the
    producer dropped. Its client is gone, though the logged traceback (kept by ``caplog``) holds it;
    the next take-over reads the progress and marks the row, not sending it again."""
    _, topic, progress = names()
    marked: list[list[int]] = []
    row = Record(topic, b"v", key=b"k", headers=[("outbox-message-id", str(uuid.uuid4()).encode())])
    eo = ExactlyOnce(transport, incarnation=progress.removeprefix("progress-"), worker_id="w", shards=1,
                     progress_topic=progress, lease=Confirming(lambda *_: True),
                     mark=lambda shard, epoch, ids: marked.append(ids) is None,
                     messages=lambda ids: {7: tag_of(row)} if 7 in ids else {})  # the database's row 7
    before = clients()
    try:
        transport.raising = True
        assert eo.prepare({0: 1}) == ({0: 1}, None)
        transport.raising = False
        [result] = eo.send([row], [(7, 0)])
        assert result.outcome is Outcome.RETRY, result
        assert "its outcome is unknown" in caplog.text and eo.producers == 0
        assert clients() <= before, (f"{clients() - before} librdkafka client(s) of the producer the shard "
                                     f"dropped still run")
        assert eo.prepare({0: 1}) == ({0: 1}, None)
        assert marked == [[7]], "the committed row was not read back from the progress"
    finally:
        eo.close()
    assert clients() <= before
