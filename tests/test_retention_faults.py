"""Retention beside a working relay, two runs at once, and a run killed mid-way (real processes)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, publish, rows, seqs_by_key, wait_for
from _retention_rows import outbox_row

from outbox import Outbox, Relay, create_engine
from outbox.housekeeping import RetentionResult, run_retention

OLD = datetime.now(UTC) - timedelta(days=30)


def seed(outbox: Outbox, published: int, unfinished: int = 300) -> set:
    """``published`` old published rows and ``unfinished`` old pending/failed/skipped ones; the
    pending ones are delayed for days, so a relay leaves them pending."""
    kept = [outbox_row(("pending", "failed", "skipped")[i % 3], OLD) for i in range(unfinished)]
    for row in kept:
        row["available_at"] = datetime.now(UTC) + timedelta(days=10)
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        for start in range(0, published, 10_000):
            conn.execute(sa.insert(outbox.tables.messages),
                         [outbox_row("published", OLD) for _ in range(min(10_000, published - start))])
        conn.execute(sa.insert(outbox.tables.messages), kept)
    return {r["message_id"] for r in kept}


@pytest.mark.slow
def test_two_retention_runs_and_a_relay_at_once(server_db_url: str) -> None:
    """Both runs share the old rows exactly (no row counted twice, none left), the relay drains
    every new message in key order meanwhile, and no unfinished row is touched."""
    engine = create_engine(server_db_url)
    outbox = Outbox(engine)
    outbox.create_tables()
    kept = seed(outbox, 20_000)
    results: list[RetentionResult] = []
    errors: list[BaseException] = []

    def retain() -> None:
        try:
            results.append(run_retention(outbox, older_than="1d", batch_size=250))
        except BaseException as exc:  # the test thread reports it
            errors.append(exc)

    transport = ScriptedTransport()
    relay = Relay(outbox, transport, batch_size=100)
    runs = [threading.Thread(target=retain) for _ in range(2)]
    for run in runs:
        run.start()
    new_ids = []
    while any(run.is_alive() for run in runs) or len(new_ids) < 2_000:
        new_ids += publish(outbox, "orders", [f"k{i % 7}" for i in range(40)])
        relay.run_once()
    for run in runs:
        run.join()
    wait_for(lambda: (relay.run_once() or True) and not [r for r in rows(outbox, status="pending")
                                                         if r.message_id not in kept], 30, "relay drained")
    relay.stop()

    assert errors == []
    assert sum(r.deleted["outbox_messages"] for r in results) == 20_000
    left = {r.message_id: r.status for r in rows(outbox)}
    assert set(left) == kept | set(new_ids)
    assert all(left[i] == "published" for i in new_ids)
    assert all(seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
               for seqs in seqs_by_key(transport.sent).values())
    assert len(transport.sent) == len(new_ids)
    engine.dispose()


@pytest.mark.slow
@pytest.mark.postgres
def test_a_run_killed_mid_way_loses_nothing_and_the_next_run_finishes(postgres_db: str, tmp_path) -> None:
    engine = create_engine(postgres_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    # The kill comes once 5,000 rows are gone (a poll every 0.05 s), with 15,000 still to delete:
    # mid-way on any host (checked below: it was killed, rows were left), and the second run, which
    # only has to finish, deletes 15,000 instead of 55,000 (the test took 80-100 s at 60,000).
    kept = seed(outbox, 20_000)
    total = 20_000 + len(kept)
    command = [sys.executable, "-m", "outbox", "housekeeping", "run", "--db", postgres_db,
               "--older-than", "1d", "--batch-size", "100"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    count = sa.select(sa.func.count()).select_from(outbox.tables.messages)

    def some_deleted() -> bool:
        with engine.connect() as conn:
            return conn.execute(count).scalar_one() < total - 5_000
    wait_for(some_deleted, 60, "the first run to delete some rows")
    run.send_signal(signal.SIGKILL)
    run.wait(10)
    assert run.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    with engine.connect() as conn:
        left = conn.execute(count).scalar_one()
    print(f"killed with {left} of {total} rows left")
    assert left > len(kept)  # it really stopped half-way

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert again.returncode == 0, again.stderr
    assert "outbox_messages:" in again.stdout and "deleted in" in again.stdout
    assert {r.message_id for r in rows(outbox)} == kept
    engine.dispose()


@pytest.mark.slow
def test_sigterm_stops_the_command_between_batches_with_its_totals(tmp_path) -> None:
    """A CronJob's pod ending: the open batch finishes, the count printed is the rows really gone,
    one line says it stopped, and the exit status (128 + 15) tells a scheduler it did not finish."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    kept = seed(outbox, 40_000, unfinished=30)
    count = sa.select(sa.func.count()).select_from(outbox.tables.messages)
    run = subprocess.Popen([sys.executable, "-m", "outbox", "housekeeping", "run", "--db", url,
                            "--older-than", "1d", "--batch-size", "20"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def started() -> bool:
        with engine.connect() as conn:
            return conn.execute(count).scalar_one() < 40_000
    wait_for(started, 60, "the run to delete its first batches")
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=30)

    assert run.returncode == 128 + signal.SIGTERM, out
    lines = out.strip().splitlines()
    assert lines[-1] == "stopped by SIGTERM before it finished; run it again to carry on", out
    with engine.connect() as conn:
        left = conn.execute(count).scalar_one()
    assert left > len(kept), "the run finished before it could be stopped"
    assert lines[-2].startswith(f"outbox_messages: {40_000 + len(kept) - left:,} row(s) before "), out
    engine.dispose()
