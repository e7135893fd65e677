"""Exactly once on the wire, attacked: schedules and inputs the mode's first proofs did not try.

Each test runs on Apache Kafka and reads the topic back read_committed.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _kafka_transactions import KilledAtCommit
from _relay_helpers import drain, drain_pipelined, publish, rows, seqs_by_key, start_cli_relay, wait_for
from confluent_kafka.admin import AdminClient, ConfigResource

from outbox import ConfigurationError, Outbox, Relay, create_engine
from outbox.testing import LocalKafka, LocalPostgres, create_topic
from tests.conftest import thawed_and_running
from transports import Record, TransactionResult
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

MESSAGE_ID = "outbox-message-id"

ONE_BROKER = pytest.mark.xdist_group("exactly-once-attacks")
"""The tests that freeze or kill a broker share the module's (``module_kafka``): one JVM start
instead of three, and a group of their own so that they run on one worker. Each works on a topic,
progress topic and outbox (so transactional ids) of its own and leaves the broker running; a
transaction a killed relay left open is on that test's topics alone."""


@pytest.fixture
def own_kafka(module_kafka: LocalKafka) -> LocalKafka:
    return thawed_and_running(module_kafka)


@pytest.fixture
def outbox(proof_db_url: str) -> Iterator[Outbox]:
    """On SQLite, PostgreSQL and MySQL/MariaDB (the lease fence of a mark is each one's SQL)."""
    engine = create_engine(proof_db_url)
    ob = Outbox(engine, shards=2)
    ob.create_tables()
    yield ob
    engine.dispose()


def relay(outbox: Outbox, kafka: str, progress_topic: str, **kwargs: Any) -> Relay:
    return Relay(outbox, KafkaTransport(bootstrap_servers=kafka), exactly_once=True,
                 progress_topic=progress_topic, lease_ttl=1.0, **kwargs)


def assert_once_each(outbox: Outbox, kafka: str, topic: str, n: int) -> None:
    """Every row published, and each of its ``n`` messages on the topic once (read committed)."""
    on_wire = read_topic(kafka, topic, expected=n, settle=1.5, isolation="read_committed")
    twice = {mid: count for mid, count in copies(on_wire).items() if count > 1}
    assert twice == {}
    assert len(on_wire) == n
    assert {r.status for r in rows(outbox)} == {"published"}


def copies(records: list[Record]) -> Counter[bytes]:
    return Counter(dict(r.headers)[MESSAGE_ID] for r in records)


def sent_once(outbox: Outbox, topic: str) -> Counter[bytes]:
    """What ``copies`` of a topic is when each of its rows was sent exactly once."""
    return Counter(str(r.message_id).encode() for r in rows(outbox) if r.topic == topic)


def test_a_relay_whose_mark_was_fenced_never_sends_those_rows_again(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay commits a batch, then stalls past its lease before the mark; another relay takes
    the shards in the database (it has not made their producers yet). The stalled relay's mark is
    fenced, and its worker's next batch runs on the leases it still believes it holds (``Relay.run``
    renews them on another thread): the rows its transaction carried are pending again. Its Kafka
    producer is not fenced yet, so whatever it sends commits. It must not send them again."""
    keys = [f"k{i % 3}" for i in range(12)]
    publish(outbox, topic, keys)
    stalled = relay(outbox, kafka, progress_topic, worker_id="stalled")
    taker = relay(outbox, kafka, progress_topic, worker_id="taker")
    batch = stalled._step._batch
    real_write = batch._write

    def stall_then_write(plan: Any) -> Any:
        # Frozen past the lease: the taker takes every shard in the database meanwhile.
        wait_for(lambda: len(taker._step.maintain_leases()) == 2, 30, "the taker holding the shards",
                 interval=0.2)
        return real_write(plan)

    monkeypatch.setattr(batch, "_write", stall_then_write)
    first = stalled.run_once()
    monkeypatch.undo()
    assert first.published == 0 and first.fenced == len(keys)  # committed on Kafka, mark fenced
    # The stalled relay's worker goes on before its lease thread noticed (Relay.run's worker).
    stalled._step.run(wait=True, leases=False)
    drain(taker, timeout=60)  # fences the stalled relay, marks what the progress names
    taker.close()
    stalled.close()
    assert_once_each(outbox, kafka, topic, len(keys))


class Killed(BaseException):
    """The process died here (nothing after it runs, nothing is cleaned up)."""


def test_a_take_over_whose_recovery_mark_was_fenced_never_sends_those_rows_again(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay dies after its commit, before its mark. The next owner reads the progress and marks
    the rows it names, but stalls past its lease before that mark: a third relay takes the shards in
    the database meanwhile, and the mark is fenced. The stalled relay's batch then runs on the lease
    it believes it holds: the rows are still pending, and were on the wire already."""
    keys = [f"k{i % 3}" for i in range(12)]
    publish(outbox, topic, keys)
    dead = relay(outbox, kafka, progress_topic, worker_id="dead")

    def die(plan: Any) -> Any:
        raise Killed

    monkeypatch.setattr(dead._step._batch, "_write", die)
    with pytest.raises(Killed):
        dead.run_once()
    monkeypatch.undo()
    stalled = relay(outbox, kafka, progress_topic, worker_id="stalled")
    third = relay(outbox, kafka, progress_topic, worker_id="third")
    eo = stalled._step._batch.exactly_once
    assert eo is not None
    real_mark = eo._mark

    def stall_then_mark(*args: Any) -> Any:
        wait_for(lambda: len(third._step.maintain_leases()) == 2, 30, "the third relay holding the shards",
                 interval=0.2)
        return real_mark(*args)

    monkeypatch.setattr(eo, "_mark", stall_then_mark)
    wait_for(lambda: len(stalled._step.maintain_leases()) == 2, 30, "the dead relay's leases taken",
             interval=0.2)
    stalled._step.run(wait=True, leases=False)
    monkeypatch.undo()
    drain(third, timeout=60)
    third.close()
    stalled.close()
    assert_once_each(outbox, kafka, topic, len(keys))



@pytest.mark.postgres
def test_a_batch_size_whose_progress_record_could_outgrow_the_limit_is_refused_and_the_largest_is_sent(
        postgres_db: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The progress record names every row of the shard's transaction, and while a batch's mark is
    written (pipelined) the next record names that batch's rows too. A hot key puts the whole batch
    in one shard; long ids (a database that has used many: 19 digits here) make the record grow
    with the batch, not with the records. Over the producer's limit, every transaction of the shard
    aborted, forever: nothing was ever published (seen with batch_size=5,000 and 100 kB; here 8 kB).
    Now such a batch_size is refused at start, and the largest one allowed goes through, pipelined."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine, shards=1, max_record_bytes=8192)
    outbox.create_tables()
    m = outbox.tables.messages
    with engine.begin() as conn:  # ids have reached 19 digits
        conn.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{m.name}', 'id'), {10**18})"))

    def transport() -> KafkaTransport:
        return KafkaTransport({"message.max.bytes": 8192}, bootstrap_servers=kafka)

    with pytest.raises(ConfigurationError, match=r"batch_size=5000.*use batch_size (\d+) at most") as refused:
        Relay(outbox, transport(), exactly_once=True, progress_topic=progress_topic, batch_size=5_000,
              worker_id="w")
    most = int(re.search(r"use batch_size (\d+) at most", str(refused.value)).group(1))  # type: ignore[union-attr]
    # 8 kB, less the topics header's 2 kB, over three batches of 21-byte ids and each record's position
    assert 40 < most < 60
    n = 2 * most + 10
    publish(outbox, topic, ["hot"] * n)
    worker = Relay(outbox, transport(), exactly_once=True, progress_topic=progress_topic, batch_size=most,
                   worker_id="w")
    drain_pipelined(worker, monkeypatch, timeout=60)
    worker.close()
    on_wire = read_topic(kafka, topic, expected=n, settle=1.0, isolation="read_committed")
    assert len(on_wire) == n and max(copies(on_wire).values()) == 1
    assert {r.attempts for r in rows(outbox)} == {1}  # each sent in one transaction, none aborted
    # Nor waited as if the broker were down (a refused progress record can end its transaction so).
    warned = [r.getMessage() for r in caplog.records
              if r.name == "outbox.relay" and r.levelno >= logging.WARNING]
    assert warned == []
    engine.dispose()


@ONE_BROKER
def test_sigterm_while_transactions_wait_on_a_frozen_broker_exits_on_time(
        sqlite_db: str, own_kafka: LocalKafka, topic: str, progress_topic: str, tmp_path: Path) -> None:
    """The batch's shards commit on threads of their own; the broker freezes under them. SIGTERM:
    ``run()`` returns within its 10 s ``stop_timeout`` whatever is down, and so must the process."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=4)
    outbox.create_tables()
    keys = [f"k{i % 16}" for i in range(160)]  # every shard in each batch
    publish(outbox, topic, keys)
    log = tmp_path / "relay.log"
    process = start_cli_relay(sqlite_db, own_kafka.bootstrap, log, "--exactly-once", "--progress-topic",
                              progress_topic, "--lease-ttl", "2", "--batch-size", "40")
    try:
        wait_for(lambda: not rows(outbox, status="pending"), 90, "the first rows published", interval=0.2)
        own_kafka.freeze()
        publish(outbox, topic, keys)
        # The relay's next poll fetches them; its shards' transactions wait on the frozen broker
        # (nothing outside the process tells when: any moment of the wait is as good).
        time.sleep(2.0)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        own_kafka.thaw()
        engine.dispose()
    assert code is not None and took < 15, f"exit {code} after {took:.1f} s: {log.read_text()[-2000:]}"


@pytest.mark.slow
@ONE_BROKER
def test_a_broker_killed_mid_transaction_and_a_relay_killed_while_it_is_down_lose_and_repeat_nothing(
        sqlite_db: str, own_kafka: LocalKafka, topic: str, progress_topic: str, tmp_path: Path) -> None:
    """Messages flow through ``outbox relay --exactly-once``; the broker is SIGKILLed under its
    transactions, the relay is SIGKILLed while the broker is down (commits of unknown fate, marks not
    made), the broker comes back and a second relay takes over; then the broker is killed once more
    under the second relay, which lives on. Read committed: every message once, in seq order per key,
    and no attempt counted for the outages (each row published at its first attempt)."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=4)
    outbox.create_tables()
    keys = [f"k{i % 24}" for i in range(1_200)]
    done = threading.Event()

    def publisher() -> None:
        for i in range(0, len(keys), 40):
            publish(outbox, topic, keys[i:i + 40])
            time.sleep(0.1)
        done.set()

    log = tmp_path / "relay.log"
    args = ("--exactly-once", "--progress-topic", progress_topic, "--lease-ttl", "2", "--batch-size", "60")
    first = start_cli_relay(sqlite_db, own_kafka.bootstrap, log, "--worker-id", "first", *args)
    second = None
    writer = threading.Thread(target=publisher, name="publisher")
    writer.start()
    try:
        wait_for(lambda: len(rows(outbox, status="published")) >= 150, 90, "the first rows published",
                 interval=0.1)
        own_kafka.kill()
        wait_for(lambda: len(rows(outbox, status="pending")) >= 40, 30, "rows waiting for the broker")
        first.kill()
        first.wait()
        own_kafka.start()
        second = start_cli_relay(sqlite_db, own_kafka.bootstrap, log, "--worker-id", "second", *args)
        published = len(rows(outbox, status="published"))
        wait_for(lambda: len(rows(outbox, status="published")) >= published + 150, 90,
                 "the second relay publishing", interval=0.1)
        own_kafka.kill()
        wait_for(lambda: len(rows(outbox, status="pending")) >= 40, 30, "rows waiting for the broker")
        own_kafka.start()
        assert done.wait(60)
        wait_for(lambda: not rows(outbox, status="pending"), 120, "every row published", interval=0.2)
    finally:
        done.wait(60)
        writer.join(10)
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(30)
        engine.dispose()
    on_wire = read_topic(own_kafka.bootstrap, topic, expected=len(keys), settle=2.0,
                         isolation="read_committed")
    twice = {mid: n for mid, n in copies(on_wire).items() if n > 1}
    assert twice == {}
    assert len(on_wire) == len(keys)
    assert seqs_by_key(on_wire) == {k.encode(): list(range(1, 51)) for k in sorted(set(keys))}
    counted = Counter(r.attempts for r in rows(outbox))
    assert counted == {1: len(keys)}, f"attempts: {counted}"


def test_the_progress_topic_the_relay_makes_is_compacted_with_a_partition_per_shard(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str) -> None:
    """Kafka's default ``auto.create.topics.enable=true``: looking the missing progress topic up made
    the broker create it with its own defaults (cleanup.policy=delete, 4 partitions on the test
    broker), and the relay, finding it, never made the compacted one with a partition per shard."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=6)
    outbox.create_tables()
    publish(outbox, topic, ["a", "b"])
    worker = relay(outbox, kafka, progress_topic)
    drain(worker, timeout=60)
    worker.close()
    engine.dispose()
    admin = AdminClient({"bootstrap.servers": kafka})
    resource = ConfigResource("topic", progress_topic)
    config = admin.describe_configs([resource])[resource].result(30)
    partitions = admin.list_topics(progress_topic, timeout=30).topics[progress_topic].partitions
    assert (config["cleanup.policy"].value, len(partitions)) == ("compact", 6)


def test_an_unkeyed_row_a_compacted_topic_refuses_fails_alone(
        outbox: Outbox, kafka: str, topic: str, progress_topic: str) -> None:
    """A compacted topic refuses a record without a key (the broker's own validation, at the
    request, not librdkafka's): it aborts its transaction; it alone fails, everything else once."""
    create_topic(kafka, topic, 3, config={"cleanup.policy": "compact"})
    keys: list[str | None] = [f"k{i % 4}" for i in range(20)]
    keys[7] = None
    publish(outbox, topic, keys)
    alerts: list[Any] = []
    worker = relay(outbox, kafka, progress_topic, alert=alerts.append)
    drain(worker, timeout=60)
    worker.close()
    (failed,) = rows(outbox, status="failed")
    assert failed.key is None and len(alerts) == 1
    on_wire = read_topic(kafka, topic, expected=19, settle=1.0, isolation="read_committed")
    assert len(on_wire) == 19 and max(copies(on_wire).values()) == 1


@pytest.mark.slow
@pytest.mark.postgres
def test_a_relay_killed_while_its_database_is_down_after_commits_is_taken_over_without_repeats(
        own_postgres: LocalPostgres, kafka: str, topic: str, progress_topic: str, tmp_path: Path) -> None:
    """Batches flow through ``outbox relay --exactly-once``; PostgreSQL stops under them (commits whose
    marks never came, kept only in the relay's memory); the relay is SIGKILLed before the database
    returns; another relay takes over from the progress records. Every message once, in seq order
    per key, each row published at its first attempt."""
    url = own_postgres.url
    engine = create_engine(url)
    outbox = Outbox(engine, shards=4)
    outbox.create_tables()
    keys = [f"k{i % 12}" for i in range(600)]
    publish(outbox, topic, keys[:300])
    log = tmp_path / "relay.log"
    args = ("--exactly-once", "--progress-topic", progress_topic, "--lease-ttl", "2", "--batch-size", "20")
    first = start_cli_relay(url, kafka, log, "--worker-id", "first", *args)
    second = None
    try:
        wait_for(lambda: len(rows(outbox, status="published")) >= 60, 90, "the first rows published",
                 interval=0.05)
        own_postgres.stop("immediate")  # under the flow: a batch committed, its mark cut off
        engine.dispose()
        time.sleep(1.0)  # the relay goes on against the stopped database (no outside sign to wait on)
        first.kill()
        first.wait()
        own_postgres.start()
        publish(outbox, topic, keys[300:])
        second = start_cli_relay(url, kafka, log, "--worker-id", "second", *args)
        wait_for(lambda: not rows(outbox, status="pending"), 120, "every row published", interval=0.2)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(30)
    on_wire = read_topic(kafka, topic, expected=len(keys), settle=2.0, isolation="read_committed")
    twice = {mid: n for mid, n in copies(on_wire).items() if n > 1}
    assert twice == {}
    assert len(on_wire) == len(keys)
    assert seqs_by_key(on_wire) == {k.encode(): list(range(1, 51)) for k in sorted(set(keys))}
    counted = Counter(r.attempts for r in rows(outbox))
    engine.dispose()
    assert counted == {1: len(keys)}, f"attempts: {counted}"


def test_a_row_addressed_to_the_progress_topic_cannot_forge_a_shards_progress(
        tmp_path: Path, kafka: str, topic: str, progress_topic: str) -> None:
    """A row's topic is the application's: one naming the progress topic must not be written there.
    Here the forged record names the ids the next rows of shard ``s`` will take; a take-over of
    shard ``s`` reads it as that shard's last committed progress."""
    from outbox.core._sharding import shard_for_key
    # The forged row must go in the other shard's transaction, after shard s's last progress record:
    # an outbox whose incarnation puts one id in the other shard (3 in 4 do).
    for attempt in range(40):
        engine = create_engine(f"sqlite:///{tmp_path}/forge{attempt}.db")
        ob = Outbox(engine, shards=2)
        ob.create_tables()
        tids = [f"outbox-{ob.load_schema(engine).incarnation}-{s}" for s in range(2)]
        victim = next((s for s in range(2) if shard_for_key(tids[s], 2) != s), None)
        if victim is not None:
            break
        engine.dispose()
    assert victim is not None
    create_topic(kafka, topic, 2)
    create_topic(kafka, progress_topic, 1, config={"cleanup.policy": "compact"})
    publish(ob, progress_topic, [tids[victim]], payload={"ids": list(range(2, 60))})
    alerts: list[Any] = []
    first = relay(ob, kafka, progress_topic, worker_id="first", alert=alerts.append)
    drain(first, timeout=60)
    first.close()
    (forged,) = rows(ob, status="failed")
    assert forged.topic == progress_topic and len(alerts) == 1
    keys = [k for k in (f"k{i}" for i in range(200)) if shard_for_key(k, 2) == victim][:10]
    publish(ob, topic, keys)
    second = relay(ob, kafka, progress_topic, worker_id="second")
    drain(second, timeout=60)
    second.close()
    on_wire = read_topic(kafka, topic, expected=10, settle=1.5, isolation="read_committed")
    assert {r.status for r in rows(ob) if r.topic == topic} == {"published"}
    engine.dispose()
    assert len(on_wire) == 10, f"{10 - len(on_wire)} committed rows marked published, never sent"
    assert copies(on_wire) == sent_once(ob, topic)  # not a duplicate making up for a loss


def test_a_rightful_owner_fenced_by_a_stray_producer_counts_no_attempt(
        tmp_path: Path, kafka: str, topic: str, progress_topic: str) -> None:
    """A producer of a shard's id made elsewhere (a take-over thread of an earlier epoch, a relay on a
    skewed clock: ``_shard_producer``) fences the owner's; its next transaction is refused, and the
    rows go again once it made its producer anew. That is nothing the rows did: no attempt counted."""
    engine = create_engine(f"sqlite:///{tmp_path}/fenced.db")
    ob = Outbox(engine, shards=1)
    ob.create_tables()
    incarnation = ob.load_schema(engine).incarnation
    create_topic(kafka, topic, 1)
    publish(ob, topic, ["k"])
    worker = relay(ob, kafka, progress_topic, worker_id="owner")
    drain(worker, timeout=60)  # taken over, its producer made
    stray = KafkaTransport(bootstrap_servers=kafka)
    stray_producer = stray.transactional(f"outbox-{incarnation}-0", 30)  # fences the owner's
    publish(ob, topic, ["k"] * 5)
    drain(worker, timeout=60)
    worker.close()
    stray_producer.close()
    stray.close()
    on_wire = read_topic(kafka, topic, expected=6, settle=1.0, isolation="read_committed")
    assert len(on_wire) == 6
    assert copies(on_wire) == sent_once(ob, topic)  # each row once: no duplicate hides a loss
    assert [r.attempts for r in rows(ob)] == [1] * 6
    engine.dispose()



@ONE_BROKER
def test_a_broker_that_stops_answering_between_a_commit_and_its_read_back_gets_nothing_twice(
        sqlite_db: str, own_kafka: LocalKafka, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit is answered (the coordinator decided it), then the broker stops answering (frozen: a
    hung host; a SIGKILL in the broker-kill campaign) before the relay read the progress partition's
    last stable offset back. That read's future did not finish within its wait, and concurrent.futures'
    ``TimeoutError`` (not a ``KafkaException``) escaped the transaction: the batch failed with a
    traceback, the shard kept its producer, and the next batch sent the committed rows again in a new
    transaction of that producer (twice on the wire, nothing lost). It is an unknown outcome, settled by
    a new producer of the id and the progress read: every row once."""
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)
    ob.create_tables()
    keys = [f"k{i % 3}" for i in range(12)]
    publish(ob, topic, keys)
    # A lease that outlives the freeze: a lease taken afresh would make a new producer anyway.
    # delivery_timeout: the read back waits this long.
    worker = Relay(ob, KafkaTransport(bootstrap_servers=own_kafka.bootstrap, delivery_timeout=6.0),
                   exactly_once=True, progress_topic=progress_topic, lease_ttl=60.0, worker_id="w")
    eo = worker._step._batch.exactly_once
    assert eo is not None
    transactions = eo._transactions
    real = transactions.transactional
    frozen: list[bool] = []

    def freeze_once() -> None:
        if not frozen:
            frozen.append(True)
            own_kafka.freeze()

    def transactional(*args: Any, **kwargs: Any) -> Any:
        producer = real(*args, **kwargs)
        if not frozen:
            producer._producer = KilledAtCommit(producer._producer, after=freeze_once)
        return producer

    monkeypatch.setattr(transactions, "transactional", transactional)
    try:
        # Before, it raised TimeoutError: Relay.run logs "batch failed" and runs the next batch,
        # as drain does.
        with suppress(TimeoutError):
            worker.run_once()
    finally:
        own_kafka.thaw()
    assert frozen, "the broker was never frozen"
    drain(worker, timeout=60)
    worker.close()
    on_wire = read_topic(own_kafka.bootstrap, topic, expected=len(keys), settle=1.5,
                         isolation="read_committed")
    assert {mid: n for mid, n in copies(on_wire).items() if n > 1} == {}
    assert len(on_wire) == len(keys)
    assert {r.status for r in rows(ob)} == {"published"}
    engine.dispose()


def test_a_transaction_that_raises_is_settled_as_unknown_not_sent_again_by_its_producer(
        sqlite_db: str, kafka: str, topic: str, progress_topic: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A shard's transaction commits, then ``send`` raises (a transport bug: a read-back's
    ``TimeoutError`` did). The batch failed and the shard kept its producer: the next batch sent the
    committed rows again in a new transaction (twice on the wire). Its fate is unknown: the producer is
    dropped, a new one made and the progress read, which names the rows: every row once, logged."""
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)
    ob.create_tables()
    keys = [f"k{i % 3}" for i in range(9)]
    publish(ob, topic, keys)
    worker = Relay(ob, KafkaTransport(bootstrap_servers=kafka), exactly_once=True,
                   progress_topic=progress_topic, lease_ttl=60.0, worker_id="w")
    eo = worker._step._batch.exactly_once
    assert eo is not None
    transactions = eo._transactions
    real = transactions.transactional
    raised: list[bool] = []

    def transactional(*args: Any, **kwargs: Any) -> Any:
        producer = real(*args, **kwargs)
        if not raised:
            sending = producer.send

            def send_then_raise(records: Any) -> TransactionResult:
                answer = sending(records)
                if not raised:
                    raised.append(True)
                    raise RuntimeError(f"after {answer.outcome}")
                return answer

            producer.send = send_then_raise
        return producer

    monkeypatch.setattr(transactions, "transactional", transactional)
    # Before, the batch failed: Relay.run logs it and runs the next batch, as drain does.
    with suppress(RuntimeError):
        worker.run_once()
    assert raised
    drain(worker, timeout=60)
    worker.close()
    on_wire = read_topic(kafka, topic, expected=len(keys), settle=1.5, isolation="read_committed")
    assert {mid: n for mid, n in copies(on_wire).items() if n > 1} == {}
    assert len(on_wire) == len(keys)
    assert {r.status for r in rows(ob)} == {"published"}
    assert any("outcome is unknown" in r.getMessage() for r in caplog.records)
    engine.dispose()
