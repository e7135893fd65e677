"""Exactly once on the wire: a relay that lost its lease without knowing it yet makes a producer of
the shard again. Proved on Apache Kafka, read back read_committed.

Making a producer of a shard's ``transactional.id`` fences every other one: such
a relay would fence the rightful new owner (whose shard then sent nothing for
its lease), and send rows the new owner had committed. Each test freezes a relay
("zombie") at one of the points where it makes a producer again, lets another
("taker") take the shard and publish, resumes the zombie, and then asks the
taker to publish more: nothing twice, nothing lost, the taker's shard not stalled.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _relay_helpers import drain, publish, rows, wait_for
from confluent_kafka.admin import AdminClient, ConfigResource

from outbox import ConfigurationError, Outbox, Relay, create_engine
from outbox.testing import create_topic
from transports import Outcome, Record, SendResult, TransactionOutcome, TransactionResult
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

MESSAGE_ID = "outbox-message-id"
STALL = 90.0  # seconds a frozen zombie waits at most for the taker (slow under load)


@pytest.fixture
def outbox(sqlite_db: str) -> Iterator[Outbox]:
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)  # one shard: every row in one transaction of the zombie and the taker
    ob.create_tables()
    yield ob
    engine.dispose()


def relay(outbox: Outbox, transport: KafkaTransport, progress_topic: str, worker_id: str,
          **kwargs: Any) -> Relay:
    return Relay(outbox, transport, exactly_once=True, progress_topic=progress_topic, lease_ttl=1.0,
                 worker_id=worker_id, **kwargs)


def copies(records: list[Record]) -> Counter[bytes]:
    return Counter(dict(r.headers)[MESSAGE_ID] for r in records)


def with_poison(outbox: Outbox, kafka: str, topic: str) -> int:
    """20 rows of 4 keys and, last of its key, one the topic refuses (over its 2,000 bytes; one
    partition, so its request's other records are refused with it: the relay isolates it one per
    request). The count of rows that can be published."""
    create_topic(kafka, topic, 1, config={"max.message.bytes": "2000"})
    publish(outbox, topic, [f"k{i % 4}" for i in range(10)])
    publish(outbox, topic, ["poison"], payload={"big": base64.b64encode(os.urandom(6000)).decode()})
    publish(outbox, topic, [f"k{i % 4}" for i in range(10)])
    return 20


def hooked(transport: KafkaTransport, monkeypatch: pytest.MonkeyPatch, *,
           before_make: Callable[[bool], None] | None = None,
           after_send: Callable[[TransactionResult], TransactionResult] | None = None) -> None:
    """The zombie's transport: ``before_make(one_per_request)`` runs before each producer it makes
    (after the relay decided to make it), ``after_send`` sees (and may replace) each transaction's answer."""
    real = transport.transactional

    def transactional(tid: str, timeout: float, *, one_per_request: bool = False, **kwargs: Any) -> Any:
        if before_make is not None:
            before_make(one_per_request)
        producer = real(tid, timeout, one_per_request=one_per_request, **kwargs)
        if after_send is not None:
            real_send = producer.send
            producer.send = lambda records: after_send(real_send(records))  # type: ignore[method-assign]
        return producer

    monkeypatch.setattr(transport, "transactional", transactional)


def zombie_and_taker(outbox: Outbox, kafka: str, topic: str, progress_topic: str, published: int,
                     zombie: Relay, frozen: threading.Event, thaw: threading.Event) -> Relay:
    """Run the zombie's batch on a thread until it freezes; the taker takes the shard and publishes
    everything; the zombie resumes and ends its batch. The taker, whose shard must still flow."""
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(zombie.run_once()), name="zombie")
    worker.start()
    assert frozen.wait(STALL), "the zombie never reached the point it freezes at"
    # Batches of 5: the taker's last progress record names only its last batch's rows, so reading
    # it cannot tell the zombie that the rows of the earlier ones were published.
    taker = relay(outbox, KafkaTransport(bootstrap_servers=kafka), progress_topic, "taker", batch_size=5)
    drain(taker, timeout=STALL)  # the zombie's lease expires (1 s), the taker takes the shard
    assert len(rows(outbox, status="published")) == published
    thaw.set()
    worker.join(STALL)
    assert not worker.is_alive()
    (batch,) = outcome
    assert batch.published == 0
    return taker


def assert_flows_once(outbox: Outbox, kafka: str, topic: str, taker: Relay, published: int) -> None:
    """Every row on the topic once; then the taker publishes 10 more rows within a bound, once each."""
    on_wire = read_topic(kafka, topic, expected=published, settle=1.5, isolation="read_committed")
    assert {mid: n for mid, n in copies(on_wire).items() if n > 1} == {}  # the zombie sent nothing again
    assert len(on_wire) == published
    publish(outbox, topic, [f"after{i % 2}" for i in range(10)])
    drain(taker, timeout=30)  # a shard fenced for the rest of its lease would stall here
    taker.close()
    on_wire = read_topic(kafka, topic, expected=published + 10, settle=1.5, isolation="read_committed")
    twice = {mid: n for mid, n in copies(on_wire).items() if n > 1}
    assert twice == {}
    assert len(on_wire) == published + 10


def fenced_warnings(caplog: pytest.LogCaptureFixture, who: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and who in r.getMessage() and "was fenced" in r.getMessage()]


def test_a_relay_that_lost_its_lease_before_isolating_a_refused_record_makes_no_producer(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The zombie's transaction is aborted by the refused record; it freezes before it makes the
    producer that sends one record per request, past its lease. Resumed, it must make none: the
    taker's producer would be fenced, and the zombie would send the rows the taker published."""
    published = with_poison(outbox, kafka, topic)
    frozen, thaw = threading.Event(), threading.Event()

    def freeze_after_the_abort(answer: TransactionResult) -> TransactionResult:
        if answer.outcome is TransactionOutcome.ABORTED and not frozen.is_set():
            frozen.set()
            thaw.wait(STALL)
        return answer

    transport = KafkaTransport(bootstrap_servers=kafka)
    hooked(transport, monkeypatch, after_send=freeze_after_the_abort)
    zombie = relay(outbox, transport, progress_topic, "zombie")
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    taker = zombie_and_taker(outbox, kafka, topic, progress_topic, published, zombie, frozen, thaw)
    zombie.close()
    assert fenced_warnings(caplog, "taker") == []  # the zombie made no producer: nobody fenced
    assert_flows_once(outbox, kafka, topic, taker, published)


@pytest.mark.parametrize("frozen_at", [
    pytest.param("one-per-request", id="making-the-isolating-producer"),
    pytest.param("after-isolating", id="making-the-producer-after-isolating"),
])
def test_a_relay_that_lost_its_lease_while_making_a_producer_sends_nothing_and_the_owner_recovers(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, frozen_at: str) -> None:
    """The zombie still held its lease when it decided to make a producer during its batch, and
    freezes between that and the broker's answer, past its lease: the producer that sends one record
    per request to find the refused one, or the ordinary one made again once it was found (the next
    transaction would commit the rest of the batch). Its producer, made once the taker holds the
    shard, fences the taker's (nothing can prevent that): the zombie must then send nothing (the
    rows it holds were published by the taker, in batches of 5), and the taker must make its
    producer again (fencing the zombie's) and go on, not stall for its lease."""
    published = with_poison(outbox, kafka, topic)
    frozen, thaw = threading.Event(), threading.Event()
    isolated: list[bool] = []

    def freeze(one_per_request: bool) -> None:
        if one_per_request:
            isolated.append(True)
        due = one_per_request if frozen_at == "one-per-request" else (isolated and not one_per_request)
        if due and not frozen.is_set():
            frozen.set()
            thaw.wait(STALL)

    transport = KafkaTransport(bootstrap_servers=kafka)
    hooked(transport, monkeypatch, before_make=freeze)
    zombie = relay(outbox, transport, progress_topic, "zombie")
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    taker = zombie_and_taker(outbox, kafka, topic, progress_topic, published, zombie, frozen, thaw)
    zombie.close()
    assert_flows_once(outbox, kafka, topic, taker, published)
    assert fenced_warnings(caplog, "taker")  # it was fenced, and recovered: the test did its attack


def test_a_relay_that_lost_its_lease_after_a_commit_without_an_answer_makes_no_producer(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The zombie's commit succeeds but its answer is lost; the taker takes the shard (its lease
    expired meanwhile) and marks what the progress names. The zombie's worker runs its next batch on
    the lease it believes it holds: it must not make the producer that would settle the commit."""
    create_topic(kafka, topic, 3)
    publish(outbox, topic, [f"k{i % 4}" for i in range(20)])
    lost: list[bool] = []

    def lose_the_first_answer(answer: TransactionResult) -> TransactionResult:
        if answer.outcome is TransactionOutcome.COMMITTED and not lost:
            lost.append(True)
            retry = [SendResult(Outcome.RETRY, error="no answer", unreachable=True)] * len(answer.results)
            return TransactionResult(TransactionOutcome.UNKNOWN, retry, "no answer")
        return answer

    transport = KafkaTransport(bootstrap_servers=kafka)
    hooked(transport, monkeypatch, after_send=lose_the_first_answer)
    zombie = relay(outbox, transport, progress_topic, "zombie")
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    assert zombie.run_once().published == 0 and lost
    taker = relay(outbox, KafkaTransport(bootstrap_servers=kafka), progress_topic, "taker")
    wait_for(lambda: (taker.run_once(), len(rows(outbox, status="published")) == 20)[1], STALL,
             "the taker marking what the zombie committed")
    publish(outbox, topic, [f"z{i % 2}" for i in range(6)])  # pending: the zombie would send them
    batch = zombie._step.run(wait=True, leases=False).batch  # its lease thread has not noticed yet
    assert batch.published == 0
    zombie.close()
    assert fenced_warnings(caplog, "taker") == []
    drain(taker, timeout=30)  # the rows the zombie would have sent: the taker's shard flows
    assert_flows_once(outbox, kafka, topic, taker, 26)


@pytest.mark.parametrize("config", [
    pytest.param({"cleanup.policy": "delete"}, id="delete"),
    pytest.param({"cleanup.policy": "compact,delete", "retention.ms": "86400000"}, id="compact-delete-1d"),
])
def test_a_progress_topic_found_not_compacted_is_refused_at_start(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str, config: dict[str, str]) -> None:
    """A delete policy (or compaction beside a finite retention) lets the broker drop a shard's
    progress record: a take-over would then send its committed rows again."""
    create_topic(kafka, progress_topic, 1, config=config)
    publish(outbox, topic, ["a"])
    worker = relay(outbox, KafkaTransport(bootstrap_servers=kafka), progress_topic, "relay")
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(60):
        worker.stop()
        pytest.fail("the relay ran on a progress topic that is not compacted")
    (error,) = errors
    assert isinstance(error, ConfigurationError)
    message = str(error)
    assert progress_topic in message and f"cleanup.policy={config['cleanup.policy']}" in message
    assert f"--entity-name {progress_topic} --add-config cleanup.policy=compact" in message
    assert rows(outbox, status="pending")  # nothing sent


def test_a_compacted_progress_topic_kept_for_good_beside_delete_is_accepted(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str) -> None:
    create_topic(kafka, progress_topic, 1, config={"cleanup.policy": "compact,delete", "retention.ms": "-1",
                                                   "retention.bytes": "-1"})
    publish(outbox, topic, ["a", "b"])
    worker = relay(outbox, KafkaTransport(bootstrap_servers=kafka), progress_topic, "relay")
    drain(worker, timeout=60)
    worker.close()


def test_the_cli_refuses_a_progress_topic_not_compacted_in_one_line(
        sqlite_db: str, outbox: Outbox, kafka: str, progress_topic: str, tmp_path: Path) -> None:
    create_topic(kafka, progress_topic, 1, config={"cleanup.policy": "delete"})
    admin = AdminClient({"bootstrap.servers": kafka})
    resource = ConfigResource("topic", progress_topic)
    assert admin.describe_configs([resource])[resource].result(30)["cleanup.policy"].value == "delete"
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "relay", "--db", sqlite_db, "--bootstrap-servers", kafka,
         "--exactly-once", "--progress-topic", progress_topic, "--log-level", "ERROR"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert progress_topic in lines[0] and "cleanup.policy=delete" in lines[0] and "kafka-configs" in lines[0]
