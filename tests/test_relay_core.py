"""The relay's batch rules on SQLite, PostgreSQL and MariaDB: order, retries, failures, delays, restarts."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
import tenacity
from _relay_helpers import ScriptedTransport, drain, publish, rows, seqs_by_key

from outbox import Alert, ConfigurationError, Outbox, Relay, create_engine
from outbox.core._sharding import partition_for_key
from transports import Outcome, SendResult
from transports.kafka import KafkaTransport
from transports.testing import partition_count, read_topic

FAST = tenacity.wait_fixed(0.3)


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """All three databases: MySQL's fetch has its own "an earlier row blocks my key" probe."""
    return proof_db_url


@pytest.mark.kafka
def test_every_row_reaches_its_key_partition_in_seq_order(outbox: Outbox, kafka: str, topic: str) -> None:
    keys = [f"k{i % 13}" for i in range(400)] + [None] * 20
    publish(outbox, topic, keys)
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka), batch_size=97)
    drain(relay)
    relay.close()
    stored = rows(outbox)
    assert {r.status for r in stored} == {"published"}
    assert all(r.kafka_partition is not None and r.kafka_offset is not None for r in stored)
    records = read_topic(kafka, topic, expected=len(keys))
    assert len(records) == len(keys)
    partitions = partition_count(kafka, topic)
    expected = {f"k{k}".encode(): list(range(1, keys.count(f"k{k}") + 1)) for k in range(13)}
    assert seqs_by_key(records) == expected
    for record in records:
        if record.key is not None:
            assert record.partition == partition_for_key(record.key, partitions)
    stored_positions = {(r.kafka_partition, r.kafka_offset) for r in stored}
    assert stored_positions == {(r.partition, r.offset) for r in records}


def test_a_retried_head_holds_its_key_while_other_keys_flow(outbox: Outbox) -> None:
    ids = publish(outbox, "orders", ["a", "a", "a", "b", "b"])
    transport = ScriptedTransport({str(ids[0]): [Outcome.RETRY, Outcome.RETRY]})
    # 3 s: the second run_once below must come before the head is due again; at 0.3 s a loaded
    # machine (PostgreSQL, CI at load 10) let the head fall due first and the test failed.
    relay = Relay(outbox, transport, backoff=tenacity.wait_fixed(3.0))
    first = relay.run_once()
    assert (first.published, first.retried) == (2, 1)
    head = rows(outbox, message_id=ids[0])[0]
    assert head.status == "pending" and head.attempts == 1 and head.last_error == "scripted retry"
    assert head.available_at > datetime.now(UTC)
    assert [r.status for r in rows(outbox, key="a")] == ["pending"] * 3
    assert [r.attempts for r in rows(outbox, key="a")[1:]] == [0, 0]
    assert relay.run_once().fetched == 0  # the head is not due, so nothing of key a is
    drain(relay)
    relay.close()
    assert [(r.key, int(dict(r.headers)["outbox-seq"])) for r in transport.sent] == [
        (b"b", 1), (b"b", 2), (b"a", 1), (b"a", 2), (b"a", 3)
    ]
    assert rows(outbox, message_id=ids[0])[0].attempts == 3


def test_a_failed_row_blocks_only_its_key_and_alerts_once(outbox: Outbox) -> None:
    ids = publish(outbox, "orders", ["a", "a", "b"])
    alerts: list[Alert] = []
    relay = Relay(outbox, ScriptedTransport({str(ids[0]): [Outcome.FAILED]}), alert=alerts.append)
    relay.run_once()
    for _ in range(3):
        assert relay.run_once().fetched == 0
    relay.close()
    assert [r.status for r in rows(outbox)] == ["failed", "pending", "published"]
    assert rows(outbox)[0].last_error == "scripted failed"
    assert [(a.kind, a.key, a.message_id) for a in alerts] == [("message_failed", "a", str(ids[0]))]


def test_delayed_messages_are_not_sent_early_and_hold_their_key(outbox: Outbox) -> None:
    # 3 s: the first run_once below must come before the delay is over; on a loaded machine two
    # publishes and a relay's start on PostgreSQL took more than 1 s, and the test failed.
    delay = 3.0
    started = time.monotonic()  # before publish(): the delay counts from its clock reading
    publish(outbox, "orders", ["a"], delay=delay)
    publish(outbox, "orders", ["a", "b"])
    transport = ScriptedTransport()
    relay = Relay(outbox, transport)
    relay.run_once()
    assert [r.key for r in transport.sent] == [b"b"]
    while rows(outbox, status="pending"):
        relay.run_once()
        if rows(outbox, key="a", status="published"):
            assert time.monotonic() - started >= delay
        time.sleep(0.05)
    relay.close()
    assert [(r.key, dict(r.headers)["outbox-seq"]) for r in transport.sent] == [
        (b"b", b"1"), (b"a", b"1"), (b"a", b"2")
    ]
    assert "outbox-available-at" in dict(transport.sent[1].headers)


def test_a_restarted_relay_honours_attempts_and_next_attempt_time(outbox: Outbox) -> None:
    ids = publish(outbox, "orders", ["a"])
    first = Relay(outbox, ScriptedTransport({str(ids[0]): [Outcome.RETRY]}),
                  backoff=tenacity.wait_fixed(1.5))
    first.run_once()
    first.close()
    row = rows(outbox)[0]
    assert (row.attempts, row.status) == (1, "pending")
    transport = ScriptedTransport()
    restarted = Relay(outbox, transport)  # a new process: empty wheel
    assert restarted.run_once().fetched == 0
    # Until shortly before the persisted time (run_once reads the clock again after this check).
    while datetime.now(UTC) < row.available_at - timedelta(seconds=0.2):
        assert restarted.run_once().fetched == 0
        time.sleep(0.05)
    drain(restarted)
    restarted.close()
    assert len(transport.sent) == 1 and rows(outbox)[0].attempts == 2


def test_a_retry_backs_off_even_when_the_publisher_clock_ran_ahead(outbox: Outbox) -> None:
    """Next attempt from max(relay now, created_at): else a fast publisher's row is "due" at once."""
    before = datetime.now(UTC)
    ids = publish(outbox, "orders", [None, "k"])
    m = outbox.tables.messages
    # The publisher's clock, a minute ahead of the relay's: far more than the test lasts
    # on a loaded machine, so the rows stay "in the future" for the relay throughout.
    ahead = timedelta(seconds=60)
    stored = rows(outbox)
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        for row in stored:
            conn.execute(m.update().where(m.c.id == row.id).values(
                created_at=row.created_at + ahead, available_at=row.available_at + ahead))
    assert all(r.created_at > before + timedelta(seconds=59) for r in rows(outbox))
    transport = ScriptedTransport({str(i): [Outcome.RETRY] for i in ids})
    relay = Relay(outbox, transport, backoff=tenacity.wait_fixed(2))
    assert relay.run_once().retried == 2
    for row in rows(outbox):
        assert row.available_at >= row.created_at + timedelta(seconds=2), row
    # Neither row is due again: not the unkeyed one in a tight loop, not the keyed one
    # after a restart (a new process has an empty wheel).
    for _ in range(5):
        assert relay.run_once().sent == 0
    relay.close()
    restarted = Relay(outbox, transport)
    assert restarted.run_once().fetched == 0
    restarted.close()
    assert transport.sent == []


def test_a_relay_whose_lease_expired_cannot_mark(outbox: Outbox) -> None:
    publish(outbox, "orders", ["a", "b", "c"])
    other = Relay(outbox, ScriptedTransport(), lease_ttl=0.5)

    class Paused(ScriptedTransport):
        def publish(self, records):  # the broker acks, then this relay stalls past its TTL
            results = super().publish(records)
            time.sleep(0.7)
            other.leases.maintain()  # the other relay takes the expired shards over
            return results

    paused = Relay(outbox, Paused(), lease_ttl=0.5)
    result = paused.run_once()
    assert (result.sent, result.published, result.fenced) == (3, 0, 3)
    assert {r.status for r in rows(outbox)} == {"pending"}
    drain(other)
    assert {r.status for r in rows(outbox)} == {"published"}
    other.close()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": "10"}, "batch_size"),
    ({"lease_ttl": -1}, "lease_ttl"),
    ({"poll_interval": 0}, "poll_interval"),
    ({"worker_id": "x" * 201}, "worker_id"),
    ({"alert": "ops@example.com"}, "alert"),
    ({"backoff": 3}, "backoff"),
])
def test_bad_settings_fail_at_construction(outbox: Outbox, kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        Relay(outbox, ScriptedTransport(), **kwargs)


def test_transport_must_publish(outbox: Outbox) -> None:
    with pytest.raises(ConfigurationError, match="publish"):
        Relay(outbox, object())  # type: ignore[arg-type]


def test_delay_backoff_is_capped() -> None:
    wait = tenacity.wait_exponential_jitter(multiplier=0.2, max=30, jitter=0.2)
    state = tenacity.RetryCallState(None, None, (), {})
    state.attempt_number = 500
    assert wait(state) <= 30.2
    assert timedelta(seconds=wait(state)) <= timedelta(seconds=30.2)


def test_a_pipelined_write_holds_the_keys_it_stops_until_it_commits(server_db_url: str, monkeypatch) -> None:
    """PostgreSQL excludes the rows being written in the fetch, MySQL after it: either way
    b1, delivered and being written, is not sent again, and a2 waits behind a1. The batch that
    finds nothing to send but what the write holds waits for the write and fetches again (nothing
    else would wake the relay when it commits): a1 then goes, and a2 behind it."""
    outbox = Outbox(create_engine(server_db_url))
    outbox.create_tables()
    ids = publish(outbox, "orders", ["a", "a", "b"])
    transport = ScriptedTransport({str(ids[0]): [Outcome.RETRY]})
    relay = Relay(outbox, transport, backoff=tenacity.wait_fixed(0))  # the wheel fires at once
    step = relay._step
    write = step._batch._write
    monkeypatch.setattr(step._batch, "_write", lambda plan: time.sleep(0.5) or write(plan))
    step.prepare()
    step.run_batch(wait=False)  # a1 retried, b1 delivered; the write is still running
    time.sleep(0.1)  # past the wheel's tick
    step.prepare()
    assert ("orders", "a") not in relay.wheel
    second = step.run_batch(wait=False)
    # a1 is being written (excluded) and a's retry timer has fired, but the database does not
    # know yet that a waits: a2 must not go out ahead of a1. After the write, a1 is due.
    assert second.sent == 2
    assert [(r.key, dict(r.headers)["outbox-seq"]) for r in transport.sent] == [
        (b"b", b"1"), (b"a", b"1"), (b"a", b"2")]
    drain(relay)
    relay.close()
    assert [(r.key, dict(r.headers)["outbox-seq"]) for r in transport.sent] == [
        (b"b", b"1"), (b"a", b"1"), (b"a", b"2")
    ]
    outbox.engine.dispose()  # type: ignore[union-attr]


def gated_writes(step: object, monkeypatch) -> threading.Event:
    """Every outcome write of ``step``'s batches waits until the returned event is set."""
    batch = step._batch  # type: ignore[attr-defined]
    write, gate = batch._write, threading.Event()
    monkeypatch.setattr(batch, "_write", lambda plan: (gate.wait(20), write(plan))[1])
    return gate


def batch_in_thread(step: object) -> tuple[threading.Thread, list]:
    """A pipelined batch of ``step`` on a thread of its own; the list gets its result."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(step.run_batch(wait=False)),  # type: ignore[attr-defined]
                              daemon=True)
    thread.start()
    return thread, out


def held_until_opened(thread: threading.Thread, gate: threading.Event, why: str) -> None:
    """``thread`` still runs while ``gate`` is shut (else fails with ``why``), and ends once it opens."""
    try:
        thread.join(0.5)
        assert thread.is_alive(), why
    finally:
        gate.set()
    thread.join(10)
    assert not thread.is_alive()


def test_a_batch_is_sent_while_the_previous_batch_is_written(server_db_url: str, monkeypatch) -> None:
    """Two writes may be unfinished at once: the next batch is fetched and sent while the previous
    batch's mark has not committed (it waited for it, and a message committed meanwhile waited too),
    the keys either write stops stay held, and a third batch waits for the oldest write."""
    outbox = Outbox(create_engine(server_db_url))
    outbox.create_tables()
    ids = publish(outbox, "orders", ["a", "b"])
    transport = ScriptedTransport({str(ids[0]): [Outcome.RETRY]})
    relay = Relay(outbox, transport, backoff=tenacity.wait_fixed(0))  # the wheel fires at once
    step = relay._step
    gate = gated_writes(step, monkeypatch)
    try:
        step.prepare()
        step.run_batch(wait=False)  # a1 retried, b1 delivered; their write waits at the gate
        publish(outbox, "orders", ["c", "a"])
        time.sleep(0.1)  # past the wheel's tick
        step.prepare()
        second, out = batch_in_thread(step)
        second.join(10)
        assert not second.is_alive(), "the batch waited for the previous batch's write"
        # a1 is being written (excluded), a2 is held behind it although a's timer fired.
        assert (out[0].sent, out[0].held) == (1, 1)
        assert [r.key for r in transport.sent] == [b"b", b"c"]
        publish(outbox, "orders", ["d"])
        third, _ = batch_in_thread(step)
        held_until_opened(third, gate, "a third batch went on with two writes unfinished")
    finally:
        gate.set()
    drain(relay)
    relay.close()
    sent = [(r.key, dict(r.headers)["outbox-seq"]) for r in transport.sent]
    assert sent[:3] == [(b"b", b"1"), (b"c", b"1"), (b"d", b"1")]
    assert sorted(sent[3:]) == [(b"a", b"1"), (b"a", b"2")] and sent[3] == (b"a", b"1")
    assert {r.status for r in rows(outbox)} == {"published"}
    outbox.engine.dispose()  # type: ignore[union-attr]


class OneShardTransactions:
    """Exactly-once mode's ``ExactlyOnce`` as the batch runner sees it, every record delivered."""

    def __init__(self, transport: ScriptedTransport) -> None:
        self.transport = transport

    def prepare(self, owned: dict[int, int]) -> tuple[dict[int, int], None]:
        return owned, None

    def send(self, records: list, rows: list) -> list[SendResult]:
        return self.transport.publish(records)

    def marked(self, ids: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.postgres
def test_exactly_once_keeps_one_write_in_flight(postgres_db: str, monkeypatch) -> None:
    """A shard's progress record names the rows committed and not known marked, and its size was
    checked for two batches: in exactly-once mode a batch still waits for the previous write."""
    outbox = Outbox(create_engine(postgres_db))
    outbox.create_tables()
    publish(outbox, "orders", ["a"])
    transport = ScriptedTransport()
    relay = Relay(outbox, transport)
    step = relay._step
    monkeypatch.setattr(step._batch, "exactly_once", OneShardTransactions(transport))
    gate = gated_writes(step, monkeypatch)
    try:
        step.prepare()
        step.run_batch(wait=False)  # a1 sent; its write waits at the gate
        publish(outbox, "orders", ["b"])
        second, _ = batch_in_thread(step)
        held_until_opened(second, gate, "an exactly-once batch went on with the previous write unfinished")
    finally:
        gate.set()
    monkeypatch.undo()
    relay.close()
    assert [r.key for r in transport.sent] == [b"a", b"b"]
    assert {r.status for r in rows(outbox)} == {"published"}
    outbox.engine.dispose()  # type: ignore[union-attr]


def test_a_pipelined_write_that_meets_an_outage_tells_it_then(server_db_url: str, monkeypatch) -> None:
    """Not when the next batch waits for the write: after the outage, its fetch would answer first,
    and the old write's error would read as a second outage just after the first ended."""
    outbox = Outbox(create_engine(server_db_url))
    outbox.create_tables()
    publish(outbox, "orders", ["a"])
    relay = Relay(outbox, ScriptedTransport())
    step = relay._step
    written = threading.Event()

    def lost(plan: object) -> None:
        try:
            raise sa.exc.OperationalError("UPDATE", {}, ConnectionResetError("server closed the connection"))
        finally:
            written.set()
    monkeypatch.setattr(step._batch, "_write", lost)
    step.run(wait=False)  # sent; its outcomes are written behind, and that write meets an outage
    assert written.wait(10)
    deadline = time.monotonic() + 5
    while not relay.outages.database.down and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.outages.database.down, "the outage waits to be told until the next batch"
    monkeypatch.undo()
    drain(relay)  # the database answers: the row goes again, and is marked
    relay.close()
    assert not relay.outages.database.down
    outbox.engine.dispose()  # type: ignore[union-attr]


class AnsweringThen(ScriptedTransport):
    """Returns ``first`` for the batch's first record and ``rest`` for every other one, once."""

    def __init__(self, first: SendResult, rest: SendResult) -> None:
        super().__init__()
        self.first, self.rest = first, rest

    def publish(self, records):  # type: ignore[no-untyped-def]
        if self.first is None:
            return super().publish(records)
        results = [self.first] + [self.rest] * (len(records) - 1)
        self.first = None  # type: ignore[assignment]
        return results


PURGED = SendResult(Outcome.RETRY, error="Local: Purged in flight", unreachable=True)


@pytest.mark.parametrize(("first", "down", "attempts"), [
    (PURGED, True, [0, 0, 0]),  # no answer for anything: the broker is down, nothing counted
    # The gap-less stop: the refused record fails (its attempt), the purged rest is not counted.
    (SendResult(Outcome.FAILED, error="Broker: Invalid record"), False, [1, 0, 0]),
    # The broker answered one with a retriable error: that one counts; the unanswered rest do not.
    (SendResult(Outcome.RETRY, error="Broker: Not enough in-sync replicas"), False, [1, 0, 0]),
    # A node died under the batch: what it led got no answer, the rest was delivered. The
    # unanswered rows waited for an outage and count nothing (they counted one before).
    (SendResult(Outcome.DELIVERED, 0, 0), False, [1, 0, 0]),
])
def test_only_a_batch_without_any_answer_is_a_broker_outage(
    outbox: Outbox, first: SendResult, down: bool, attempts: list[int]
) -> None:
    """After a refused record, the gap-less stop purges the rest unanswered: the record is FAILED,
    the others wait without an attempt counted, and no broker outage is reported (or logged).
    A record without an answer never counts an attempt, whatever became of the batch's others;
    only a batch of which nothing was delivered and nothing answered is the broker down."""
    publish(outbox, "orders", ["a", "b", "c"])
    relay = Relay(outbox, AnsweringThen(first, PURGED), backoff=FAST)
    batch = relay.run_once()
    assert batch.broker_unreachable is down
    assert [r.attempts for r in rows(outbox)] == attempts
    relay.close()
