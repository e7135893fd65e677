"""A database made by release 0.1.0 upgrades in place: every row survives, relay and inbox work on it.

The 0.1.0 tables come from a frozen copy of that release's ``_tables.py``
(``tests/_schema_v01.py``), filled the way 0.1.0 filled them. Every entry
point refuses a too-old or too-new schema with a sentence that says what to run.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, drain, seqs_by_key
from _schema_v01 import OutboxTables as TablesV01
from inbox_support import record
from typer.testing import CliRunner

from outbox import Disposition, Inbox, Outbox, OutboxTables, Relay, SchemaError, create_engine
from outbox.cli import app
from outbox.core._schema import SCHEMA_VERSION
from outbox.core._sharding import shard_for_key
from outbox.relay import retry_failed

T, GROUP = "orders", "billing"
NOW = datetime.now(UTC) - timedelta(minutes=5)
OLD_PROCESSED = uuid.uuid4()


def message(key: str | None, seq: int | None, status: str, shards: int, **extra: object) -> dict:
    shard = shard_for_key(key, shards) if key is not None else 0
    return {"message_id": uuid.uuid4(), "topic": T, "key": key, "seq": seq, "shard": shard,
            "payload": b'{"v":1}', "content_type": "application/json", "headers": {"h": "1"},
            "created_at": NOW, "available_at": NOW, "attempts": 0, "last_error": None,
            "status": status, "published_at": NOW if status == "published" else None,
            "kafka_partition": 0 if status == "published" else None,
            "kafka_offset": seq if status == "published" else None} | extra


def stored(key: str, seq: int) -> dict:
    return {"message_id": uuid.uuid4(), "topic": T, "key": key, "seq": seq, "payload": b'{"v":1}',
            "content_type": "application/json", "headers": {}, "created_at": NOW,
            "kafka_partition": 0, "kafka_offset": seq}


def build_v01(url: str, *, shards: int = 16, leases: bool = True) -> None:
    """Tables and rows as release 0.1.0 left them after some traffic, with ``shards`` shards."""
    old = TablesV01()
    engine = sa.create_engine(url)
    old.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(old.messages.insert(), [
            message("a", 1, "published", shards), message("a", 2, "failed", shards, attempts=1,
                                                          last_error="too large"),
            message("a", 3, "pending", shards), message("b", 1, "pending", shards),
            message("b", 2, "pending", shards), message("c", 1, "published", shards),
            message(None, None, "pending", shards),
        ])
        conn.execute(old.keys.insert(), [{"topic": T, "key": k, "last_seq": n}
                                         for k, n in (("a", 3), ("b", 2), ("c", 1))])
        if leases:  # a 0.1 relay inserted one lease row per shard
            conn.execute(old.leases.insert(), [
                {"shard": s, "owner": None, "epoch": 4, "expires_at": NOW} for s in range(shards)])
        conn.execute(old.inbox_messages.insert(), [
            {"consumer_group": GROUP, "message_id": OLD_PROCESSED if seq == 2 else uuid.uuid4(),
             "topic": T, "key": "k", "seq": seq, "received_at": NOW, "processed_at": NOW}
            for seq in (1, 2)])
        conn.execute(old.inbox_keys.insert(), [
            {"consumer_group": GROUP, "topic": T, "key": "k", "last_seq": 2},
            {"consumer_group": GROUP, "topic": T, "key": "p", "last_seq": 0, "parked": True,
             "parked_reason": "handler failed", "parked_at": NOW}])
        conn.execute(old.inbox_parked.insert(), [
            {"consumer_group": GROUP, **stored("p", 1), "reason": "failed", "error": "boom",
             "attempts": 3, "first_failure_at": NOW, "last_failure_at": NOW}])
        conn.execute(old.inbox_held.insert(), [
            {"consumer_group": GROUP, **stored("k", 4), "received_at": NOW}])
    engine.dispose()


def snapshot(url: str) -> dict[str, list[tuple]]:
    """Every row of every 0.1 table, in primary-key order."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = {t.name: [tuple(r) for r in conn.execute(
                    sa.select(t).order_by(*t.primary_key.columns))]
                for t in TablesV01().metadata.sorted_tables}
    engine.dispose()
    return rows


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_a_01_database_upgrades_in_place_and_keeps_every_row(db_url):
    build_v01(db_url)
    before = snapshot(db_url)
    assert sum(map(len, before.values())) == 7 + 3 + 16 + 2 + 2 + 1 + 1

    code, out = cli("init-db", "--db", db_url, "--upgrade")
    assert code == 0, out
    assert f"upgraded schema version 1 to {SCHEMA_VERSION}" in out and "shard count 16" in out
    assert snapshot(db_url) == before
    code, out = cli("init-db", "--db", db_url, "--upgrade")  # a second run changes nothing
    assert code == 0 and "nothing to upgrade" in out, out
    assert snapshot(db_url) == before

    engine = create_engine(db_url)
    outbox = Outbox(engine)
    assert outbox.load_schema().version == SCHEMA_VERSION and outbox.shards == 16
    with outbox.begin() as session:  # a new row of an old key: next seq, same shard
        outbox.publish(session, T, {"v": 2}, key="b")
    new = Relay(outbox, ScriptedTransport(), worker_id="w")
    m = outbox.tables.messages
    with engine.connect() as conn:
        assert {tuple(r) for r in conn.execute(sa.select(m.c.seq, m.c.shard).where(m.c.key == "b"))} \
            == {(n, shard_for_key("b", 16)) for n in (1, 2, 3)}

    for _ in range(5):  # a's failed seq 2 blocks a's seq 3; everything else flows
        new.run_once()
    assert seqs_by_key(new.transport.sent) == {b"b": [1, 2, 3]}
    assert sum(r.key is None for r in new.transport.sent) == 1
    assert retry_failed(outbox) == 1
    drain(new)
    assert seqs_by_key(new.transport.sent)[b"a"] == [2, 3]

    seen: list[tuple[str | None, int | None]] = []
    inbox = Inbox(engine, group=GROUP)
    inbox.handler(T)(lambda session, msg: seen.append((msg.key, msg.seq)))
    assert inbox.handle(record(T, "k", 2, message_id=OLD_PROCESSED)) is Disposition.DUPLICATE
    assert inbox.handle(record(T, "k", 3)) is Disposition.APPLIED
    inbox.sweep()  # the held seq 4 of 0.1 follows its gap
    assert [p.seq for p in inbox.parked(T, "p")] == [1]  # 0.1's parked key is still parked
    assert inbox.replay(T, "p").unparked
    assert seen == [("k", 3), ("k", 4), ("p", 1)]
    engine.dispose()


def shape(url: str, prefix: str) -> dict[str, object]:
    """Tables, columns (type, nullability) and indexes, with the prefix taken out of names."""
    engine = sa.create_engine(url)
    found = sa.inspect(engine)
    plain = lambda name: re.sub(rf"(^|_){prefix}", r"\1", name) if prefix else name  # noqa: E731
    tables = {}
    for table in found.get_table_names():
        if not table.startswith(prefix) or (not prefix and table.startswith("fresh_")):
            continue
        tables[plain(table)] = (
            sorted((c["name"], str(c["type"]), c["nullable"]) for c in found.get_columns(table)),
            sorted((plain(i["name"]), tuple(i["column_names"]), bool(i["unique"]))
                   for i in found.get_indexes(table)),
        )
    engine.dispose()
    return tables


def test_an_upgraded_database_has_the_shape_of_a_new_one(db_url):
    """Guards the upgrade list: a column or table added to ``_tables`` without a step fails here."""
    build_v01(db_url)
    Outbox(create_engine(db_url)).upgrade_tables()
    Outbox(create_engine(db_url), tables=OutboxTables(prefix="fresh_")).create_tables()
    assert shape(db_url, "") == shape(db_url, "fresh_")


def entry_points_refuse(url: str, sentence: str) -> None:
    engine = create_engine(url)
    outbox = Outbox(engine)
    with pytest.raises(SchemaError, match=re.escape(sentence)), outbox.begin() as session:
        outbox.publish(session, T, {"v": 1}, key="a")
    with pytest.raises(SchemaError, match=re.escape(sentence)):
        Relay(Outbox(engine), ScriptedTransport())
    inbox = Inbox(engine, group=GROUP)
    inbox.handler(T)(lambda session, msg: None)
    with pytest.raises(SchemaError, match=re.escape(sentence)):
        inbox.run(source=None)  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match=re.escape(sentence)):
        Outbox(engine).create_tables()
    for command in (["stats"], ["failed", "list"], ["init-db"],
                    ["relay", "--bootstrap-servers", "localhost:1"]):
        code, out = cli(*command, "--db", url)
        assert code == 2 and sentence in " ".join(out.split()), (command, out)
    engine.dispose()


def test_every_entry_point_refuses_a_01_database_until_it_is_upgraded(db_url):
    build_v01(db_url)
    before = snapshot(db_url)
    entry_points_refuse(db_url, "run `outbox init-db --upgrade`")
    assert snapshot(db_url) == before  # refusing wrote nothing


def test_every_entry_point_refuses_tables_of_a_newer_release(db_url):
    Outbox(create_engine(db_url)).create_tables()
    engine = sa.create_engine(db_url)
    meta = OutboxTables().meta
    with engine.begin() as conn:
        conn.execute(meta.update().where(meta.c.name == "schema_version").values(value="99"))
    entry_points_refuse(db_url, "newer than this release")
    code, out = cli("init-db", "--db", db_url, "--upgrade")
    assert code == 2 and "upgrade the package" in out


def test_upgrade_takes_the_shard_count_the_01_relays_used(sqlite_db):
    build_v01(sqlite_db, shards=8)
    code, out = cli("init-db", "--db", sqlite_db, "--upgrade", "--shards", "16")
    assert code == 2 and "ran with 8 shards, not 16" in out, out
    code, out = cli("init-db", "--db", sqlite_db, "--upgrade")
    assert code == 0 and "shard count 8" in out, out


def test_an_empty_meta_table_from_alembic_does_not_hide_a_01_database(db_url):
    """Autogenerate creates ``outbox_meta`` empty beside the 0.1 tables: still an upgrade, count and all."""
    build_v01(db_url, shards=8)
    engine = sa.create_engine(db_url)
    OutboxTables().meta.create(engine)
    engine.dispose()
    entry_points_refuse(db_url, "init-db --upgrade")
    code, out = cli("init-db", "--db", db_url)
    assert code == 2 and "--upgrade" in out, out
    code, out = cli("init-db", "--db", db_url, "--upgrade")
    assert code == 0 and "shard count 8" in out, out


def test_upgrade_refuses_a_count_the_unpublished_rows_contradict(sqlite_db):
    build_v01(sqlite_db, shards=8, leases=False)  # no relay ever ran: only the rows tell
    before = snapshot(sqlite_db)
    code, out = cli("init-db", "--db", sqlite_db, "--upgrade")
    assert code == 2 and "unpublished rows were sharded with another count than 16" in out, out
    assert snapshot(sqlite_db) == before
    code, out = cli("init-db", "--db", sqlite_db, "--upgrade", "--shards", "8")
    assert code == 0 and "shard count 8" in out, out


def test_the_lease_rows_a_reshard_to_fewer_shards_keeps_do_not_refuse_the_count_the_rows_were_sharded_with(
        sqlite_db):
    """A reshard (8 -> 4) keeps the rows of the shards it removes (for their transactional ids, since
    1875acf); an ``outbox_meta`` lost after it (dropped by a migration that did not know it) is taken
    for a 0.1 database, whose count the lease rows tell: they said 8, so --shards 4, the count the
    pending rows were sharded with, was refused, and 8 was refused by those rows: no count was taken."""
    code, out = cli("init-db", "--db", sqlite_db, "--shards", "8")
    assert code == 0, out
    engine = create_engine(sqlite_db)
    relay = Relay(Outbox(engine), ScriptedTransport(), worker_id="r")
    relay.run_once()  # a lease row for each of the 8 shards
    relay.close()
    code, out = cli("init-db", "--db", sqlite_db, "--reshard", "4")
    assert code == 0 and "shard count changed from 8 to 4" in out, out
    outbox = Outbox(engine)
    with outbox.begin() as session:
        for key in ("a", "b", "c", "d", "e"):
            outbox.publish(session, T, {"v": 1}, key=key)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE outbox_meta"))
    engine.dispose()
    code, out = cli("init-db", "--db", sqlite_db, "--upgrade", "--shards", "4")
    assert code == 0 and "shard count 4" in out, out
