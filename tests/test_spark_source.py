"""The table reader: every row exactly once, whatever the partitioning, values intact."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import sqlalchemy as sa
from _spark_seed import build, seed, spark_for_tests

from outbox import ConfigurationError, OutboxTables
from outbox.spark import read_table

pytestmark = pytest.mark.spark
tables = OutboxTables()


@pytest.fixture(scope="module")
def spark(java_home):
    return spark_for_tests()


@pytest.fixture
def seeded(db_url):
    seed(build(n=2_500, keys=30), db_url, db_url)
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        outbox = {str(r.message_id): r for r in conn.execute(sa.select(tables.messages))}
        inbox = Counter((r.consumer_group, str(r.message_id))
                        for r in conn.execute(sa.select(tables.inbox_messages)))
    engine.dispose()
    return db_url, outbox, inbox


@pytest.mark.parametrize("partitions", [1, 7])
def test_every_row_once_with_its_values(spark, seeded, partitions):
    url, outbox, inbox = seeded
    # Without the payload column PostgreSQL takes the COPY path; with it, row fetching.
    for columns in (["message_id", "topic", "key", "seq", "headers", "created_at", "published_at"],
                    ["message_id", "payload", "created_at"]):
        frame = read_table(spark, url, "outbox_messages", columns=columns, partitions=partitions)
        assert frame.rdd.getNumPartitions() == partitions
        rows = frame.toArrow().to_pylist()  # Arrow keeps nulls and UTC time zones as they are
        assert Counter(r["message_id"] for r in rows) == Counter(list(outbox))  # each exactly once
        for row in rows:
            original = outbox[row["message_id"]]
            assert row["created_at"] == original.created_at
            if "payload" in columns:
                assert row["payload"] == original.payload
            else:
                assert (row["topic"], row["key"], row["seq"]) == (original.topic, original.key, original.seq)
                assert json.loads(row["headers"]) == original.headers
                assert row["published_at"] == original.published_at
    consumed = read_table(spark, url, "inbox_messages", columns=["consumer_group", "message_id"],
                          partitions=partitions).toArrow().to_pylist()
    assert Counter((r["consumer_group"], r["message_id"]) for r in consumed) == inbox


def test_time_filter_is_half_open(spark, seeded):
    url, outbox, _ = seeded
    times = sorted(r.created_at for r in outbox.values())
    since, until = times[100], times[200]
    frame = read_table(spark, url, "outbox_messages", columns=["message_id"], time_column="created_at",
                       since=since, until=until, partitions=3)
    assert sorted(frame.toArrow().column("message_id").to_pylist()) == sorted(
        k for k, r in outbox.items() if since <= r.created_at < until)


def test_the_same_reads_as_a_registered_data_source(spark, seeded):
    """spark_session() registers "outbox_table" (the CLI's session leaves it out: it costs seconds)."""
    url, outbox, _ = seeded
    frame = spark.read.format("outbox_table").options(
        url=url, table="outbox_messages", columns="message_id,seq", partitions="3").load()
    assert sorted(frame.toArrow().column("message_id").to_pylist()) == sorted(outbox)


def test_unknown_table_or_column_is_named(spark, tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ConfigurationError, match="unknown table 'outbox'"):
        read_table(spark, url, "outbox")
    with pytest.raises(ConfigurationError, match="has no column"):
        read_table(spark, url, "outbox_messages", columns=["nope"])
    with pytest.raises(ConfigurationError, match="partitions must be at least 1"):
        read_table(spark, url, "outbox_messages", partitions=0)


def test_relative_sqlite_paths_are_made_absolute_for_the_workers(tmp_path, monkeypatch):
    """Spark's Python workers run in their own directory; a relative path must not reach them."""
    from outbox.spark._source import portable_url

    monkeypatch.chdir(tmp_path)
    assert portable_url("sqlite:///orders.db") == f"sqlite:///{tmp_path}/orders.db"
    assert portable_url("sqlite:////data/orders.db") == "sqlite:////data/orders.db"
    assert portable_url("sqlite://") == "sqlite://"
    pg = "postgresql+psycopg://u:secret@db:5432/app"
    assert portable_url(pg) == pg
