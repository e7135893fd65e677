"""kafka-python-ng's lines go through Python logging at the right level, without the flood.

With the broker unreachable, kafka-python-ng logs an ERROR for every refused
connection attempt, several a second. Routed (``transports.kafka_python._logging``),
each kind of line appears once a minute at most, as a WARNING.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
from kafka import KafkaProducer

from transports import Record
from transports.kafka_python import KafkaPythonTransport


def test_refused_connections_are_one_warning_not_an_error_flood(caplog: pytest.LogCaptureFixture) -> None:
    producer = KafkaProducer(bootstrap_servers="127.0.0.1:1", api_version=(2, 5), acks="all",
                             reconnect_backoff_ms=50, reconnect_backoff_max_ms=100)
    transport = KafkaPythonTransport(producer, delivery_timeout=3.0)
    caplog.set_level(logging.DEBUG, logger="transports.kafka_python.client")
    # The producer's thread starts connecting as soon as it is made: what it logged before the
    # transport existed went where the logging was configured then (in CI, kafka.conn's ERRORs
    # beside routed WARNINGs, the routing a test before had set up and another put back). The
    # promise is the transport's: from its making on, nothing leaks.
    caplog.clear()
    started = time.monotonic()
    try:
        [result] = transport.publish([Record(topic="orders", value=b"{}", key=b"k")])
    finally:
        producer.close(timeout=1)
    assert time.monotonic() - started >= 2.5  # long enough for dozens of attempts
    assert result.outcome.value == "retry"
    routed = [r for r in caplog.records if r.name == "transports.kafka_python.client"]
    assert not [r for r in caplog.records if r.name.startswith("kafka.")], "kafka.* records leaked"
    refused = [r for r in routed if "111" in r.getMessage() or "refused" in r.getMessage().lower()]
    assert refused, [r.getMessage() for r in routed]
    assert all(r.levelno <= logging.WARNING for r in refused), [(r.levelname, r.getMessage())
                                                                for r in refused]
    kinds = [re.sub(r"\d+", "#", r.getMessage()) for r in routed]
    assert len(kinds) == len(set(kinds)), "a repeated line was logged twice within a minute"


def test_a_new_transport_stops_the_propagation_again_when_something_turned_it_back_on() -> None:
    """The handler already there, ``propagate`` set back to True (a logging configuration, a test
    restoring loggers): the next transport routes the records again instead of letting kafka.conn's
    ERRORs reach the root logger's handlers beside the routed WARNINGs (seen in CI)."""
    library = logging.getLogger("kafka")
    producer = KafkaProducer(bootstrap_servers="127.0.0.1:1", api_version=(2, 5), acks="all")
    try:
        KafkaPythonTransport(producer, delivery_timeout=1.0)
        library.propagate = True
        KafkaPythonTransport(producer, delivery_timeout=1.0)
    finally:
        producer.close(timeout=1)
    assert library.propagate is False
    assert sum(type(h).__name__ == "_Reroute" for h in library.handlers) == 1
