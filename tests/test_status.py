"""``outbox status``: what it shows of each stuck thing, and its exit status (0 fine, 3 stuck).

Every check runs the command as an operator or a health check would
(``python -m outbox status``), on SQLite and PostgreSQL: mostly in the test's
process (``_in_process``: the same entry point, a second less a run), and as a
process of its own where what is checked is what an operator or a health check
sees of the process (the operations page's example, an exit status 3).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _in_process import outbox_in_process
from _relay_helpers import ScriptedTransport, publish, rows, start_cli_relay, wait_for

from outbox import Disposition, Inbox, Outbox, Relay, create_engine
from tests.inbox_support import TOPIC, AlertLog, apply_effect, business, record
from transports import Outcome

STUCK = 3


def status(capfd: pytest.CaptureFixture[str], db: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m outbox status --db DB ARGS``, run in this process."""
    return outbox_in_process(capfd, "status", "--db", db, *args, cwd=Path.cwd())


def status_process(db: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m outbox status --db DB ARGS``, run as a process of its own."""
    return subprocess.run([sys.executable, "-m", "outbox", "status", "--db", db, *args],
                          capture_output=True, text=True, timeout=120)


def status_json(capfd: pytest.CaptureFixture[str], db: str, *args: str) -> tuple[int, dict[str, Any]]:
    result = status(capfd, db, "--json", *args)
    assert result.returncode in (0, STUCK), result.stderr
    return result.returncode, json.loads(result.stdout)


def table_names(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_an_empty_database_is_nothing_stuck(outbox: Outbox, db_url: str,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    assert isinstance(outbox.engine, sa.Engine)
    before = table_names(outbox.engine)
    result = status(capfd, db_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "nothing stuck"
    # No relay ever ran and nothing waits: one line, as the console's overview says it, not
    # "0 of 16 shards owned", which reads as an outage on a consumer's database.
    assert ("outbox: nothing to send, and no relay has run on this database (a consumer's database, "
            "or a new one)") in result.stdout
    assert "shards:" not in result.stdout and "backlog" not in result.stdout
    code, doc = status_json(capfd, db_url)
    assert code == 0 and doc["stuck"] == [] and doc["version"] == 1
    assert doc["inbox"] == {"groups": []}
    assert doc["outbox"]["backlog"] == [] and doc["outbox"]["retrying"] == []
    assert {s["state"] for s in doc["outbox"]["shards"]} == {"unowned"}
    assert table_names(outbox.engine) == before  # read-only: no lease rows, no tables


@pytest.mark.parametrize("drop", ["inbox", "outbox"])
def test_outbox_only_and_inbox_only_databases(outbox: Outbox, db_url: str, drop: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    url = db_url
    gone = outbox.tables.inbox_tables if drop == "inbox" else outbox.tables.outbox_tables
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        for table in gone:
            table.drop(conn)
    code, doc = status_json(capfd, url)
    assert code == 0 and doc[drop] is None and doc["stuck"] == []
    assert f"{drop}: no {drop} tables" in status(capfd, url).stdout


def test_failed_rows_and_a_retrying_head_show_and_set_the_exit_status(
    outbox: Outbox, db_url: str, topic: str, capfd: pytest.CaptureFixture[str]
) -> None:
    [failed] = publish(outbox, topic, ["f"])
    head, _ = publish(outbox, topic, ["r", "r"])
    transport = ScriptedTransport({str(failed): [Outcome.FAILED], str(head): [Outcome.RETRY] * 20})
    relay = Relay(outbox, transport, lease_ttl=120)
    for _ in range(3):
        relay.run_once()
    assert [r.status for r in rows(outbox)] == ["failed", "pending", "pending"]
    # Ages are shown to a tenth of a second and compared as shown: the head's must be above 0.0 for
    # "--stuck-after 0" (on a quiet machine the status came within 50 ms: 0.0, not stuck).
    time.sleep(0.2)

    code, doc = status_json(capfd, db_url, "--stuck-after", "0")
    assert code == STUCK
    [shard_row] = [r for r in doc["outbox"]["backlog"] if r["failed"]]
    assert shard_row["topic"] == topic
    [retrying] = doc["outbox"]["retrying"]
    assert (retrying["key"], retrying["seq"], retrying["message_id"]) == ("r", 1, str(head))
    assert retrying["attempts"] >= 1 and retrying["waiting_behind"] == 1
    assert "scripted retry" in retrying["last_error"]
    assert isinstance(retrying["next_try_in_s"], float)  # negative: due, the wheel retries it
    assert any("1 failed outbox row" in r for r in doc["stuck"])
    assert any("retrying for over 0 s" in r for r in doc["stuck"])
    assert sum(s["state"] == "owned" for s in doc["outbox"]["shards"]) == 16  # the relay holds all

    # The head is young under the default --stuck-after: only the failure. A health check sees
    # the process's exit status: this run is a process of its own.
    human = status_process(db_url)
    assert human.returncode == STUCK
    assert "retrying heads" in human.stdout
    assert [line for line in human.stdout.splitlines() if line.startswith("STUCK")] == [
        "STUCK: 1 failed outbox row(s) block their keys (outbox failed list)"]

    skipped = outbox_in_process(capfd, "failed", "skip", "--all", "--db", db_url, "--by", "test",
                                "--reason", "the test accepts the hole", cwd=Path.cwd())
    assert skipped.returncode == 0, skipped.stderr
    code, doc = status_json(capfd, db_url)
    assert code == 0 and doc["stuck"] == [], doc["stuck"]
    relay.close()


@pytest.fixture
def inbox(engine: sa.Engine) -> Inbox:
    box = Inbox(engine, group="billing", retry_backoff=0.001, retry_backoff_max=0.01,
                gap_timeout=3600, alert=AlertLog())
    box.create_tables()
    business.create_all(engine)
    box.handler(TOPIC)(apply_effect)
    return box


@pytest.mark.slow
def test_a_parked_key_is_stuck_until_replayed_or_discarded(inbox: Inbox, db_url: str,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    def broken(session, message):  # type: ignore[no-untyped-def]
        raise ValueError(f"cannot bill {message.key}#{message.seq}")

    inbox.handler(TOPIC, replace=True)(broken)
    assert inbox.handle(record(TOPIC, "K", 1)) is Disposition.PARKED
    assert inbox.handle(record(TOPIC, "K", 2)) is Disposition.PARKED  # behind it
    assert inbox.handle(record(TOPIC, "D", 1)) is Disposition.PARKED

    code, doc = status_json(capfd, db_url)
    assert code == STUCK
    [group] = doc["inbox"]["groups"]
    assert (group["group"], group["parked_keys"], group["parked_messages"]) == ("billing", 2, 3)
    assert group["oldest_parked_age_s"] >= 0 and group["held_messages"] == 0
    assert doc["stuck"] == ["group billing: 2 parked key(s) (outbox parked list --group billing)"]
    human = status(capfd, db_url)
    assert human.returncode == STUCK and "STUCK: group billing: 2 parked key(s)" in human.stdout
    code, doc = status_json(capfd, db_url, "--group", "shipping")  # another group: nothing of billing's
    assert code == 0 and doc["inbox"]["groups"] == []

    inbox.handler(TOPIC, replace=True)(apply_effect)  # the fix is deployed
    assert inbox.replay(TOPIC, "K").unparked
    assert status_json(capfd, db_url)[0] == STUCK  # D still parked
    inbox.discard(inbox.parked(TOPIC, "D")[0].message_id, by="oncall", reason="test order")
    code, doc = status_json(capfd, db_url)
    assert code == 0 and doc["stuck"] == [] and doc["inbox"]["groups"] == []


def test_a_held_gap_is_stuck_once_older_than_stuck_after(inbox: Inbox, db_url: str,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    assert inbox.handle(record(TOPIC, "g", 1)) is Disposition.APPLIED
    inbox.handle(record(TOPIC, "g", 3))  # seq 2 missing: held
    code, doc = status_json(capfd, db_url)
    assert code == 0
    [group] = doc["inbox"]["groups"]
    assert (group["parked_keys"], group["held_messages"]) == (0, 1)
    time.sleep(1.1)
    code, doc = status_json(capfd, db_url, "--stuck-after", "1")
    assert code == STUCK and doc["stuck"][0].startswith("group billing: a gap held for ")


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.any_kafka
def test_a_stopped_relays_shards_show_expired_then_reowned(
    postgres_db: str, any_kafka: str, topic: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Relay a is killed and b paused, so the moment between a's leases expiring and b taking
    them over (at most TTL/3, usually less) can be seen; b resumed owns all 16 shards."""
    outbox = Outbox(create_engine(postgres_db))
    outbox.create_tables()
    log = tmp_path / "relays.log"
    relays = {w: start_cli_relay(postgres_db, any_kafka, log, "--worker-id", w, "--lease-ttl", "2")
              for w in ("a", "b")}
    try:
        def split() -> dict[str, Any] | None:
            code, doc = status_json(capfd, postgres_db)
            held = {r["worker_id"]: r["shards"] for r in doc["outbox"]["relays"]}
            return doc if code == 0 and held == {"a": 8, "b": 8} else None

        doc = wait_for(split, 60, "two relays splitting the shards", interval=0.5)
        epochs = {s["shard"]: s["epoch"] for s in doc["outbox"]["shards"] if s["owner"] == "a"}
        of_a = set(epochs)
        relays["a"].send_signal(signal.SIGKILL)
        relays["b"].send_signal(signal.SIGSTOP)
        publish(outbox, topic, [f"k{i}" for i in range(200)])  # a backlog on every shard
        time.sleep(2.5)  # past the TTL
        code, doc = status_json(capfd, postgres_db)
        assert code == STUCK
        shards = {s["shard"]: s for s in doc["outbox"]["shards"]}
        assert {s for s, lease in shards.items() if lease["owner"] == "a"} == of_a
        assert {shards[s]["state"] for s in of_a} == {"expired"}
        assert any("no live relay lease" in reason for reason in doc["stuck"])
        human = status(capfd, postgres_db)
        assert human.returncode == STUCK and "0 of 16 owned, 16 expired" in human.stdout

        relays["b"].send_signal(signal.SIGCONT)

        def reowned() -> dict[str, Any] | None:
            code, doc = status_json(capfd, postgres_db)
            owners = {(s["owner"], s["state"]) for s in doc["outbox"]["shards"]}
            return doc if code == 0 and owners == {("b", "owned")} and not doc["outbox"]["backlog"] else None

        doc = wait_for(reowned, 60, "b owning every shard and the backlog drained", interval=0.5)
        assert all(s["epoch"] > epochs[s["shard"]] for s in doc["outbox"]["shards"] if s["shard"] in of_a)
        assert {r["worker_id"]: r["shards"] for r in doc["outbox"]["relays"]}["b"] == 16
    finally:
        for process in relays.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait(timeout=30)
        outbox.engine.dispose()  # type: ignore[union-attr]


DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
SHOWN = "$ outbox status --db sqlite:///orders.db\n"


def _normalised(text: str) -> list[list[str]]:
    """Lines as words, every age as ``N s``: the page's example was taken at another moment."""
    return [re.sub(r"-?\d+(\.\d+)? s\b", "N s", line).split() for line in text.strip().splitlines()]


def test_the_operations_page_shows_real_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's ``outbox status`` example is this situation's output, ages aside: one relay,
    a failed row, a key behind a retrying head, a parked key in group billing."""
    monkeypatch.chdir(tmp_path)
    url = "sqlite:///orders.db"
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    failed = publish(outbox, "orders", ["order-7"])[0]
    head = publish(outbox, "orders", ["order-9", "order-9", "order-9"])[0]
    publish(outbox, "orders", ["order-11", "order-12"])
    script = {str(failed): [Outcome.FAILED], str(head): [Outcome.RETRY] * 20}
    relay = Relay(outbox, ScriptedTransport(script), worker_id="relay-1", lease_ttl=600)
    relay.run_once()
    # Rows written while the relay was away: pending, oldest first.
    publish(outbox, "orders", ["order-13", "order-14"])
    inbox = Inbox(engine, group="billing", alert=AlertLog())
    business.create_all(engine)

    def broken(session, message):  # type: ignore[no-untyped-def]
        raise ValueError(f"no customer for {message.key}")

    inbox.handler(TOPIC)(broken)
    inbox.handle(record(TOPIC, "customer-3", 1))
    result = status_process(url)  # the page shows what an operator sees
    relay.close()
    engine.dispose()
    text = DOC.read_text()
    start = text.index(SHOWN) + len(SHOWN)
    shown, _, code = text[start:text.index("```", start)].partition("$ echo $?\n")
    assert _normalised(shown) == _normalised(result.stdout), result.stdout
    assert int(code) == result.returncode == STUCK


def test_status_reads_no_published_row_on_sqlite(tmp_path: Path) -> None:
    """Every read of outbox_messages goes through a partial index of unpublished rows, so a
    table of millions of published rows costs nothing (SQLite picks partial indexes only when
    the query repeats their predicate; PostgreSQL infers them, as EXPLAIN on 400,000 rows showed)."""
    from outbox.ops import gather

    engine = create_engine(f"sqlite:///{tmp_path / 'plan.db'}")
    outbox = Outbox(engine)
    outbox.create_tables()
    statements: list[tuple[str, Any]] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def capture(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "FROM outbox_messages" in statement and not statement.startswith("EXPLAIN"):
            statements.append((statement, parameters))

    gather(outbox)
    assert len(statements) == 2  # backlog, retrying heads
    with engine.connect() as conn:
        for statement, parameters in statements:
            plan = [row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)]
            reads = [step for step in plan if "outbox_messages" in step or "behind" in step]
            assert reads and all("USING INDEX ix_outbox_" in step for step in reads), plan
            assert not any("ix_outbox_pending" in step for step in reads), plan
    engine.dispose()


def test_a_long_lived_status_reader_sees_a_reshard_and_takes_no_served_shard_for_an_orphan(
        sqlite_db: str) -> None:
    """The console keeps one ``Outbox`` and gathers from it again and again; it read the shard count
    once (``Outbox.load_schema`` keeps it), and since 1875acf ``shard_leases`` lists the shards below
    the count it is given only. After a reshard 4 -> 8 the status listed shards 0-3, and the pending
    rows of shards 4-7, whose leases the relay held, were "pending rows and no live relay lease"."""
    from typer.testing import CliRunner

    from outbox.cli import app
    from outbox.ops import gather

    result = CliRunner().invoke(app, ["init-db", "--db", sqlite_db, "--shards", "4"])
    assert result.exit_code == 0, result.output
    engine = create_engine(sqlite_db)
    viewer = Outbox(engine)  # the console's, made at its start
    assert gather(viewer)["outbox"]["shard_count"] == 4
    result = CliRunner().invoke(app, ["init-db", "--db", sqlite_db, "--reshard", "8"])
    assert result.exit_code == 0, result.output
    relay = Relay(Outbox(engine), ScriptedTransport(), worker_id="r")
    relay.run_once()  # holds all 8 shards
    publish(Outbox(engine), "orders", [f"k{i}" for i in range(40)])  # pending, in all 8 shards
    doc = gather(viewer)
    assert doc["outbox"]["shard_count"] == 8
    assert [s["state"] for s in doc["outbox"]["shards"]] == ["owned"] * 8
    assert doc["stuck"] == []
    relay.close()
    engine.dispose()
