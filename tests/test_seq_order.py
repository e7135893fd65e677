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


def test_later_transaction_that_commits_first_gets_seq_1(server_db_url):
    """The order of BEGIN does not matter, only the order of commit: on PostgreSQL, and on
    MySQL/MariaDB under InnoDB's REPEATABLE READ, where the early transaction's snapshot
    predates the late commit (the seq comes from a locking upsert, not from that snapshot)."""
    from outbox import Outbox, create_engine

    engine = create_engine(server_db_url)
    outbox = Outbox(engine)
    outbox.create_tables()
    early = Session(engine)
    early.begin()
    # The early transaction is open and has a snapshot (on InnoDB: from its first read of a table).
    early.execute(sa.select(sa.func.count()).select_from(outbox.tables.keys))
    with Session(engine) as late, late.begin():
        id_late = outbox.publish(late, "orders", {"n": "late"}, key="k")
    id_early = outbox.publish(early, "orders", {"n": "early"}, key="k")
    early.commit()
    early.close()
    assert seqs(engine, outbox, "k") == {id_late: 1, id_early: 2}
    engine.dispose()


@pytest.mark.slow
def test_concurrent_writers_get_gapless_seqs_per_key(server_db_url):
    """8 threads x 500 publishes over 20 keys, sleeping inside their transactions.

    On MySQL/MariaDB at the server's default isolation, REPEATABLE READ.
    """
    from outbox import Outbox, create_engine

    engine = create_engine(server_db_url, pool_size=10)
    outbox = Outbox(engine)
    outbox.create_tables()
    commits: dict[str, list] = defaultdict(list)
    lock = threading.Lock()

    failures: list[BaseException] = []

    def writer(worker: int) -> None:
        try:
            write(worker)
        except BaseException as exc:  # a thread's exception would only be printed
            failures.append(exc)

    def write(worker: int) -> None:
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
    assert not failures, failures

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
