"""Per-key order does not depend on clocks: a publisher whose clock runs ahead cannot reorder a key.

Two publisher processes write one key alternately; one runs under ``faketime``
with its clock ahead of the relay's. ``created_at``/``available_at`` come from
the publisher's clock and "now" from the relay's, so a row of the fast host
looks "not due yet" to the relay; it must still go before every later seq of
its key. The relay runs while they publish (LISTEN on PostgreSQL, polling on
SQLite), then the topic is read back.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import pytest
import tenacity
from _relay_helpers import rows, seqs_by_key
from conftest import unavailable

from outbox import Outbox, Relay, create_engine
from transports.kafka import KafkaTransport
from transports.testing import FaultyTransport, read_topic

pytestmark = [pytest.mark.any_kafka, pytest.mark.slow]  # faketime relays and a broker each: ~10 s a test

# Reads "key delay" lines from stdin, publishes one message per line, answers "ok".
PUBLISHER = """
import sys
from outbox import Outbox, create_engine
outbox = Outbox(create_engine(sys.argv[1]))
topic = sys.argv[2]
for line in sys.stdin:
    key, delay = line.split()
    with outbox._sessions() as session, session.begin():
        outbox.publish(session, topic, {"key": key}, key=key, delay=float(delay))
    print("ok", flush=True)
"""


class Publisher:
    def __init__(self, url: str, topic: str, *, skew: str | None) -> None:
        command = [sys.executable, "-c", PUBLISHER, url, topic]
        if skew is not None:
            command = ["faketime", "-f", skew, *command]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def publish(self, key: str, delay: float) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{key} {delay}\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "ok", "publisher process died"

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(30) == 0


@pytest.mark.parametrize(("skew", "delays", "faults"), [
    pytest.param("+3s", [0] * 8, 0.0, id="ahead"),
    pytest.param("+3s", [0, 0, 0.5, 0, 0, 1.0, 0, 0], 0.0, id="ahead-with-delays"),
    pytest.param("+3s", [0] * 8, 0.3, id="ahead-with-retries"),
])
def test_a_publisher_clock_ahead_never_reorders_a_key(
    outbox: Outbox, db_url: str, any_kafka: str, topic: str, skew: str, delays: list[float], faults: float
) -> None:
    need_faketime()
    transport = KafkaTransport(bootstrap_servers=any_kafka)
    if faults:
        transport = FaultyTransport(transport, rate=faults, seed=7)
    relay = Relay(outbox, transport, poll_interval=0.05,
                  backoff=tenacity.wait_fixed(0.2))
    running = threading.Thread(target=relay.run)
    running.start()
    try:
        publish_alternately(outbox, db_url, topic, skew, delays)
    finally:
        relay.stop()
        running.join(30)
        transport.close()
    assert_in_seq_order(outbox, any_kafka, topic, len(delays))


@pytest.mark.parametrize("relay_skew", ["-3s", "+3s"], ids=["relay-behind", "relay-ahead"])
@pytest.mark.postgres
def test_the_relays_own_clock_never_reorders_a_key(
    postgres_db: str, any_kafka: str, topic: str, relay_skew: str, tmp_path
) -> None:
    """The relay's "now" off from the publishers' (and the database's): order still holds."""
    outbox = Outbox(create_engine(postgres_db))
    outbox.create_tables()
    db_url = postgres_db
    need_faketime()
    found = glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")
    if not found:
        unavailable("libfaketimeMT not found (Debian package faketime)")
    log = tmp_path / "relay.log"
    # The library itself rather than the faketime wrapper, so SIGTERM reaches the relay; only
    # the wall clock is off, as on a host whose NTP is broken (the monotonic clock is not).
    env = {**os.environ, "LD_PRELOAD": found[0], "FAKETIME": relay_skew, "DONT_FAKE_MONOTONIC": "1"}
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox", "relay", "--db", db_url, "--bootstrap-servers", any_kafka,
         "--poll-interval", "0.05", "--log-level", "WARNING"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        publish_alternately(outbox, db_url, topic, "+3s", [0, 0.5, 0, 0, 0, 0])
    finally:
        relay.send_signal(signal.SIGTERM)
        try:
            code = relay.wait(30)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait()
            raise
    assert code == 0, log.read_text()
    assert_in_seq_order(outbox, any_kafka, topic, 6)
    outbox.engine.dispose()  # type: ignore[union-attr]


def need_faketime() -> None:
    if shutil.which("faketime") is None:
        unavailable("faketime is not installed (Debian package faketime)")


def publish_alternately(outbox: Outbox, url: str, topic: str, skew: str, delays: list[float]) -> None:
    """One message of key order-1 per delay, from a skewed and a normal publisher in turn."""
    fast = Publisher(url, topic, skew=skew)
    normal = Publisher(url, topic, skew=None)
    ahead_by = float(skew.removesuffix("s"))
    for i, delay in enumerate(delays):
        publisher = fast if i % 2 == 0 else normal
        before = datetime.now(UTC)
        publisher.publish("order-1", delay)
        after = datetime.now(UTC)
        # The fake clock must really be ahead (an ineffective faketime would pass the
        # test without testing anything): created_at is the publisher's clock, read
        # between `before` and `after` on the real one (a slow publish under load
        # must not make the fake clock look late, nor a fast one make it look early).
        created_at = rows(outbox)[-1].created_at
        if publisher is fast:
            ahead = (created_at - before).total_seconds()
            assert ahead > ahead_by - 1, f"the faked publisher is only {ahead:.2f} s ahead"
        else:
            ahead = (created_at - after).total_seconds()
            assert ahead < 0.5, f"the normal publisher is {ahead:.2f} s ahead"
        time.sleep(0.1)  # let the relay fetch between two publishes
    fast.close()
    normal.close()
    deadline = time.monotonic() + 30
    while rows(outbox, status="pending") and time.monotonic() < deadline:
        time.sleep(0.1)


def assert_in_seq_order(outbox: Outbox, any_kafka: str, topic: str, count: int) -> None:
    assert {r.status for r in rows(outbox)} == {"published"}
    # To each partition's end, not to a count: the faulty transport's lost acknowledgements put
    # duplicates on the topic, which could make up the count before the last seqs were read.
    records = read_topic(any_kafka, topic, expected=count, timeout=20, whole=True)
    assert seqs_by_key(records) == {b"order-1": list(range(1, count + 1))}
