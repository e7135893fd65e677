"""Attacks on fcf0a2c: a record librdkafka refuses for its transaction's failed state (``_STATE``).

The fix takes such a record for a retry for why the transaction failed (``_failed``). These check
that a transaction failed by a record the broker refuses for good, while later records wait for room
in a small queue (``queue.buffering.max.messages``), still fails that record alone, and that a
producer fenced while a record waits for room ends ``FENCED`` (no attempt counted), on Apache Kafka.

The last two, under a producer quota (a slow broker), found ``_abort``'s rule for records purged in
flight keyed on the records refused at produce(), not on a refusal for good: a refusal whose report
came while other requests were in flight ended ``UNKNOWN`` (the relay took it for an outage and sent
the batch again whole, forever), and a retry at produce() (``QUEUE_FULL``, ``_STATE``) ended
``ABORTED`` with requests purged in flight (the relay kept the producer they could join).
"""

from __future__ import annotations

import base64
import contextlib
import os
import time
import uuid
from typing import Any

import pytest
import tenacity
from _relay_helpers import publish, rows, wait_for
from confluent_kafka import KafkaError, KafkaException

from outbox import Outbox, Relay, create_engine
from outbox.relay._exactly_once import ExactlyOnce
from outbox.testing import LocalKafka, create_topic, set_producer_quota
from tests.conftest import thawed_and_running
from transports import Outcome, Record, SendResult, TransactionOutcome
from transports.kafka import KafkaTransport, _transactions

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.fixture
def quick_quotas(module_quick_quotas: LocalKafka) -> LocalKafka:
    """The module's broker of quick quotas, shared by its two tests that throttle producers of a
    client id of their own (both in the ``timing`` group: one worker) and fault nothing else: one
    JVM start instead of two."""
    return thawed_and_running(module_quick_quotas)


def refusals_at_produce(monkeypatch: pytest.MonkeyPatch) -> list[KafkaError]:
    """The errors ``produce()`` raises in a transaction from now on (``_STATE`` among them), in order."""
    waiting = _transactions.produce_waiting
    refused: list[KafkaError] = []

    def recording(kafka: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
        try:
            return waiting(kafka, deadline, *args, **kwargs)
        except KafkaException as exc:
            refused.append(exc.args[0])
            raise

    monkeypatch.setattr(_transactions, "produce_waiting", recording)
    return refused


def test_a_refusal_for_good_meeting_a_full_queue_fails_the_refused_record_only(
        kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The topic takes 2,000 bytes at most; the first of 14 records is 4,000 (random). The queue
    holds 10: the 11th waits for room, the broker refuses the request of the first ten, and
    librdkafka refuses the 11th for the failed transaction (``_STATE``). The refused records fail
    (the relay isolates the big one, below); the 11th is a retry, not a failure of its own."""
    create_topic(kafka, topic, 1, config={"max.message.bytes": "2000"})
    transport = KafkaTransport({"queue.buffering.max.messages": 10}, bootstrap_servers=kafka,
                               delivery_timeout=5.0)
    producer = transport.transactional("outbox-test-state-refused", 5.0)
    try:
        warm = producer.send([Record(topic, b"warm", key=b"k")])
        assert warm.outcome is TransactionOutcome.COMMITTED, warm
        refused = refusals_at_produce(monkeypatch)
        big = base64.b64encode(os.urandom(3000))
        answer = producer.send([Record(topic, big, key=b"big"),
                                *(Record(topic, b"%d" % i, key=b"k%d" % i) for i in range(1, 14))])
    finally:
        producer.close()
        transport.close()
    assert [e.code() for e in refused] == [KafkaError._STATE]
    assert answer.outcome is TransactionOutcome.ABORTED, answer
    assert answer.results[0].outcome is Outcome.FAILED
    assert [r.outcome for r in answer.results] == [Outcome.FAILED] * 10 + [Outcome.RETRY] * 4, answer
    assert "too large" in (answer.results[10].error or "").lower(), answer.results[10]


def test_a_relay_fails_alone_the_record_refused_for_good_when_its_transaction_meets_a_full_queue(
        sqlite_db: str, kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The case above through an exactly-once relay: 33 rows of one shard, the 4th too large for its
    topic, a queue of 10. Its transactions meet ``_STATE`` (at least once) and the broker's refusal
    of whole requests; the big row fails alone, and every other row is published with the one
    attempt that delivered it (none counted for the aborted transactions)."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    create_topic(kafka, topic, 1, config={"max.message.bytes": "2000"})
    keys = [f"k{k}" for k in range(30)]
    publish(outbox, topic, keys[:3])
    publish(outbox, topic, ["poison"], payload={"big": base64.b64encode(os.urandom(3000)).decode()})
    publish(outbox, topic, [*keys[3:], None, None])
    transport = KafkaTransport({"queue.buffering.max.messages": 10}, bootstrap_servers=kafka,
                               delivery_timeout=5.0)
    refused = refusals_at_produce(monkeypatch)
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=f"{topic}-progress",
                  backoff=tenacity.wait_fixed(0.2))
    wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 60, "every row settled")
    relay.close()
    stored = rows(outbox)
    assert [r.key for r in stored if r.status == "failed"] == ["poison"]
    assert [(r.key, r.attempts, r.last_error) for r in stored if r.attempts != 1] == []
    assert refused and {e.code() for e in refused} == {KafkaError._STATE}, refused
    engine.dispose()


def test_a_producer_fenced_while_a_record_waits_for_room_ends_fenced(
        kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer producer of the id is made while the 11th record waits for room in a queue of 10, and each
    record after is answered (refused for the old epoch) before the next is produced: the transaction
    ends ``FENCED`` (the relay counts no attempt for it), not aborted with a retry the broker answered.
    (librdkafka let each of them be produced: no ``produce()`` raised here.)"""
    create_topic(kafka, topic, 1)
    transport = KafkaTransport({"queue.buffering.max.messages": 10}, bootstrap_servers=kafka,
                               delivery_timeout=5.0)
    waiting = _transactions.produce_waiting
    newer: list[Any] = []

    def fencing(kafka_: Any, deadline: float, *args: Any, **kwargs: Any) -> SendResult | None:
        if len(kafka_) >= 10 and not newer:
            newer.append(transport.transactional("outbox-test-state-fenced", 5.0))
        if newer:
            until = time.monotonic() + 10
            while len(kafka_) and time.monotonic() < until:  # each record answered before the next
                kafka_.poll(0.1)
        return waiting(kafka_, deadline, *args, **kwargs)

    producer = transport.transactional("outbox-test-state-fenced", 5.0)
    try:
        warm = producer.send([Record(topic, b"warm", key=b"k")])
        assert warm.outcome is TransactionOutcome.COMMITTED, warm
        monkeypatch.setattr(_transactions, "produce_waiting", fencing)
        answer = producer.send([Record(topic, b"%d" % i, key=b"k%d" % i) for i in range(14)])
    finally:
        producer.close()
        for p in newer:
            p.close()
        transport.close()
    assert answer.outcome is TransactionOutcome.FENCED, answer


@pytest.mark.xdist_group("timing")
def test_a_slow_broker_refusing_a_record_for_good_still_fails_it_alone(
        sqlite_db: str, quick_quotas: LocalKafka, topic: str) -> None:
    """The topic takes 20,000 bytes at most; a row of 32 kB sits among 40 rows of 4 kB (8 keys, one
    shard) whose batches also outgrow it, and the broker holds the relay's producers to 50 kB/s (a
    quota). Its refusal comes while other requests of the transaction are in flight: the abort purges
    them. The transaction ended ``UNKNOWN`` for the purge, and the relay took the refusal for an
    outage: the whole batch sent again, refused again, forever (15 transactions of 41 rows in 60 s,
    nothing published, no row failed). A record refused for good is named by an ``ABORTED`` (the
    relay then isolates it on a new producer, which fences the purged requests just as well)."""
    broker = quick_quotas
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    broker.create_topic(topic, 4, config={"max.message.bytes": "20000"})
    keys = [f"k{k % 8}" for k in range(40)]
    for key in keys[:20]:
        publish(outbox, topic, [key], payload={"blob": base64.b64encode(os.urandom(3000)).decode()})
    publish(outbox, topic, ["poison"], payload={"big": base64.b64encode(os.urandom(24000)).decode()})
    for key in keys[20:]:
        publish(outbox, topic, [key], payload={"blob": base64.b64encode(os.urandom(3000)).decode()})
    client = f"slow-relay-{uuid.uuid4().hex[:8]}"
    transport = KafkaTransport(bootstrap_servers=broker.bootstrap, client_id=client, delivery_timeout=4.0)
    set_producer_quota(broker.bootstrap, client, 50_000)
    outcomes: list[str] = []
    real_transaction = ExactlyOnce._transaction

    def transaction(self: ExactlyOnce, shard: int, state: Any, records: Any, ids: Any, todo: list[int],
                    results: Any) -> Any:
        refused = real_transaction(self, shard, state, records, ids, todo, results)
        outcomes.append(f"{len(todo)} rows, {len(refused)} refused")
        return refused

    relay = Relay(outbox, transport, exactly_once=True, progress_topic=f"{topic}-progress",
                  backoff=tenacity.wait_fixed(0.2))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ExactlyOnce, "_transaction", transaction)
            with contextlib.suppress(AssertionError):  # timed out: the asserts below say what was left
                wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 60,
                         "every row settled")
    finally:
        relay.close()
        transport.close()
    stored = rows(outbox)
    assert {r.status for r in stored if r.key != "poison"} == {"published"}, (
        outcomes, {(r.status, r.attempts, r.last_error) for r in stored})
    assert [r.status for r in stored if r.key == "poison"] == ["failed"]
    engine.dispose()


@pytest.mark.xdist_group("timing")  # with the test above: the module's one broker of quick quotas
def test_a_transaction_aborted_with_records_purged_in_flight_ends_unknown_unless_one_was_refused(
        quick_quotas: LocalKafka, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a 50 kB/s quota, 20 records of 8 kB and a queue of 4: the records waiting for room meet
    the deadline (``QUEUE_FULL``, a retry) or the failed state (``_STATE``, a retry), with requests in
    flight. Purged, such a request can still reach the broker after the abort and join the producer's
    next transaction; ``_abort`` ends the transaction ``UNKNOWN`` for that (the relay makes a new
    producer), but not when a record was "refused" at produce(), retries included: ``ABORTED``, and
    the relay kept the producer (it makes a new one only for a record refused for good)."""
    broker = quick_quotas
    broker.create_topic(topic, 2)
    client = f"slow-{uuid.uuid4().hex[:8]}"
    transport = KafkaTransport({"queue.buffering.max.messages": 4}, bootstrap_servers=broker.bootstrap,
                               client_id=client, delivery_timeout=2.0)
    set_producer_quota(broker.bootstrap, client, 50_000)
    ended: list[tuple[bool, bool, TransactionOutcome]] = []
    real_abort = _transactions.KafkaTransactionalProducer._abort

    def abort(self: Any, count: int, reports: Any, refused: Any, cause: Any) -> Any:
        answer = real_abort(self, count, reports, refused, cause)
        purged = any(e is not None and e.code() == KafkaError._PURGE_INFLIGHT for e, _ in reports.values())
        ended.append((purged, any(r.outcome is Outcome.FAILED for r in answer.results), answer.outcome))
        return answer

    monkeypatch.setattr(_transactions.KafkaTransactionalProducer, "_abort", abort)
    producer = transport.transactional("outbox-test-state-purged", 2.0)
    try:
        for round in range(3):
            producer.send([Record(topic, os.urandom(8000), key=b"r%d-%d" % (round, i)) for i in range(20)])
    finally:
        producer.close()
        transport.close()
    assert any(purged for purged, _, _ in ended), ended  # the case met
    assert [(purged, failed, outcome) for purged, failed, outcome in ended
            if purged and not failed and outcome is not TransactionOutcome.UNKNOWN] == [], ended
