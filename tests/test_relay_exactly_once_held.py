"""An exactly-once shard held by another producer's open transaction is no broker outage, on Apache Kafka.

After a transaction of a shard that did not commit, the shard's next producer settles: it aborts an
empty record on each data partition that transaction wrote and waits until each reads past it
(read_committed). Another producer's transaction open there since before (another relay's shard on a
slow broker, an application with long transactions on a shared topic) holds that read for as long as
it stays open, minutes perhaps. The shard must send nothing meanwhile (its own abort marker may have
been dropped: committing there would end the old records committed too), but the broker answers
everything: the relay must not report it down, count attempts, or spin; and it must send the row once
as soon as the other transaction ends.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _kafka_transactions import stable_and_end
from _relay_helpers import publish, rows, start_cli_relay, wait_for
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient

from outbox import Outbox, Relay, RetriableTransportError, create_engine
from outbox.relay import _shard_producer
from outbox.testing import LocalKafka, create_topic
from transports import Record, TransactionOutcome
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MESSAGE_ID = "outbox-message-id"
HELD = "cannot take shard 0 over yet"
OUTAGE = "broker unreachable ("  # the relay's outage line (``RELAY_WORDING``)


@pytest.fixture
def outbox(sqlite_db: str) -> Iterator[Outbox]:
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)  # its one shard held: no shard of the relay can send
    ob.create_tables()
    yield ob
    engine.dispose()


@dataclass
class Held:
    transport: KafkaTransport
    other: Producer
    admin: AdminClient


def another_producer(kafka: str) -> Producer:
    """Another application's transactional producer of the data topic, its transactions long."""
    return Producer({"bootstrap.servers": kafka, "transactional.id": f"another-app-{uuid.uuid4().hex}",
                     "transaction.timeout.ms": 300_000, "log_level": 0})


def abort_then_hold(kafka: str, transport: KafkaTransport, other: Producer, topic: str, progress_topic: str,
                    incarnation: str, shards: Iterable[int]) -> None:
    """The last transaction of each shard of ``shards`` aborted (a record refused for good) after
    writing ``topic[0]``; then ``other``'s transaction left open on ``topic[0]``: those shards are held
    at their next take-over (``topic`` and its refusing twin are made here)."""
    refusing = f"{topic}-refusing"
    create_topic(kafka, topic, 1)
    create_topic(kafka, refusing, 1, config={"max.message.bytes": "256"})
    for shard in shards:
        tid = f"outbox-{incarnation}-{shard}"  # the shard's transactional id (docs/relay.md)
        first = transport.transactional(tid, 5)
        answer = first.send([Record(topic, b"an earlier transaction's row", key=b"k", partition=0),
                             Record(refusing, os.urandom(2000), key=b"big", partition=0),
                             Record(progress_topic, b"{}", key=tid.encode(), partition=shard)])
        assert answer.outcome is TransactionOutcome.ABORTED, answer
        first.close()
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(topic, b"another producer's row, its transaction long", b"c", 0)
    assert other.flush(10) == 0


@pytest.fixture
def held(outbox: Outbox, kafka: str, topic: str, progress_topic: str) -> Iterator[Held]:
    """The relay's transport, whose last transaction of shard 0 was aborted after writing
    ``topic[0]``; then another producer's transaction left open on ``topic[0]`` (``abort_then_hold``)."""
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5.0)
    transport.ensure_compacted_topic(progress_topic, 1, 30)
    other = another_producer(kafka)
    admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
    try:
        abort_then_hold(kafka, transport, other, topic, progress_topic, outbox.load_schema().incarnation, [0])
        yield Held(transport, other, admin)
    finally:
        with suppress(KafkaException):  # aborted by the test already
            other.abort_transaction(10)
        transport.close()


def running(relay: Relay) -> threading.Thread:
    thread = threading.Thread(target=relay.run, kwargs={"stop_timeout": 60.0}, name="held-relay", daemon=True)
    thread.start()
    return thread


def stopped_within(relay: Relay, thread: threading.Thread, seconds: float) -> bool:
    relay.stop()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_shard_held_by_another_producers_transaction_is_no_outage_and_sends_once_it_ends(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str, held: Held,
        caplog: pytest.LogCaptureFixture) -> None:
    """The relay's only shard is held: its settle fails at each try, held by the other transaction.
    The relay logs that once (a WARNING naming the partition and why), logs no broker outage, counts
    no attempt, tries again without spinning, and stops at once when asked; run again, it sends the
    row once as soon as the other transaction ends (an INFO line says it goes on)."""
    publish(outbox, topic, ["k"])
    relay = Relay(outbox, held.transport, exactly_once=True, progress_topic=progress_topic, worker_id="w")
    caplog.set_level(logging.INFO)
    _, end = stable_and_end(held.admin, topic)
    thread = running(relay)
    # Each settle writes an empty record and its abort marker on the data partition: two of them.
    wait_for(lambda: stable_and_end(held.admin, topic)[1] >= end + 4, 40, "two settles of the held shard")
    assert stopped_within(relay, thread, 5), "a relay whose shards are all held did not stop at once"
    warned = [r for r in caplog.records if HELD in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, [r.getMessage() for r in warned]
    said = warned[0].getMessage()
    assert "held by an open transaction" in said and f"{topic}[0]" in said, said
    assert "another producer's transaction" in said and "its rows wait, the other shards send on" in said
    assert not [r.getMessage() for r in caplog.records if OUTAGE in r.getMessage()]
    assert not relay.outages.broker.down
    assert [(r.status, r.attempts) for r in rows(outbox)] == [("pending", 0)]

    thread = running(relay)  # the shard taken again (a new lease epoch): held again, said again
    wait_for(lambda: len([r for r in caplog.records if HELD in r.getMessage()]) == 2, 40,
             "the shard held again")
    held.other.abort_transaction(30)
    wait_for(lambda: rows(outbox, status="published"), 40, "the row sent once the other transaction ended")
    assert stopped_within(relay, thread, 10)
    assert any("took shard 0 over after all" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    assert not [r.getMessage() for r in caplog.records if OUTAGE in r.getMessage()]
    assert [r.attempts for r in rows(outbox)] == [1]
    on_wire = read_topic(kafka, topic, expected=1, settle=1.0, isolation="read_committed")
    assert len(on_wire) == 1 and MESSAGE_ID in dict(on_wire[0].headers), on_wire


def test_a_broker_outage_met_while_the_only_shard_is_held_is_said_over_once_the_broker_answers_again(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str, held: Held,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's only shard is held; then the broker stops answering (simulated: the shard's next
    producer cannot be made, a plain RetriableTransportError), which the relay logs as an outage; then
    it answers again and the shard is held again, the settle's every request answered. The outage is
    over: the relay must say so ("broker reachable again") and no longer report the broker down,
    though nothing can be published until the other transaction ends (minutes, perhaps)."""
    monkeypatch.setattr(_shard_producer, "HELD_AGAIN", 0.0)  # tried again at each batch: no 5 s waits
    publish(outbox, topic, ["k"])
    relay = Relay(outbox, held.transport, exactly_once=True, progress_topic=progress_topic, worker_id="w")
    caplog.set_level(logging.INFO)
    transactions = held.transport
    real = transactions.transactional

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    try:
        wait_for(lambda: relay.run_once() is not None and said(HELD), 60, "the shard held")
        assert not relay.outages.broker.down

        def down(*args: Any, **kwargs: Any) -> Any:
            raise RetriableTransportError("simulated: the broker does not answer")

        monkeypatch.setattr(transactions, "transactional", down)
        wait_for(lambda: relay.run_once() is not None and relay.outages.broker.down, 60, "the outage told")
        assert len(said(OUTAGE)) == 1, said(OUTAGE)
        monkeypatch.setattr(transactions, "transactional", real)
        helds = len(said(HELD))
        wait_for(lambda: relay.run_once() is not None and len(said(HELD)) > helds, 60, "the shard held again")
        for _ in range(2):  # a batch or two more, each settle answered by the broker
            relay.run_once()
        assert [(r.status, r.attempts) for r in rows(outbox)] == [("pending", 0)]
        assert said("reachable again"), "the broker answers every request, yet no end of its outage was told"
        assert not relay.outages.broker.down
    finally:
        relay.close()


def test_sigterm_while_a_relay_processs_only_shard_is_held_exits_at_once_with_0(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str, tmp_path: Path) -> None:
    """A real ``outbox relay --exactly-once`` process: another producer's transaction is open on the
    data partition; the shard's transaction is aborted (a row refused for good), and its next producer's
    settle is held there (``ProducerMaker.remake``). SIGTERM while held: the process exits with 0 within
    its stop bound (``run(stop_timeout=10)``), having logged the hold once and no broker outage."""
    refusing = f"{topic}-refusing"
    create_topic(kafka, topic, 1)
    create_topic(kafka, refusing, 1, config={"max.message.bytes": "256"})
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)
    ob.create_tables()
    other = Producer({"bootstrap.servers": kafka, "transactional.id": f"another-app-{uuid.uuid4().hex}",
                      "transaction.timeout.ms": 300_000, "log_level": 0})
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(topic, b"another producer's row, its transaction long", b"c", 0)
    assert other.flush(10) == 0
    publish(ob, topic, ["k"])
    publish(ob, refusing, ["big"], payload={"blob": "x" * 2000})
    log = tmp_path / "relay.log"
    process = start_cli_relay(sqlite_db, kafka, log, "--exactly-once", "--progress-topic", progress_topic)
    code, took = None, 0.0
    try:
        wait_for(lambda: HELD in log.read_text(), 90, "the shard held", interval=0.2)
        # Held a while: the take-over tried again (HELD_AGAIN) at least once.
        admin = AdminClient({"bootstrap.servers": kafka, "log_level": 0})
        wait_for(lambda: stable_and_end(admin, topic)[1] >= 6, 60, "a second settle", interval=0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            code = process.wait(30)
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        with suppress(KafkaException):
            other.abort_transaction(10)
        engine.dispose()
    text = log.read_text()
    assert code == 0 and took < 12, f"exit {code} after {took:.1f} s: {text[-3000:]}"
    assert text.count(HELD) == 1, text[-3000:]
    assert OUTAGE not in text, text[-3000:]


def held_shards_and_free_ones(sqlite_db: str, kafka: str, topic: str, progress_topic: str,
                              caplog: pytest.LogCaptureFixture, shards: int, held: int) -> list[float]:
    """``shards`` shards; the last transaction of each of shards 0 to ``held`` - 1 was aborted on
    ``topic[0]`` before another producer's transaction was left open there: those are held at every
    try. For about 25 s (five tries each) rows of the other shards are published again and again;
    each held shard is logged once, no broker outage, the relay stops at once. How long each wave
    of the free shards' rows waited to be published."""
    held_shards = range(held)
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=shards)
    ob.create_tables()
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5.0)
    transport.ensure_compacted_topic(progress_topic, shards, 30)
    other = another_producer(kafka)
    relay = None
    try:
        abort_then_hold(kafka, transport, other, topic, progress_topic, ob.load_schema().incarnation,
                        held_shards)
        publish(ob, topic, [f"k{i}" for i in range(16 * shards)])
        assert {r.shard for r in rows(ob)} == set(range(shards))
        relay = Relay(ob, transport, exactly_once=True, progress_topic=progress_topic, worker_id="w")
        caplog.set_level(logging.INFO)
        thread = running(relay)
        wait_for(lambda: {r.shard for r in rows(ob, status="published")} == set(range(held, shards)), 90,
                 "the free shards' rows published")
        started = time.monotonic()
        deadline = started + 25
        waits = []
        while time.monotonic() < deadline:  # a row per free shard, again and again, while the others are held
            keys = [f"k{i}" for i in range(16 * shards)]
            before = time.monotonic()
            publish(ob, topic, keys)
            wait_for(lambda: not [r for r in rows(ob, status="pending") if r.shard >= held], 30,
                     "the free shards' new rows published")
            waits.append(time.monotonic() - before)
        assert stopped_within(relay, thread, 5), "the relay did not stop at once"
        said = [r.getMessage() for r in caplog.records]
        held_lines = [m for m in said if "cannot take shard" in m]
        logged = sorted(int(m.split("cannot take shard ")[1].split()[0]) for m in held_lines)
        assert logged == list(held_shards), held_lines
        assert not [m for m in said if OUTAGE in m]
        assert {(r.status, r.attempts) for r in rows(ob) if r.shard < held} == {("pending", 0)}
        return waits
    finally:
        if relay is not None:
            relay.close()
        with suppress(KafkaException):
            other.abort_transaction(10)
        transport.close()
        engine.dispose()


def test_eight_shards_held_at_once_leave_the_other_eight_sending_and_log_once_each(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Eight of sixteen shards held: the other eight's rows go within seconds (each shard has a
    thread of the pool: the held take-overs do not delay them)."""
    waits = held_shards_and_free_ones(sqlite_db, kafka, topic, progress_topic, caplog, 16, 8)
    # 0.29-1.1 s measured; the bound is a held take-over's period (``HELD_AGAIN``), for loaded runs.
    assert max(waits) < 5.0, waits


def test_a_broker_killed_and_started_again_while_the_only_shard_is_held_is_one_outage_told_over(
        sqlite_db: str, own_kafka: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The relay's only shard is held (another producer's transaction open on the data partition);
    the broker is killed (one outage logged), then started again: the shard is held again, every
    request of its settle answered. The outage must be told over ("broker reachable again") though
    nothing is published until the other transaction ends."""
    kafka = own_kafka.bootstrap
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)
    ob.create_tables()
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5.0)
    other = another_producer(kafka)
    relay = None

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    try:
        transport.ensure_compacted_topic(progress_topic, 1, 30)
        abort_then_hold(kafka, transport, other, topic, progress_topic, ob.load_schema().incarnation, [0])
        publish(ob, topic, ["k"])
        relay = Relay(ob, transport, exactly_once=True, progress_topic=progress_topic, worker_id="w")
        caplog.set_level(logging.INFO)
        thread = running(relay)
        wait_for(lambda: said(HELD), 60, "the shard held")
        own_kafka.kill()
        wait_for(lambda: said(OUTAGE), 90, "the outage told")
        own_kafka.start()
        wait_for(lambda: len(said(HELD)) >= 2, 120, "the shard held again, the broker back")
        held_again = time.monotonic()
        wait_for(lambda: time.monotonic() > held_again + 12, 20, "two more tries")  # HELD_AGAIN: 5 s
        assert stopped_within(relay, thread, 10)
        assert len(said(OUTAGE)) == 1, said(OUTAGE)
        assert [(r.status, r.attempts) for r in rows(ob)] == [("pending", 0)]
        assert said("reachable again"), "the broker answers every request again, its outage not told over"
        assert not relay.outages.broker.down
    finally:
        if relay is not None:
            relay.close()
        with suppress(KafkaException):
            other.abort_transaction(10)
        transport.close()
        engine.dispose()
