"""The progress record's topics header, counted and bounded, proved on Apache Kafka (issue 36).

Each shard transaction's progress record carries ``outbox-txn-topics``: the
topics the transaction writes. A row's topic is its own, so the relay keeps the
names one transaction writes within ``TOPICS_BYTES`` (rows of further topics go
in the shard's next transaction) and the batch-size check counts that much.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from _relay_helpers import drain_pipelined, publish, rows, wait_for

from outbox import ConfigurationError, Outbox, Relay, create_engine
from outbox.relay._progress import TOPICS_BYTES, TOPICS_HEADER_BYTES
from outbox.testing import create_topic
from transports.kafka import KafkaTransport
from transports.kafka._txn_headers import TOPICS_HEADER
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

MESSAGE_ID, SEQ = "outbox-message-id", "outbox-seq"


def long_topics(kafka: str, base: str, n: int) -> list[str]:
    """``n`` topics of Kafka's longest names (249 characters), made."""
    names = [f"{base}-{j}-".ljust(249, "x") for j in range(n)]
    for name in names:
        create_topic(kafka, name)
    return names


def assert_once_in_order(kafka: str, topics: list[str], per_topic: int) -> None:
    """Each topic holds its ``per_topic`` messages once, their seqs in order."""
    for name in topics:
        on_wire = read_topic(kafka, name, expected=per_topic, settle=1.0, isolation="read_committed")
        assert len(on_wire) == per_topic
        assert max(Counter(dict(r.headers)[MESSAGE_ID] for r in on_wire).values()) == 1
        assert [int(dict(r.headers)[SEQ]) for r in on_wire] == list(range(1, per_topic + 1))


def test_the_header_allowance_is_what_the_size_check_counts() -> None:
    assert len(TOPICS_HEADER) + TOPICS_BYTES + 2 * 5 == TOPICS_HEADER_BYTES


@pytest.fixture
def outbox(sqlite_db: str) -> Iterator[Outbox]:
    engine = create_engine(sqlite_db)
    ob = Outbox(engine, shards=1)
    ob.create_tables()
    yield ob
    engine.dispose()


def test_a_shard_batch_over_more_topics_than_one_header_names_goes_in_several_transactions(
        outbox: Outbox, kafka: str, topic: str) -> None:
    """Twelve topics of 249 characters name 3,000 bytes: more than one header's allowance."""
    progress_topic = f"{topic}-progress"
    topics = long_topics(kafka, topic, 12)
    per_topic = 3
    for _ in range(per_topic):
        for name in topics:
            publish(outbox, name, ["hot"])
    relay = Relay(outbox, KafkaTransport(bootstrap_servers=kafka), exactly_once=True,
                  progress_topic=progress_topic, worker_id="w")
    wait_for(lambda: (relay.run_once(), not rows(outbox, status="pending"))[1], 60, "every row published",
             interval=0.0)
    relay.close()
    assert {r.attempts for r in rows(outbox)} == {1}
    assert_once_in_order(kafka, topics, per_topic)
    progress = read_topic(kafka, progress_topic, expected=2, settle=1.0, isolation="read_uncommitted")
    named = [dict(r.headers)[TOPICS_HEADER].decode().split(",") for r in progress]
    assert len(named) >= 2  # split: one transaction could not name them all
    assert all(len(",".join(n)) <= TOPICS_BYTES for n in named)
    assert {t for n in named for t in n} == {*topics, progress_topic}


@pytest.mark.postgres
def test_a_progress_record_with_its_topics_header_at_its_most_fits_the_limit_and_one_row_more_is_refused(
        postgres_db: str, kafka: str, topic: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The fullest progress record: two batches of 19-digit ids (a hot key, the mark pipelined) and
    a header naming eight topics of 249 characters (2,041 bytes with the progress topic's), under an
    8 kB record limit. The largest batch_size allowed is sent without one refusal; one more is refused
    at start. Before the header was counted, the size allowed let such a record outgrow the limit:
    every transaction of the shard aborted."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine, shards=1, max_record_bytes=8192)
    outbox.create_tables()
    m = outbox.tables.messages
    with engine.begin() as conn:  # ids have reached 19 digits
        conn.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{m.name}', 'id'), {10**18})"))
    progress_topic = f"{topic}-progress"
    topics = long_topics(kafka, topic, 8)
    assert len(",".join([progress_topic, *topics])) > TOPICS_BYTES - 249  # the header about full

    def transport() -> KafkaTransport:
        return KafkaTransport({"message.max.bytes": 8192}, bootstrap_servers=kafka)

    with pytest.raises(ConfigurationError, match=r"use batch_size (\d+) at most") as refused:
        Relay(outbox, transport(), exactly_once=True, progress_topic=progress_topic, batch_size=5_000,
              worker_id="w")
    most = int(re.search(r"use batch_size (\d+) at most", str(refused.value)).group(1))  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match=rf"batch_size={most + 1}:.*topic names"):
        Relay(outbox, transport(), exactly_once=True, progress_topic=progress_topic, batch_size=most + 1,
              worker_id="w")
    per_topic = (2 * most + 10) // len(topics) + 1
    for _ in range(per_topic):  # every batch, in one shard, writes all eight topics
        for name in topics:
            publish(outbox, name, ["hot"])
    worker = Relay(outbox, transport(), exactly_once=True, progress_topic=progress_topic, batch_size=most,
                   worker_id="w")
    drain_pipelined(worker, monkeypatch, timeout=90)
    worker.close()
    assert {r.attempts for r in rows(outbox)} == {1}  # each sent in one transaction, none aborted
    assert_once_in_order(kafka, topics, per_topic)
    warned = [r.getMessage() for r in caplog.records
              if r.name == "outbox.relay" and r.levelno >= logging.WARNING]
    assert warned == []
    engine.dispose()
