"""Replay: archived messages of chosen keys come back as new outbox messages, in key order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _spark_seed import AS_OF, build, seed, spark_for_tests
from sqlalchemy.orm import Session

from outbox import ConfigurationError, InvalidTopicError, Outbox, OutboxTables, create_engine
from outbox.spark import REPLAY_HEADER, archive, replay

pytestmark = pytest.mark.spark
messages = OutboxTables().messages


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """These Spark jobs run on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


@pytest.fixture(scope="module")
def spark(java_home):
    return spark_for_tests()


def outbox_rows(url: str) -> list[dict]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(sa.select(messages).order_by(messages.c.id)).mappings()]
    engine.dispose()
    return rows


@pytest.fixture
def archived(spark, db_url, tmp_path):
    """A database whose old messages are archived, with the originals remembered."""
    seed(build(n=2_000, keys=40), db_url, db_url)
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:  # some typed messages: a replay keeps each one's type
        conn.execute(sa.update(messages).where(messages.c.id % 3 == 0).values(event_type="OrderPaid"))
    engine.dispose()
    originals = {str(r["message_id"]): r for r in outbox_rows(db_url)}
    root = tmp_path / "archive"
    archive(db_url, root, retention="10m", as_of=AS_OF, chunk_rows=500, spark=spark)
    left = {str(r["message_id"]) for r in outbox_rows(db_url)}
    return db_url, root, {k: r for k, r in originals.items() if k not in left}


def test_two_keys_come_back_in_original_order_naming_the_original(spark, archived):
    url, root, gone = archived
    keys = ["k3", "k17"]
    expected = {
        key: [mid for mid, r in sorted(
            ((mid, r) for mid, r in gone.items() if r["topic"] == "orders" and r["key"] == key),
            key=lambda item: item[1]["seq"])]
        for key in keys
    }
    assert all(len(ids) > 10 for ids in expected.values())
    assert {gone[mid]["event_type"] for ids in expected.values() for mid in ids} == {"OrderPaid", None}
    before = {r["id"] for r in outbox_rows(url)}

    result = replay(root, url, topic="orders", keys=keys, batch=7, spark=spark)

    new = [r for r in outbox_rows(url) if r["id"] not in before]
    assert result.replayed == len(new) == sum(map(len, expected.values()))
    for key in keys:
        mine = sorted((r for r in new if r["key"] == key), key=lambda r: r["seq"])
        assert [r["headers"][REPLAY_HEADER] for r in mine] == expected[key]
        seqs = [r["seq"] for r in mine]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # fresh seqs, no gaps
        for row in mine:
            original = gone[row["headers"][REPLAY_HEADER]]
            assert str(row["message_id"]) != row["headers"][REPLAY_HEADER]
            assert (row["topic"], row["payload"], row["content_type"], row["status"], row["event_type"]) == (
                "orders", original["payload"], original["content_type"], "pending", original["event_type"])
            assert {k: v for k, v in row["headers"].items() if k != REPLAY_HEADER} == original["headers"]


def test_time_range_selects_by_original_creation(spark, archived):
    url, root, gone = archived
    times = sorted(r["created_at"] for r in gone.values() if r["topic"] == "payments")
    since, until = times[10], times[30]
    before = {r["id"] for r in outbox_rows(url)}

    replay(root, url, topic="payments", since=since, until=until, spark=spark)

    new = [r for r in outbox_rows(url) if r["id"] not in before]
    assert sorted(r["headers"][REPLAY_HEADER] for r in new) == sorted(
        mid for mid, r in gone.items() if r["topic"] == "payments" and since <= r["created_at"] < until)
    assert len(new) == 20


def test_a_users_replay_of_header_in_another_case_is_replaced_not_doubled(spark, sqlite_db, tmp_path):
    """Header names are one in any case: an archived message that carries its own ``Replay-Of`` comes
    back with one ``replay-of`` (naming the original), never two headers of one name."""
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    with Session(engine) as session, session.begin():
        original = outbox.publish(session, "orders", {"n": 1}, key="k",
                                  headers={"Replay-Of": "an earlier incident", "n": "1"})
    with Session(engine) as session, session.begin():  # a newer row: the newest stays (docs/operations.md)
        outbox.publish(session, "later", {"n": 2}, key="k")
    old = datetime.now(UTC) - timedelta(hours=1)
    with engine.begin() as conn:
        conn.execute(sa.update(messages).where(messages.c.message_id == original)
                     .values(status="published", created_at=old, published_at=old))
    engine.dispose()
    root = tmp_path / "archive"
    archive(sqlite_db, root, retention="10m", spark=spark)

    assert replay(root, sqlite_db, topic="orders", spark=spark).replayed == 1

    [row] = [r for r in outbox_rows(sqlite_db) if r["topic"] == "orders"]
    assert row["headers"] == {"n": "1", REPLAY_HEADER: str(original)}


def test_bad_replay_arguments_are_named(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(InvalidTopicError):
        replay(tmp_path, url, topic="bad topic!")
    with pytest.raises(ConfigurationError, match="empty time range"):
        replay(tmp_path, url, topic="orders", since="2026-01-02", until="2026-01-01")
    with pytest.raises(ConfigurationError, match="does not exist"):
        replay(tmp_path / "nowhere", url, topic="orders")
