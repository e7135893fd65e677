"""Retention inside the workers: a thread of its own that outlives a failed pass and stops on time,
and ``outbox relay --retention`` deleting old rows while it relays."""

from __future__ import annotations

import logging
import signal
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _relay_helpers import rows, start_cli_relay, wait_for
from _retention_rows import outbox_row

from outbox import Outbox, create_engine
from outbox.housekeeping import RetentionResult
from outbox.housekeeping._worker import RetentionThread


def test_the_thread_runs_passes_outlives_a_failed_one_and_stops_between_batches() -> None:
    calls: list[threading.Event] = []

    def run_pass(stop: threading.Event) -> RetentionResult:
        calls.append(stop)
        if len(calls) == 1:
            raise RuntimeError("the first pass fails")
        return RetentionResult(deleted={"outbox_messages": 1})

    thread = RetentionThread(run_pass, every=0.01).start()
    wait_for(lambda: thread.passes >= 2, 10, "two good passes after a failed one")
    started = time.monotonic()
    thread.stop()
    assert time.monotonic() - started < 2
    assert calls[-1].is_set()  # the pass under way is told to stop between two batches


def test_a_database_outage_is_logged_once_and_the_pass_runs_again_once_it_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not a whole interval later (an hour here), and not a warning per failed pass."""
    calls: list[float] = []

    def run_pass(stop: threading.Event) -> RetentionResult:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise sa.exc.OperationalError("DELETE", {}, ConnectionRefusedError("connection refused"))
        return RetentionResult(deleted={"outbox_messages": 1})

    caplog.set_level(logging.WARNING, logger="outbox.housekeeping")
    thread = RetentionThread(run_pass, every=3600).start()
    try:
        wait_for(lambda: thread.passes >= 1, 30, "the pass after the outage")
    finally:
        thread.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("retention: the database unreachable (OperationalError")
    assert lines[1].startswith("retention: the database reachable again after ")


@pytest.mark.any_kafka
def test_a_relay_with_retention_deletes_old_published_rows_and_keeps_the_rest(
        tmp_path, any_kafka: str) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    outbox = Outbox(create_engine(url))
    outbox.create_tables()
    old = datetime.now(UTC) - timedelta(days=10)
    failed = outbox_row("failed", old)
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        conn.execute(sa.insert(outbox.tables.messages),
                     [outbox_row("published", old) for _ in range(50)] + [failed])
    relay = start_cli_relay(url, any_kafka, tmp_path / "relay.log", "--retention", "7d",
                            "--retention-every", "1s")
    try:
        wait_for(lambda: len(rows(outbox)) == 1, 60, "the relay's retention pass")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    assert relay.returncode == 0, (tmp_path / "relay.log").read_text()
    assert [r.message_id for r in rows(outbox)] == [failed["message_id"]]
