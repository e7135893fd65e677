"""A broker outage is never counted against a message (DESIGN §9).

The broker (librdkafka's mock cluster in a child process) is frozen with
SIGSTOP under a running relay: every send times out. The rows must keep their
attempt count (it drives the backoff, up to 30 s) and go out promptly once the
broker is thawed, not after a backoff grown during the outage.
"""

from __future__ import annotations

import threading
import time

import pytest
from _relay_helpers import publish, rows

from outbox import Outbox, Relay, create_engine
from transports.kafka import KafkaTransport
from transports.testing import BrokerProcess

# wall-clock bounds: the "timing" group runs one test at a time (docs/testing.md)
pytestmark = [pytest.mark.any_kafka, pytest.mark.slow, pytest.mark.xdist_group("timing")]


def wait_for(condition, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_frozen_broker_counts_no_attempt_and_publishes_promptly_after(
    sqlite_db: str, topic: str
) -> None:
    outbox = Outbox(create_engine(sqlite_db))
    outbox.create_tables()
    with BrokerProcess() as broker:
        transport = KafkaTransport(bootstrap_servers=broker.bootstrap, delivery_timeout=2.0)
        relay = Relay(outbox, transport, poll_interval=0.05)
        thread = threading.Thread(target=relay.run, daemon=True)
        thread.start()
        try:
            publish(outbox, topic, ["k1", "k2", None])
            wait_for(lambda: not rows(outbox, status="pending"), 30, "the warm-up rows")
            broker.freeze()
            try:
                publish(outbox, topic, ["k1", "k1", "k2", "k3", None, None])
                # Several delivery timeouts: each would have been an attempt.
                wait_for(lambda: sum(1 for r in rows(outbox, status="pending") if r.last_error) >= 4,
                         20, "the relay to try the rows against the frozen broker")
                time.sleep(8)
                frozen = rows(outbox, status="pending")
            finally:
                broker.thaw()
            assert len(frozen) == 6 and any(r.last_error for r in frozen)
            assert [r.attempts for r in frozen] == [0] * 6, [(r.attempts, r.last_error) for r in frozen]
            took = wait_for(lambda: not rows(outbox, status="pending"), 30, "publishing after the thaw")
        finally:
            relay.stop()
            thread.join(30)
        transport.close()
    assert not thread.is_alive()
    assert took < 8, f"{took:.1f} s after the thaw"
    # Published once each: the one attempt that succeeded.
    assert [r.attempts for r in rows(outbox)] == [1] * 9
    outbox.engine.dispose()  # type: ignore[union-attr]
