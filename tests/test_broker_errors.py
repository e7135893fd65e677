"""Broker errors a worker meets while it runs are logged when they happen, once per change.

An unresolvable host, a failed authentication, every broker down: librdkafka
reports them through confluent-kafka's ``error_cb``, served only inside
``poll``/``flush``. A relay whose batches never reach a flush (no metadata,
so nothing is produced) used to say why only when SIGTERM closed its producer.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from _relay_helpers import publish
from confluent_kafka import KafkaError

from outbox import Outbox, Relay, create_engine
from transports.kafka import KafkaTransport
from transports.kafka._logging import ClientErrors

UNRESOLVABLE = "broker.invalid:9092"  # .invalid never resolves (RFC 2606)


def resolve_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "transports.kafka" and "_RESOLVE" in r.getMessage()]


def test_a_relay_says_its_broker_does_not_resolve_while_it_runs(
    sqlite_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    engine = create_engine(sqlite_db)
    outbox = Outbox(engine)
    outbox.create_tables()
    publish(outbox, "orders", ["k1"])
    transport = KafkaTransport(bootstrap_servers=UNRESOLVABLE, delivery_timeout=0.5)
    relay = Relay(outbox, transport, poll_interval=0.05)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not resolve_lines(caplog):
            assert thread.is_alive(), "the relay ended"
            assert time.monotonic() < deadline, "the relay ran without saying its broker does not resolve"
            time.sleep(0.05)
        logged_at = time.monotonic()
        attempts = len([r for r in caplog.records if "broker unreachable" in r.getMessage()])
        while time.monotonic() - logged_at < 3:  # several more batches meet the same error
            time.sleep(0.1)
    finally:
        relay.stop()
        thread.join(15)
        transport.close(1)
    assert not thread.is_alive()
    # Once, not once per batch (about 60 in these 3 s): librdkafka may add its own summary of the
    # repeats ("1 identical error(s) suppressed") when a slow machine spreads them out.
    line, *summaries = resolve_lines(caplog)
    assert UNRESOLVABLE in line.getMessage() and line.levelno == logging.WARNING
    assert len(summaries) <= 1 and all("identical error(s) suppressed" in r.getMessage() for r in summaries)
    assert attempts <= 1
    engine.dispose()


def test_each_kind_of_client_error_is_logged_once_until_the_client_worked(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="transports.kafka")
    errors = ClientErrors("consumer")
    resolve = KafkaError(KafkaError._RESOLVE, "b:9092/1: Failed to resolve 'b:9092' (after 3ms)")
    for n in range(5):  # timings differ, the kind does not
        errors(KafkaError(KafkaError._RESOLVE, f"b:9092/1: Failed to resolve 'b:9092' (after {n}ms)"))
        errors(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    errors(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed"))
    errors.cleared()
    errors(resolve)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "transports.kafka"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.WARNING, logging.ERROR,
                                             logging.WARNING], lines
    assert ["_RESOLVE" in lines[0][1], "_ALL_BROKERS_DOWN" in lines[1][1], "_AUTHENTICATION" in lines[2][1],
            "_RESOLVE" in lines[3][1]] == [True] * 4, lines
