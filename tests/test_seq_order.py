"""Seq order is commit order: the property the relay's and inbox's ordering rest on."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session


def seqs(engine, outbox, key: str) -> dict:
    m = outbox.tables.messages
    with engine.connect() as conn:
        rows = conn.execute(sa.select(m.c.message_id, m.c.seq).where(m.c.key == key)).all()
    return {message_id: seq for message_id, seq in rows}


def test_second_transaction_waits_and_gets_the_next_seq(engine, outbox):
    """T2 starts while T1 is open; T1 commits first, so T1 gets 1 and T2 gets 2."""
    first = Session(engine)
    first.begin()
    id_first = outbox.publish(first, "orders", {"n": 1}, key="order-1")

    result: dict = {}

    def second_transaction() -> None:
        with Session(engine) as session, session.begin():
            result["id"] = outbox.publish(session, "orders", {"n": 2}, key="order-1")
        result["done_at"] = time.monotonic()

    thread = threading.Thread(target=second_transaction)
    thread.start()
    time.sleep(0.5)
    assert "done_at" not in result, "the second writer of a key must wait for the first"
    committed_at = time.monotonic()
    first.commit()
    first.close()
    thread.join(10)
    assert result["done_at"] >= committed_at
    assert seqs(engine, outbox, "order-1") == {id_first: 1, result["id"]: 2}


@pytest.mark.postgres
def test_later_transaction_that_commits_first_gets_seq_1(postgres_db):
    """On PostgreSQL the order of BEGIN does not matter, only the order of commit."""
    from outbox import Outbox, create_engine

    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    early = Session(engine)
    early.begin()
    early.execute(sa.text("SELECT 1"))  # the early transaction is open and has a snapshot
    with Session(engine) as late, late.begin():
        id_late = outbox.publish(late, "orders", {"n": "late"}, key="k")
    id_early = outbox.publish(early, "orders", {"n": "early"}, key="k")
    early.commit()
    early.close()
    assert seqs(engine, outbox, "k") == {id_late: 1, id_early: 2}
    engine.dispose()


@pytest.mark.postgres
@pytest.mark.slow
def test_concurrent_writers_get_gapless_seqs_per_key(postgres_db):
    """8 threads x 500 publishes over 20 keys, sleeping inside their transactions."""
    from outbox import Outbox, create_engine

    engine = create_engine(postgres_db, pool_size=10)
    outbox = Outbox(engine)
    outbox.create_tables()
    commits: dict[str, list] = defaultdict(list)
    lock = threading.Lock()

    def writer(worker: int) -> None:
        rng = random.Random(worker)
        for _ in range(500):
            key = f"key-{rng.randrange(20)}"
            with Session(engine) as session, session.begin():
                message_id = outbox.publish(session, "orders", {"w": worker}, key=key)
                time.sleep(rng.random() * 0.002)
            with lock:
                commits[key].append(message_id)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    m = outbox.tables.messages
    with engine.connect() as conn:
        rows = conn.execute(sa.select(m.c.key, m.c.seq, m.c.id).order_by(m.c.key, m.c.seq)).all()
    assert len(rows) == 8 * 500
    by_key: dict[str, list] = defaultdict(list)
    for key, seq, row_id in rows:
        by_key[key].append((seq, row_id))
    assert len(by_key) == 20
    for key, pairs in by_key.items():
        assert [s for s, _ in pairs] == list(range(1, len(pairs) + 1)), f"gap or repeat in {key}"
        ids = [row_id for _, row_id in pairs]
        assert ids == sorted(ids), f"id order differs from seq order in {key}"
        assert len(pairs) == len(commits[key])
    engine.dispose()
