"""Exactly-once take-overs hold only their own shard, proved on Apache Kafka (issue 36).

A shard's take-over reads its progress partition read_committed: an open
transaction of another producer there holds the read until that transaction
ends. The relay's other shards must publish on meanwhile, and the held shard
catch up once the transaction ends.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from _relay_helpers import publish, rows, seqs_by_key, wait_for
from confluent_kafka import Producer

from outbox import Outbox, Relay, create_engine
from outbox.core._sharding import shard_for_key
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

SHARDS = 4
MESSAGE_ID = "outbox-message-id"


@pytest.fixture
def outbox(sqlite_db: str) -> Iterator[Outbox]:
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=SHARDS)
    ob.create_tables()
    yield ob
    engine.dispose()


def keys_by_shard(per_shard: int) -> dict[int, list[str]]:
    """``per_shard`` keys of each shard."""
    found: dict[int, list[str]] = {s: [] for s in range(SHARDS)}
    i = 0
    while any(len(k) < per_shard for k in found.values()):
        key = f"k{i}"
        if len(found[shard_for_key(key, SHARDS)]) < per_shard:
            found[shard_for_key(key, SHARDS)].append(key)
        i += 1
    return found


def open_foreign_transaction(kafka: str, topic: str, partition: int) -> Producer:
    """A producer of another transactional id left mid-transaction on ``topic[partition]``."""
    producer = Producer({"bootstrap.servers": kafka, "transactional.id": f"foreign-{uuid.uuid4().hex}",
                         "transaction.timeout.ms": 300_000, "log_level": 0})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"not the relay's", key=b"foreign", partition=partition)
    producer.flush(30)
    return producer


def test_a_take_over_held_at_a_foreign_open_transaction_holds_only_its_own_shard(
        outbox: Outbox, kafka: str, topic: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The held read gives up (``HeldByOpenTransactionError``, once it found the transaction another
    producer's) and is tried again at later batches, logged once; the other shards publish
    meanwhile; the held shard catches up once in order."""
    progress_topic = f"{topic}-progress"
    held = 0
    keys = keys_by_shard(2)
    order = [k for _ in range(5) for shard in range(SHARDS) for k in keys[shard]]  # 5 rows a key
    publish(outbox, topic, order)
    held_keys = set(keys[held])
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5.0)
    transport.ensure_compacted_topic(progress_topic, SHARDS, 30)
    foreign = open_foreign_transaction(kafka, progress_topic, held)
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=progress_topic, worker_id="w")
    maker = relay._step._batch.exactly_once._maker  # type: ignore[union-attr]
    tries: Counter[int] = Counter()
    real_make = maker.make

    def make(shard: int, state: Any, **kwargs: Any) -> bool:
        tries[shard] += 1
        return real_make(shard, state, **kwargs)

    monkeypatch.setattr(maker, "make", make)

    def published(shard_keys: set[str]) -> int:
        return sum(1 for r in rows(outbox, status="published") if r.key in shard_keys)

    others = {k for shard in range(SHARDS) if shard != held for k in keys[shard]}
    others_n = sum(1 for k in order if k in others)
    caplog.set_level(logging.INFO, logger="outbox.relay")
    started = time.monotonic()
    # The held shard's read is held by the foreign transaction at each try: the others are not.
    wait_for(lambda: (relay.run_once(), published(others) == others_n)[1], 15,
             "the other shards' rows published while one shard's take-over is held", interval=0.0)
    assert time.monotonic() - started < 15
    end = time.monotonic() + 12  # and stays held while batches run on, its read failing and retried
    while time.monotonic() < end:
        relay.run_once()
    assert published(held_keys) == 0
    stuck = [r for r in caplog.records if f"cannot take shard {held} over" in r.getMessage()]
    assert tries[held] >= 2  # tried again at later batches
    assert len(stuck) == 1 and stuck[0].levelno == logging.WARNING  # logged once, though retried
    assert {r.attempts for r in rows(outbox, status="pending")} == {0}  # waiting is no attempt
    foreign.abort_transaction(30)
    wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 60,
             "the held shard caught up once the foreign transaction ended", interval=0.0)
    relay.close()
    assert any(f"took shard {held} over after all" in r.getMessage() for r in caplog.records)
    on_wire = read_topic(kafka, topic, expected=len(order), settle=1.0, isolation="read_committed")
    assert len(on_wire) == len(order)
    assert max(Counter(dict(r.headers)[MESSAGE_ID] for r in on_wire).values()) == 1
    assert seqs_by_key(on_wire) == {k.encode(): [1, 2, 3, 4, 5] for k in set(order)}
    assert {r.attempts for r in rows(outbox)} == {1}
