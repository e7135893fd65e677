"""A database restored from a backup, its incarnation kept, on Apache Kafka and PostgreSQL.

The copy's relays use the original's transactional ids, so a take-over on the copy reads the
original's last progress record. Once the copy writes past its backup's last row, its new rows
get ids the original already sent: the record names them by id, and before the record named
what each row is, the take-over marked the copy's new rows published without sending them
(lost). The rows' message ids tell the two apart (docs/relay.md, "Limits").
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from _relay_helpers import drain, killed_after_its_commit, publish, rows

from outbox import Outbox, Relay, create_engine
from transports import Record, TransactionOutcome
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

MESSAGE_ID = "outbox-message-id"


def copies_on_the_wire(kafka: str, topic: str, expected: int) -> Counter[str]:
    """How many times each message id is on ``topic`` for a read_committed reader (``expected`` records)."""
    on_wire = read_topic(kafka, topic, expected=expected, settle=2.0, isolation="read_committed")
    return Counter(dict(r.headers)[MESSAGE_ID].decode() for r in on_wire)


def relay(outbox: Outbox, kafka: str, progress_topic: str, worker_id: str) -> Relay:
    return Relay(outbox, KafkaTransport(bootstrap_servers=kafka), exactly_once=True,
                 progress_topic=progress_topic, lease_ttl=1.0, worker_id=worker_id)


def drained(worker: Relay) -> None:
    """``worker`` sends everything pending (60 s at most), then stops."""
    drain(worker, timeout=60)
    worker.close()


@pytest.fixture
def restored(postgres_db: str, postgres_server: str) -> Iterator[tuple[str, str]]:
    """A database's URL and the URL its copy will have (``CREATE DATABASE … TEMPLATE``), the copy
    dropped after the test."""
    original = sa.make_url(postgres_db)
    copy = original.set(database=f"restored_{uuid.uuid4().hex[:12]}")
    yield postgres_db, copy.render_as_string(hide_password=False)
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{copy.database}" WITH (FORCE)')
    admin.dispose()


def backup(postgres_server: str, original: str, copy: str) -> None:
    """A real copy of ``original`` (nothing may be connected to it) at ``copy``."""
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{sa.make_url(copy).database}" '
                             f'TEMPLATE "{sa.make_url(original).database}"')
    admin.dispose()


def test_a_take_over_on_a_restored_copy_sends_the_rows_the_original_sent_other_messages_under(
        restored: tuple[str, str], postgres_server: str, kafka: str, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The original (A) relays rows 1-3, is copied (B), relays rows 4-6; B then writes three new
    messages, rows 4-6 too, and B's relay (same incarnation: same transactional id) takes the shard
    over from A's last progress record, which names ids 4-6. Every one of B's messages must be
    on the wire (read_committed), none marked published unsent; the relay says why it sent them."""
    url_a, url_b = restored
    engine_a = create_engine(url_a)
    a = Outbox(engine_a, shards=1)  # one shard: one transactional id, one progress record to read
    a.create_tables()
    publish(a, topic, ["k1", "k2", "k3"])
    drained(relay(a, kafka, progress_topic, "a"))
    engine_a.dispose()
    backup(postgres_server, url_a, url_b)

    engine_a = create_engine(url_a)
    a = Outbox(engine_a, shards=1)
    publish(a, topic, ["k4", "k5", "k6"])
    drained(relay(a, kafka, progress_topic, "a"))
    sent_by_a = [str(r.message_id) for r in rows(a)]
    assert [r.id for r in rows(a)] == [1, 2, 3, 4, 5, 6]
    incarnation = a.load_schema().incarnation
    engine_a.dispose()

    engine_b = create_engine(url_b)
    b = Outbox(engine_b, shards=1)
    assert b.load_schema().incarnation == incarnation  # a restored backup keeps its incarnation
    publish(b, topic, ["k7", "k8", "k9"])
    new_in_b = {r.id: str(r.message_id) for r in rows(b) if r.id > 3}
    assert sorted(new_in_b) == [4, 5, 6]  # the ids A's last progress record names
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        drained(relay(b, kafka, progress_topic, "b"))
    engine_b.dispose()

    copies = copies_on_the_wire(kafka, topic, 9)
    assert {m: copies[m] for m in new_in_b.values()} == dict.fromkeys(new_in_b.values(), 1), \
        "the restored copy's new rows were marked published without being sent"
    assert {m: copies[m] for m in sent_by_a} == dict.fromkeys(sent_by_a, 1)
    assert sum(copies.values()) == 9
    assert [line for line in caplog.messages if "--new-incarnation" in line], caplog.messages




def test_a_restored_copy_marks_the_rows_its_original_sent_and_sends_nothing_twice_after_its_own_crash(
        restored: tuple[str, str], postgres_server: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The check must not take the copy's own rows for another database's. A's relay dies after its
    commit, before its mark, and A is copied (B holds rows 1-3 pending, already on the wire). B's
    first relay takes the shard over from A's record, which names rows 1-3 with the messages B holds
    under those ids: marked, not sent again; it sends B's new rows 4-6 and dies after its commit too.
    B's next relay reads B's own record: rows 4-6 marked, not sent again. Every message once."""
    url_a, url_b = restored
    engine_a = create_engine(url_a)
    a = Outbox(engine_a, shards=1)
    a.create_tables()
    publish(a, topic, ["k1", "k2", "k3"])
    killed_after_its_commit(relay(a, kafka, progress_topic, "a"), monkeypatch)
    assert len(rows(a, status="pending")) == 3
    engine_a.dispose()
    backup(postgres_server, url_a, url_b)

    engine_b = create_engine(url_b)
    b = Outbox(engine_b, shards=1)
    publish(b, topic, ["k4", "k5", "k6"])
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        killed_after_its_commit(relay(b, kafka, progress_topic, "b1"), monkeypatch)
        assert [r.id for r in rows(b, status="published")] == [1, 2, 3]
        assert [r.id for r in rows(b, status="pending")] == [4, 5, 6]
        drained(relay(b, kafka, progress_topic, "b2"))
    messages = [str(r.message_id) for r in rows(b)]
    engine_b.dispose()

    assert copies_on_the_wire(kafka, topic, len(messages)) == Counter(dict.fromkeys(messages, 1))
    assert not [line for line in caplog.messages if "--new-incarnation" in line], caplog.messages


def test_a_progress_record_of_the_previous_release_is_read_by_id_as_that_release_read_it(
        postgres_db: str, kafka: str, topic: str, progress_topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An upgrade mid-flight: a relay committed rows 1-3 and died before its mark, and the shard's last
    committed progress record is the previous release's (ids, no tags: written here as that release
    wrote it, by a producer of the shard's transactional id). The take-over marks rows 1-3 by id and
    sends none of them again."""
    engine = create_engine(postgres_db)
    outbox = Outbox(engine, shards=1)
    outbox.create_tables()
    publish(outbox, topic, ["k1", "k2", "k3"])
    killed_after_its_commit(relay(outbox, kafka, progress_topic, "before"), monkeypatch)
    tid = f"outbox-{outbox.load_schema().incarnation}-0"
    old = b'{"ids": [1, 2, 3], "sent": [1, 2, 3], "relay": "before", "epoch": 1}'
    transport = KafkaTransport(bootstrap_servers=kafka)
    producer = transport.transactional(tid, 30.0)
    try:
        answer = producer.send([Record(progress_topic, old, key=tid.encode(), partition=0)])
        assert answer.outcome is TransactionOutcome.COMMITTED, answer
    finally:
        producer.close()
        transport.close()
    publish(outbox, topic, ["k4"])
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        drained(relay(outbox, kafka, progress_topic, "after"))
    messages = [str(r.message_id) for r in rows(outbox)]
    engine.dispose()
    assert copies_on_the_wire(kafka, topic, len(messages)) == Counter(dict.fromkeys(messages, 1))
    assert not [line for line in caplog.messages if "--new-incarnation" in line], caplog.messages
