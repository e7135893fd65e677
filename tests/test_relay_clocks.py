"""Per-key order does not depend on clocks: a publisher whose clock runs ahead cannot reorder a key.

Two publisher processes write one key alternately; one runs under ``faketime``
with its clock ahead of the relay's. ``created_at``/``available_at`` come from
the publisher's clock and "now" from the relay's, so a row of the fast host
looks "not due yet" to the relay; it must still go before every later seq of
its key. The relay runs while they publish (LISTEN on PostgreSQL, polling on
SQLite), then the topic is read back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import tenacity
from _relay_helpers import rows, seqs_by_key
from conftest import unavailable

from outbox import Outbox, Relay
from transports.kafka import KafkaTransport
from transports.testing import FaultyTransport, read_topic

pytestmark = pytest.mark.kafka

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
    outbox: Outbox, db_url: str, kafka: str, topic: str, skew: str, delays: list[float], faults: float
) -> None:
    if shutil.which("faketime") is None:
        unavailable("faketime is not installed (Debian package faketime)")
    transport = KafkaTransport(bootstrap_servers=kafka)
    if faults:
        transport = FaultyTransport(transport, rate=faults, seed=7)
    relay = Relay(outbox, transport, poll_interval=0.05,
                  backoff=tenacity.wait_fixed(0.2))
    running = threading.Thread(target=relay.run)
    running.start()
    fast = Publisher(db_url, topic, skew=skew)
    normal = Publisher(db_url, topic, skew=None)
    try:
        for i, delay in enumerate(delays):
            (fast if i % 2 == 0 else normal).publish("order-1", delay)
            time.sleep(0.1)  # let the relay fetch between two publishes
        fast.close()
        normal.close()
        deadline = time.monotonic() + 30
        while rows(outbox, status="pending") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        relay.stop()
        running.join(30)
        transport.close()
    assert {r.status for r in rows(outbox)} == {"published"}
    records = read_topic(kafka, topic, expected=len(delays), timeout=20, settle=0.5)
    assert seqs_by_key(records) == {b"order-1": list(range(1, len(delays) + 1))}
