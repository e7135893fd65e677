"""One shard count, stored with the tables: every publisher, relay and command reads it.

Before, the count was a flag each process had to repeat; a process that used
the default 16 against a database run with another count put rows in shards no
relay owned, or a key's rows in two shards served by two relays.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from _relay_helpers import Running, ScriptedTransport, drain, publish, rows
from typer.testing import CliRunner

from outbox import ConfigurationError, Outbox, OutboxTables, Relay, SchemaError, create_engine
from outbox.cli import app
from outbox.core._schema import SCHEMA_VERSION
from outbox.core._sharding import shard_for_key

KEYS = [f"key-{i}" for i in range(40)]


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def eight(db_url):
    """A database initialised with ``outbox init-db --shards 8``."""
    code, out = cli("init-db", "--db", db_url, "--shards", "8")
    assert code == 0 and "shard count 8" in out, out
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


def test_publishers_and_relays_use_the_stored_count_without_being_told(eight):
    outbox = Outbox(eight)  # no shards=: what `outbox spark replay` and every example build
    publish(outbox, "orders", KEYS)
    assert {(r.key, r.shard) for r in rows(outbox)} == {(k, shard_for_key(k, 8)) for k in KEYS}
    relay = Relay(Outbox(eight), ScriptedTransport(), worker_id="solo")
    relay.run_once()
    assert sorted(relay.leases.owned()) == list(range(8))
    assert not rows(outbox, status="pending")


def test_a_different_count_is_an_error_naming_both(eight, db_url):
    numbers = re.compile(r"shards=16 .* use 8 shards")
    with pytest.raises(ConfigurationError, match=numbers):
        publish(Outbox(eight, shards=16), "orders", ["k"])
    with pytest.raises(ConfigurationError, match=numbers):
        Relay(Outbox(eight, shards=16), ScriptedTransport())
    with pytest.raises(ConfigurationError, match=numbers):
        Outbox(eight, shards=16).create_tables()
    assert not rows(Outbox(eight))
    for command in (["relay", "--bootstrap-servers", "localhost:1"], ["init-db"]):
        code, out = cli(*command, "--db", db_url, "--shards", "16")
        assert code == 2 and numbers.search(out), (command, out)
    assert cli("init-db", "--db", db_url)[0] == 0  # naming no count, or the same one, is fine
    assert cli("init-db", "--db", db_url, "--shards", "8")[0] == 0


def test_the_count_is_read_once_per_outbox_not_per_message(eight):
    outbox = Outbox(eight)
    publish(outbox, "orders", ["first"])
    meta = OutboxTables().meta
    with eight.begin() as conn:  # behind the live publisher's back (never do this)
        conn.execute(meta.update().where(meta.c.name == "shard_count").values(value="3"))
    publish(outbox, "orders", KEYS)
    assert all(r.shard == shard_for_key(r.key, 8) for r in rows(outbox))
    assert Outbox(eight).shards == 3  # a new Outbox reads it again


def test_create_tables_records_the_count_once(sqlite_db):
    engine = create_engine(sqlite_db)
    Outbox(engine, shards=4).create_tables()
    Outbox(engine).create_tables()  # idempotent, keeps 4
    assert Outbox(engine).shards == 4
    with engine.connect() as conn:
        meta = OutboxTables().meta
        stored = dict(conn.execute(sa.select(meta.c.name, meta.c.value)).all())
        assert stored.pop("incarnation")  # the database's identity (issue 23)
        assert stored == {"schema_version": str(SCHEMA_VERSION), "shard_count": "4"}


def test_the_count_changes_only_on_a_drained_stopped_outbox(eight, db_url):
    outbox = Outbox(eight)
    publish(outbox, "orders", KEYS)
    code, out = cli("init-db", "--db", db_url, "--reshard", "4")
    assert code == 2 and "40 row(s) are not published yet" in out, out
    relay = Relay(Outbox(eight), ScriptedTransport(), worker_id="r")
    drain(relay)
    code, out = cli("init-db", "--db", db_url, "--reshard", "4")
    assert code == 2 and "running relays hold 8 shard lease(s)" in out, out
    relay.close()
    code, out = cli("init-db", "--db", db_url, "--reshard", "4")
    assert code == 0 and "shard count changed from 8 to 4" in out, out

    restarted = Outbox(eight)  # publishers and relays started after the change
    publish(restarted, "orders", KEYS)
    relay = Relay(Outbox(eight), ScriptedTransport(), worker_id="r2")
    drain(relay)
    assert sorted(relay.leases.owned()) == [0, 1, 2, 3]
    fresh = [r for r in rows(restarted) if r.published_at is not None and r.id > len(KEYS)]
    assert {(r.key, r.shard) for r in fresh} == {(k, shard_for_key(k, 4)) for k in KEYS}
    with eight.connect() as conn:  # shards 4-7 keep their rows (what their transactional ids left
        leases = OutboxTables().leases  # open, docs/relay.md), unleased: the relay took 0-3 only
        assert sorted(conn.scalars(sa.select(leases.c.shard))) == list(range(8))
    relay.close()


@pytest.mark.spark
def test_spark_replay_publishes_into_the_stored_shards(java_home, sqlite_db, tmp_path):
    """The replay used to build ``Outbox(engine)`` with 16 shards whatever the database ran with."""
    from _spark_seed import AS_OF, build, seed, spark_for_tests

    from outbox.spark import archive, replay

    Outbox(create_engine(sqlite_db), shards=8).create_tables()
    seed(build(n=2_000, keys=40), sqlite_db, sqlite_db)
    spark = spark_for_tests()
    archive(sqlite_db, tmp_path / "archive", retention="10m", as_of=AS_OF, spark=spark)
    outbox = Outbox(create_engine(sqlite_db))
    before = {r.id for r in rows(outbox)}
    result = replay(tmp_path / "archive", sqlite_db, topic="orders", spark=spark)
    new = [r for r in rows(outbox) if r.id not in before]
    assert result.replayed == len(new) > 100
    assert all(r.shard == shard_for_key(r.key, 8) for r in new if r.key is not None)
    assert {r.shard for r in new if r.key is None} <= set(range(8))


def test_reshard_is_refused_while_a_relay_heartbeats_without_live_leases(eight, db_url):
    relay = Relay(Outbox(eight), ScriptedTransport(), worker_id="beating")
    relay.run_once()
    leases = OutboxTables().leases
    with eight.begin() as conn:  # its leases lapsed (a long pause), its heartbeat is fresh
        conn.execute(sa.update(leases).values(expires_at=datetime(2000, 1, 1, tzinfo=UTC)))
    code, out = cli("init-db", "--db", db_url, "--reshard", "4")
    assert code == 2 and "beating" in out and "heartbeat" in out, out
    relay.close()  # a clean stop leaves the membership table
    code, out = cli("init-db", "--db", db_url, "--reshard", "4")
    assert code == 0 and "shard count changed from 8 to 4" in out, out


def test_a_running_relay_stops_when_the_stored_shard_count_changes(eight):
    outbox = Outbox(eight)
    relay = Relay(outbox, ScriptedTransport(), worker_id="old-split", lease_ttl=0.6,
                  poll_interval=0.05)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            relay.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15  # a loaded CI machine took more than the 0.5 s once
    while len(relay.leases.owned()) < 8 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert thread.is_alive() and len(relay.leases.owned()) == 8, errors
    meta = OutboxTables().meta
    with eight.begin() as conn:  # what a reshard that got past the guard leaves
        conn.execute(sa.update(meta).where(meta.c.name == "shard_count").values(value="4"))
    thread.join(10)
    assert not thread.is_alive(), "the relay went on serving the old split"
    assert len(errors) == 1 and isinstance(errors[0], SchemaError), errors
    assert "changed from 8 to 4" in str(errors[0])
    assert relay.leases.owned() == {}
    # run_once (embedded use) raises too, instead of serving the old split.
    embedded = Relay(Outbox(eight), ScriptedTransport(), worker_id="embedded")
    with pytest.raises(SchemaError, match="changed from 4 to 8"):
        with eight.begin() as conn:
            conn.execute(sa.update(meta).where(meta.c.name == "shard_count").values(value="8"))
        embedded.run_once()


def test_reshard_and_new_incarnation_are_refused_together_not_half_done(sqlite_db):
    """``init-db --reshard 4 --new-incarnation`` (a restored database given a new count too) changed
    the count, said so, exited 0 and left the incarnation as it was: the relays then sent the copy's
    seqs under the identity of the database it copied. Each of the two runs alone; with another
    action (or each other) it is refused before anything changes."""
    code, out = cli("init-db", "--db", sqlite_db, "--shards", "8")
    assert code == 0, out
    engine = create_engine(sqlite_db)
    before = Outbox(engine).load_schema()
    for args in (["--reshard", "4", "--new-incarnation"], ["--reshard", "4", "--max-record-bytes", "2000000"],
                 ["--new-incarnation", "--upgrade"], ["--reshard", "4", "--shards", "4"]):
        code, out = cli("init-db", "--db", sqlite_db, *args)
        assert code == 2 and "alone" in out, (args, out)
        after = Outbox(engine).load_schema()
        assert (after.shard_count, after.incarnation, after.max_record_bytes) == (
            before.shard_count, before.incarnation, before.max_record_bytes), args
    engine.dispose()


def test_a_reshard_the_lease_thread_finds_while_the_relay_stops_is_raised(eight, monkeypatch):
    """A stop from outside (SIGTERM) while a renewal is under way, and that renewal finds the count
    changed: the run checked for its threads' fatal error before its wind-down waited for the lease
    thread, so an error found after the check was only logged and ``run`` returned as a clean stop
    (the command exited 0 on a database resharded behind its back)."""
    relay = Relay(Outbox(eight), ScriptedTransport(), worker_id="stopping", lease_ttl=0.6,
                  poll_interval=0.05)
    step, wakeup = relay._step, relay._wakeup
    maintain, close = step.maintain_leases, wakeup.close
    renewing, winding_down = threading.Event(), threading.Event()
    renewals = 0

    def renewal() -> dict[int, int]:
        nonlocal renewals
        renewals += 1
        if renewals > 1:  # the lease thread's, not the run's first leases
            renewing.set()
            assert winding_down.wait(10), "the run never wound down"
            meta = OutboxTables().meta
            with eight.begin() as conn:
                conn.execute(sa.update(meta).where(meta.c.name == "shard_count").values(value="4"))
        return maintain()

    def closing() -> None:  # the first thing the wind-down does after the run's loop ended
        winding_down.set()
        close()

    monkeypatch.setattr(step, "maintain_leases", renewal)
    monkeypatch.setattr(wakeup, "close", closing)
    running = Running(relay)
    assert renewing.wait(15), "no renewal began"
    running.stop(clean=False)
    assert len(running.error) == 1 and isinstance(running.error[0], SchemaError), running.error
    assert "changed from 8 to 4" in str(running.error[0])
