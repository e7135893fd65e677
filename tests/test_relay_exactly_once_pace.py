"""A broker too slow for a transaction gets smaller ones: the exactly-once relay keeps publishing.

Exactly once, a shard's batch is one Kafka transaction, given up whole at its deadline. A broker
that answers, but takes the batch's bytes more slowly than the deadline allows (a client quota, a
slow disk, a far region), used to time every transaction out: each counted as an outage (no
attempt, no alert), sent again as it was, timed out again, forever, nothing published. The
transactions now halve at each one given up and double at each commit (``_exactly_once._pace``).

The slowness is Apache Kafka's own: a ``producer_byte_rate`` client quota on the relay's
``client.id``, under which the broker takes each produce request and then holds the producer's
connection muted for as long as its bytes put it over the rate. The broker measures the rate over
2 s (``quota.window.num`` 2 of 1 s; 11 by default), so its throttle follows the bytes sent within
seconds and the test takes seconds, not minutes.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import uuid
from collections import Counter

import pytest
from _relay_helpers import publish, rows, seqs_by_key, wait_for

from outbox import Outbox, Relay, create_engine
from outbox.testing import LocalKafka, set_producer_quota
from transports.kafka import KafkaTransport
from transports.testing import read_topic

pytestmark = pytest.mark.kafka

RATE = 50_000
"""Bytes a second the broker takes from the relay's producers."""
TIMEOUT = 2.0
"""Seconds a transaction may take (the transport's ``delivery_timeout``, 30 s by default)."""
ROWS, KEYS = 40, 5


@pytest.mark.slow
@pytest.mark.xdist_group("timing")  # a rate over wall-clock seconds: one test at a time (docs/testing.md)
def test_a_broker_too_slow_for_a_whole_batch_gets_smaller_transactions_and_every_row_goes_out(
        sqlite_db: str, quick_quotas: LocalKafka, topic: str, progress_topic: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 rows of 8 kB (random: compression cannot shrink them), 320 kB at 50 kB/s: one transaction
    of the whole batch takes 6.4 s of the rate, three times the 2 s deadline. Every row is published
    once, in key order, with the one attempt that delivered it, in transactions of fewer rows.
    Without the pace the batch timed out again and again and nothing was published."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    client = f"slow-relay-{uuid.uuid4().hex[:8]}"
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine, shards=1)  # one shard: one transaction carries the whole batch
    outbox.create_tables()
    kafka = quick_quotas.bootstrap
    quick_quotas.create_topic(topic, 2)
    keys = [f"k{i % KEYS}" for i in range(ROWS)]
    for key in keys:  # one transaction each: a payload of its own
        publish(outbox, topic, [key], payload={"blob": base64.b64encode(os.urandom(6000)).decode()})
    set_producer_quota(kafka, client, RATE)
    transport = KafkaTransport(bootstrap_servers=kafka, client_id=client, delivery_timeout=TIMEOUT)
    relay = Relay(outbox, transport, exactly_once=True, progress_topic=progress_topic, poll_interval=0.05)
    running = threading.Thread(target=relay.run, daemon=True)
    running.start()
    try:
        wait_for(lambda: not rows(outbox, status="pending"), 90, "every row published")
    finally:
        relay.stop()
        running.join(30)
        transport.close()
    assert not running.is_alive()
    stored = rows(outbox)
    assert {r.status for r in stored} == {"published"}
    assert [r.attempts for r in stored] == [1] * ROWS, [(r.attempts, r.last_error) for r in stored]
    on_wire = read_topic(kafka, topic, expected=ROWS, settle=1.0, isolation="read_committed")
    assert max(Counter(dict(r.headers)["outbox-message-id"] for r in on_wire).values()) == 1
    assert len(on_wire) == ROWS
    assert seqs_by_key(on_wire) == {k.encode(): list(range(1, ROWS // KEYS + 1)) for k in sorted(set(keys))}
    paced = [r.getMessage() for r in caplog.records if "the broker takes them too slowly" in r.getMessage()]
    assert paced, "no transaction was given up: the quota did not slow the broker enough to prove anything"
    engine.dispose()
