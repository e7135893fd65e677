"""A relay's batch holds at most ``max_batch_bytes`` of payload and headers, plus one row.

Before the bound a batch's memory was its rows times their size (5,000 rows of a megabyte:
five gigabytes, twice). The database counts the bytes in the fetch, so a row left out never
crosses the wire; the first row always comes, however large; and a batch cut short by its bytes
is full: the relay fetches again at once, as after a batch cut short by its rows.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from _relay_helpers import ScriptedTransport, publish, rows, wait_for

from outbox import ConfigurationError, Outbox, Relay, create_engine
from outbox.relay import RelaySettings
from transports import Record, SendResult

ROW = 300_000
"""Each row's payload: four rows come under a megabyte (900,000 bytes before the fourth)."""


class BatchLog(ScriptedTransport):
    """Delivers everything and keeps each batch's records, as the relay handed them over."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[Record]] = []

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        self.batches.append(list(records))
        return super().publish(records)


@pytest.fixture
def large_rows(proof_db_url: str) -> Iterator[Outbox]:
    """12 rows of ``ROW`` bytes over 3 keys, on each database."""
    engine = create_engine(proof_db_url)
    outbox = Outbox(engine)
    outbox.create_tables()
    for i in range(12):  # a transaction each: the ids' order is the keys' order
        publish(outbox, "files", [f"k{i % 3}"], payload=bytes([i]) * ROW)
    yield outbox
    engine.dispose()


def drain(relay: Relay) -> list[int]:
    """Batches until nothing is due; what each fetched."""
    fetched = []
    while (batch := relay.run_once()).fetched:
        fetched.append(batch.fetched)
    return fetched


@pytest.mark.parametrize(("budget", "sizes"), [(1_000_000, [4, 4, 4]), (100_000, [1] * 12)],
                         ids=["four-a-batch", "each-row-over-the-budget-alone"])
def test_a_batch_stops_at_its_bytes_and_keeps_every_key_in_order(
        large_rows: Outbox, budget: int, sizes: list[int]) -> None:
    log = BatchLog()
    relay = Relay(large_rows, log, batch_size=100, max_batch_bytes=budget)
    try:
        assert drain(relay) == sizes
    finally:
        relay.close()
    for batch in log.batches:  # the bytes before a batch's last row were under the budget
        assert sum(len(r.value) for r in batch[:-1]) < budget
    sent = [r.value[0] for r in log.sent]
    assert sorted(sent) == list(range(12))
    for key in range(3):  # each key's rows in the order they were committed
        assert [i for i in sent if i % 3 == key] == list(range(key, 12, 3))


def test_a_batch_cut_short_by_its_bytes_is_followed_by_a_fetch_at_once(large_rows: Outbox) -> None:
    """A fetch that stopped at its bytes returned fewer rows than its batch size, with more due:
    taken for a relay that caught up, it would wait for the poll interval (30 s) before each of
    the next two batches."""
    relay = Relay(large_rows, BatchLog(), batch_size=100, max_batch_bytes=1_000_000, poll_interval=30)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(rows(large_rows, status="published")) == 12, 15,
                 "every batch sent (none after the 30 s poll interval)")
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("value", [0, -1, True, "1", 1.5, 2**40 + 1, None])
def test_a_bad_max_batch_bytes_is_refused_by_name(value: object) -> None:
    with pytest.raises(ConfigurationError, match="max_batch_bytes"):
        RelaySettings(max_batch_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_a_bad_max_batch_bytes_on_the_command_line_is_one_line_and_a_non_zero_exit(
        tmp_path: Path, value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "outbox", "relay", "--db", f"sqlite:///{tmp_path / 'x.db'}",
         "--bootstrap-servers", "127.0.0.1:9", "--max-batch-bytes", value],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr
    assert "--max-batch-bytes" in result.stderr, result.stderr
