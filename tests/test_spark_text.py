"""Text is data: the Spark readers return every stored string exactly, and NULL only for NULL.

Keys, topics and consumer groups are written straight into the tables (as a
row written by SQL or an older release would be), then read back through every
reader path of ``outbox.spark``: PostgreSQL's COPY fast path, the generic
SQLAlchemy path (what a binary column, another driver, MariaDB and SQLite
take), partitioned by id and by consumer group, in Python and once through
Spark per database. Texts range over all of Unicode except what no database
can store: lone surrogates (not UTF-8) and, on PostgreSQL, NUL (its ``text``
cannot hold U+0000; in the JSON headers it is an escape and allowed).
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
import sqlalchemy as sa
from _spark_seed import spark_for_tests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import Outbox, OutboxTables, create_engine
from outbox.spark import _pgcopy, audit, read_table
from outbox.spark._source import _RangeReader

pytestmark = pytest.mark.spark
tables = OutboxTables()

# Every word a CSV, pandas, Arrow or Spark reader has been known to take for a missing value.
NULL_LIKE = [
    "", "NA", "N/A", "n/a", "NaN", "nan", "-NaN", "-nan", "null", "NULL", "Null", "None", "none",
    "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "1.#IND", "1.#QNAN", "<NA>", "NIL", "nil",
    "\\N", "\\\\N", "undefined", "inf", "-inf", "Infinity", "true", "false", "t", "f", "0",
]
# What CSV, COPY and JSON quoting, line splitting or trimming could alter.
HAZARDS = [
    " ", "  ", " NA", "NA ", "\t", "a\tb", "\n", "\r", "\r\n", "a\r\nb", "a\rb", "\n\n", ",", "a,b",
    '"', '""', 'q"q"', "'", "\\", "a\\b", "\\.", "\x1f", "\x7f", "\ufeff", "\ufeffNA", "\u200f",
    "\u202eNA", "\u2028", "\u00a0", "e\u0301", "\u00e9", "😀", "\U0010ffff", "\ufffd",
    "x" * 249, "𝄞" * 249, "k" * 255, "😀" * 255,
]
KEY_MAX, TOPIC_MAX, GROUP_MAX = 255, 249, 255
EXAMPLES = int(os.environ.get("SPARK_TEXT_EXAMPLES", "25"))


def texts(max_size: int, nul: bool) -> st.SearchStrategy[str]:
    """Any text a ``max_size`` column stores: all code points but surrogates (and NUL unless ``nul``)."""
    chars = st.characters(exclude_categories=("Cs",), exclude_characters=() if nul else ("\x00",))
    known = [w for w in NULL_LIKE + HAZARDS if len(w) <= max_size]
    return st.one_of(
        st.sampled_from(known),
        st.text(chars, max_size=max_size),
        st.text(chars, min_size=max_size, max_size=max_size),  # as long as the column allows
    )


@dataclass(frozen=True)
class Text:
    """One message's texts: written into outbox_messages and (for ``group``) inbox_messages."""

    group: str
    topic: str
    key: str | None
    header: str
    value: str


def rows_of(nul: bool) -> st.SearchStrategy[list[Text]]:
    row = st.builds(Text, texts(GROUP_MAX, nul), texts(TOPIC_MAX, nul),
                    st.none() | texts(KEY_MAX, nul), texts(50, True), texts(200, True))
    return st.lists(row, min_size=1, max_size=8)


def fixed_rows(nul: bool) -> list[Text]:
    """Each null-like word and hazard once as group, topic, key and header, plus a real NULL key.

    The first row's texts open with a byte-order mark: written first, they start the reads.
    """
    words = ["\ufeffNA", *(w for w in NULL_LIKE + HAZARDS if nul or "\x00" not in w)]
    return [Text(w[:GROUP_MAX], w[:TOPIC_MAX], w[:KEY_MAX], w[:50], w) for w in words] + [
        Text("g", "t", None, "h", "")]


class Tables:
    """The texts written so far into one database, and what every reader must return for them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = create_engine(url)
        Outbox(self.engine).create_tables()
        self.written: dict[str, Text] = {}

    def write(self, rows: Sequence[Text]) -> None:
        now = datetime.now(UTC)
        ids = [uuid.uuid4() for _ in rows]
        with self.engine.begin() as conn:
            conn.execute(sa.insert(tables.messages), [{
                "message_id": i, "topic": r.topic, "key": r.key, "seq": None if r.key is None else 1,
                "shard": 0, "payload": b"\x00", "content_type": "application/octet-stream",
                "headers": {r.header: r.value}, "created_at": now, "available_at": now,
                "attempts": 0, "status": "pending",
            } for i, r in zip(ids, rows, strict=True)])
            conn.execute(sa.insert(tables.inbox_messages), [{
                "consumer_group": r.group, "message_id": i, "topic": r.topic, "key": r.key, "seq": None,
                "received_at": now, "processed_at": now, "deliveries": 1, "outcome": "processed",
            } for i, r in zip(ids, rows, strict=True)])
        self.written |= {str(i): r for i, r in zip(ids, rows, strict=True)}

    def clear(self) -> None:
        """Empty both tables, so that each read costs what the rows of one example cost."""
        with self.engine.begin() as conn:
            conn.execute(sa.delete(tables.messages))
            conn.execute(sa.delete(tables.inbox_messages))
        self.written = {}

    def expected(self, *fields: str) -> Counter[tuple[Any, ...]]:
        return Counter((m, *(getattr(r, f) for f in fields)) for m, r in self.written.items())

    def check(self, outbox: list[dict[str, Any]], inbox: list[dict[str, Any]], keys: list[Any]) -> None:
        """Raise unless the rows read are exactly the rows written, value for value."""
        assert Counter((r["message_id"], r["topic"], r["key"]) for r in outbox) == self.expected(
            "topic", "key")
        assert {r["message_id"]: json.loads(r["headers"]) for r in outbox} == {
            m: {t.header: t.value} for m, t in self.written.items()}
        assert Counter((r["message_id"], r["consumer_group"], r["topic"], r["key"]) for r in inbox) \
            == self.expected("group", "topic", "key")
        assert Counter(keys) == Counter(t.key for t in self.written.values())


def read_in_python(url: str, table: str, columns: Sequence[str], partitions: int) -> list[dict[str, Any]]:
    """What Spark's tasks read (the ``outbox_table`` data source's partitions, each read in turn)."""
    reader = _RangeReader({"url": url, "table": table, "columns": ",".join(columns),
                           "partitions": str(partitions)})
    return [row for part in reader.partitions() for batch in reader.read(part) for row in batch.to_pylist()]


@contextmanager
def generic_path() -> Iterator[None]:
    """Read PostgreSQL without COPY, as a binary column or another driver makes the reader do."""
    with mock.patch.object(_pgcopy, "supports", return_value=False):
        yield


def check_python_paths(db: Tables) -> None:
    has_copy = db.engine.dialect.name == "postgresql"
    for path in ([generic_path, readers_choice] if has_copy else [readers_choice]):
        with path():
            # The key first and alone too: a one-column row holding NULL is an empty CSV line,
            # and a value starting the COPY stream is where a byte-order mark would be dropped.
            keys = [r["key"] for r in read_in_python(db.url, "outbox_messages", ["key"], 1)]
            outbox = read_in_python(db.url, "outbox_messages", ["key", "message_id", "topic", "headers"], 2)
            inbox = read_in_python(db.url, "inbox_messages",
                                   ["key", "consumer_group", "message_id", "topic"], 3)
            db.check(outbox, inbox, keys)


@contextmanager
def readers_choice() -> Iterator[None]:
    """The reader's own choice: COPY on PostgreSQL through psycopg, the generic path elsewhere."""
    yield


@pytest.fixture(scope="module")
def spark(java_home):
    return spark_for_tests()


def test_null_like_words_and_hazards_are_read_back_exactly(proof_db_url):
    """Each word once as group, topic, key and header, through every Python reader path."""
    db = Tables(proof_db_url)
    try:
        db.write(fixed_rows(nul=db.engine.dialect.name != "postgresql"))
        check_python_paths(db)
    finally:
        db.engine.dispose()


@pytest.mark.slow
def test_every_drawn_text_is_read_back_exactly_in_python_and_spark(spark, proof_db_url):
    """Hypothesis-drawn rows, example by example through every Python reader path, then all
    of them (and the words above) through Spark once: the tasks' Arrow batches go through the
    JVM and back. ``SPARK_TEXT_EXAMPLES`` sets the examples per database (25; a release: 2000)."""
    db = Tables(proof_db_url)
    nul = db.engine.dialect.name != "postgresql"
    every: list[Text] = fixed_rows(nul)
    try:
        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(rows_of(nul))
        def drawn(rows: list[Text]) -> None:
            db.clear()
            db.write(rows)
            check_python_paths(db)
            every.extend(rows)

        drawn()
        assert len(every) >= len(fixed_rows(nul)) + EXAMPLES  # every example wrote at least a row
        db.clear()
        db.write(every)
        # Only the outbox in Spark: the inbox makes a range (a task) per consumer group.
        outbox = read_table(spark, db.url, "outbox_messages", columns=["message_id", "topic", "key"],
                            partitions=3).toArrow().to_pylist()
        assert Counter((r["message_id"], r["topic"], r["key"]) for r in outbox) == db.expected(
            "topic", "key")
    finally:
        db.engine.dispose()


@pytest.mark.postgres
def test_copy_sends_utf8_whatever_the_client_encoding(postgres_db):
    """A session whose client encoding is not UTF-8 (PGCLIENTENCODING on an executor, a role's
    default) still gets UTF-8 from COPY, which is what Arrow decodes."""
    db = Tables(postgres_db)
    try:
        db.write(fixed_rows(nul=False))
        latin1 = sa.make_url(postgres_db).update_query_dict({"client_encoding": "LATIN1"})
        outbox = read_in_python(latin1.render_as_string(hide_password=False), "outbox_messages",
                                ["key", "message_id", "topic", "headers"], 2)
        assert Counter((r["message_id"], r["topic"], r["key"]) for r in outbox) == db.expected(
            "topic", "key")
    finally:
        db.engine.dispose()


# The audit over a topic, a key and a group that are each called "NA".

AS_OF = datetime(2026, 1, 10, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def na_database(postgres_server):
    """Topic "NA": key "NA" seq 1..3 and one unkeyed message; group "billing" processes
    seq 3 before seq 2, group "NA" processes everything in order."""
    from outbox.testing import fresh_database

    with fresh_database(postgres_server) as url:
        engine = create_engine(url)
        Outbox(engine).create_tables()
        start = AS_OF - timedelta(hours=1)
        ids = [uuid.uuid4() for _ in range(4)]
        messages = [("NA", 1), ("NA", 2), ("NA", 3), (None, None)]
        with engine.begin() as conn:
            conn.execute(sa.insert(tables.messages), [{
                "message_id": ids[i], "topic": "NA", "key": key, "seq": seq, "shard": 0,
                "payload": b"{}", "content_type": "application/json", "headers": {},
                "created_at": start + timedelta(seconds=i), "available_at": start,
                "attempts": 1, "status": "published",
                "published_at": start + timedelta(seconds=i, milliseconds=10),
            } for i, (key, seq) in enumerate(messages)])
            order = {"NA": [0, 1, 2, 3], "billing": [0, 2, 1, 3]}
            conn.execute(sa.insert(tables.inbox_messages), [{
                "consumer_group": group, "message_id": ids[i], "topic": "NA",
                "key": messages[i][0], "seq": messages[i][1],
                "received_at": start + timedelta(minutes=1, seconds=place),
                "processed_at": start + timedelta(minutes=1, seconds=place),
                "deliveries": 1, "outcome": "processed",
            } for group, sequence in order.items() for place, i in enumerate(sequence)])
        engine.dispose()
        yield url


@pytest.mark.slow
@pytest.mark.postgres
def test_audit_reports_topic_NA_and_finds_reordered_key_NA(spark, na_database, tmp_path):
    import pandas as pd

    result = audit(na_database, out_dir=tmp_path / "audit", group="billing", sla="10m",
                   as_of=AS_OF, spark=spark)

    reordered = pd.read_parquet(tmp_path / "audit" / "out_of_order")
    assert reordered[["consumer_group", "topic", "key", "seq", "processed_after_seq"]].to_dict(
        "records") == [{"consumer_group": "billing", "topic": "NA", "key": "NA", "seq": 2,
                        "processed_after_seq": 3}]
    assert list(result.summary["topics"]) == ["NA"]
    assert result.summary["topics"]["NA"]["produced"] == 4
    assert result.summary["groups"] == {"billing": {"NA": mock.ANY}}
    assert "| NA | 4 |" in (tmp_path / "audit" / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.postgres
def test_audit_of_group_NA_beside_another_group(spark, na_database, tmp_path):
    result = audit(na_database, out_dir=tmp_path / "audit", sla="10m", as_of=AS_OF, spark=spark)

    assert set(result.summary["groups"]) == {"NA", "billing"}
    assert result.summary["groups"]["NA"]["NA"]["consumed"] == 4
    assert result.summary["groups"]["NA"]["NA"]["out_of_order_messages"] == 0
    assert result.summary["groups"]["billing"]["NA"]["out_of_order_messages"] == 1
