"""KafkaTransport: the shared conformance suite, settings, and error translation."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from confluent_kafka import KafkaError

from outbox import ConfigurationError
from transports import Outcome, Record, Transport
from transports.kafka import KafkaTransport, embedded_kafka
from transports.kafka._outcomes import classify
from transports.testing import TransportConformance


@pytest.mark.kafka
class TestKafkaTransportConformance(TransportConformance):
    @pytest.fixture
    def transport(self, kafka: str) -> Iterator[KafkaTransport]:
        transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=10)
        yield transport
        transport.close()


@pytest.mark.kafka
class TestKafkaTransportInWavesConformance(TransportConformance):
    """A user-set message timeout turns pipelining off: the waves path keeps the contract too."""

    @pytest.fixture
    def transport(self, kafka: str) -> Iterator[KafkaTransport]:
        transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=10, delivery_timeout_ms=9000)
        assert not transport._pipelined
        yield transport
        transport.close()


def test_pipelining_is_on_only_when_librdkafka_cannot_drop_a_record() -> None:
    def pipelined(**settings: object) -> bool:
        return KafkaTransport(bootstrap_servers="127.0.0.1:9", **settings)._pipelined

    assert pipelined()
    assert KafkaTransport(bootstrap_servers="127.0.0.1:9")._config["message.timeout.ms"] == 0
    assert not pipelined(delivery_timeout_ms=5000)
    assert not pipelined(retries=3)
    # librdkafka's aliases are the same properties: a timeout set through one is the user's, kept
    aliased = KafkaTransport(bootstrap_servers="127.0.0.1:9", **{"delivery.timeout.ms": 5000})
    assert not aliased._pipelined and aliased._config["message.timeout.ms"] == 5000
    assert not pipelined(**{"message.send.max.retries": 3})
    assert not pipelined(**{"enable.gapless.guarantee": False})


def test_a_full_local_queue_is_sent_at_once_not_after_its_linger() -> None:
    """A record refused for a full queue waits for the records before it to be sent and answered,
    then goes: librdkafka sends what waits for its linger at once only within ``flush()``. With
    ``poll()`` there, nothing left before the linger ran out (a fleet's is 100 ms; a minute here),
    and every record past the queue's room came back "producer queue full".

    Librdkafka's own client behaviour, nothing of a broker's: the embedded mock cluster serves.
    """
    with embedded_kafka() as servers:
        transport = KafkaTransport({"queue.buffering.max.messages": 4, "linger.ms": 60_000},
                                   bootstrap_servers=servers, delivery_timeout=30)
        records = [Record(topic="full-queue", value=b"v", key=f"k{i}".encode()) for i in range(12)]
        started = time.monotonic()
        results = transport.publish(records)
        took = time.monotonic() - started
        transport.close()
    assert [(r.outcome, r.error) for r in results] == [(Outcome.DELIVERED, None)] * len(records)
    assert took < 20  # answered as sent, not after the linger


def test_is_a_transport() -> None:
    assert isinstance(KafkaTransport(bootstrap_servers="127.0.0.1:9"), Transport)


def test_kafka_python_names_and_raw_keys_are_accepted() -> None:
    transport = KafkaTransport({"linger.ms": 2}, bootstrap_servers="127.0.0.1:9", client_id="relay-1")
    assert transport._config["client.id"] == "relay-1"
    assert transport._config["linger.ms"] == 2
    assert transport._config["enable.idempotence"] is True


@pytest.mark.parametrize("settings, fragment", [
    ({"bootstrap_servers": "h:9", "lingerms": 5}, "lingerms"),
    ({"bootstrap_servers": "h:9", "linger.ms": "soon"}, "Invalid value"),
    ({"linger_ms": 5}, "bootstrap_servers"),
    ({"bootstrap_servers": "h:9", "enable_idempotence": False}, "enable.idempotence"),
    # The exactly-once deadline too (transaction.timeout.ms is derived from it): an infinite one
    # passed the check and overflowed when a transactional producer was made.
    ({"bootstrap_servers": "h:9", "delivery_timeout": float("inf")}, "finite"),
    ({"bootstrap_servers": "h:9", "delivery_timeout": float("nan")}, "delivery_timeout"),
    ({"bootstrap_servers": "h:9", "delivery_timeout": 0}, "delivery_timeout"),
])
def test_bad_settings_fail_at_construction(settings: dict, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        KafkaTransport(**settings)


def test_secrets_never_appear_in_repr() -> None:
    transport = KafkaTransport(
        bootstrap_servers="127.0.0.1:9", security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
        sasl_plain_username="svc", sasl_plain_password="hunter2-secret",
    )
    text = repr(transport)
    assert "hunter2" not in text and "svc" in text and "***" in text


@pytest.mark.parametrize("code, outcome", [
    (KafkaError.MSG_SIZE_TOO_LARGE, Outcome.FAILED),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, Outcome.FAILED),
    (KafkaError.UNKNOWN_TOPIC_OR_PART, Outcome.FAILED),
    (KafkaError.INVALID_RECORD, Outcome.FAILED),
    (KafkaError._MSG_TIMED_OUT, Outcome.RETRY),
    (KafkaError._TRANSPORT, Outcome.RETRY),
    (KafkaError._ALL_BROKERS_DOWN, Outcome.RETRY),
    (KafkaError.NOT_ENOUGH_REPLICAS, Outcome.RETRY),
])
def test_error_translation(code: int, outcome: Outcome) -> None:
    assert classify(KafkaError(code)) is outcome


def test_a_topic_the_broker_creates_on_first_use_gets_every_record(kafka: str, topic: str) -> None:
    """Apache Kafka answers the metadata request that starts a topic's auto-creation with
    UNKNOWN_TOPIC_OR_PARTITION (the creation goes to the controller; the topic exists a moment
    later), and so does a broker a new topic has not reached yet: that is not "unknown for good".
    librdkafka's mock cluster creates the topic inside the request, so only a real broker shows it.
    """
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=10)
    records = [Record(topic=topic, value=f"{i}".encode(), key=f"k{i % 3}".encode()) for i in range(9)]
    results = transport.publish(records)
    transport.close()
    assert [(r.outcome, r.error) for r in results] == [(Outcome.DELIVERED, None)] * len(records)


def test_unknown_topic_fails_when_auto_create_is_off(kafka: str, topic: str) -> None:
    # Unknown is believed after 0.5 s (a topic being created answers "unknown" for a moment).
    transport = KafkaTransport(bootstrap_servers=kafka, delivery_timeout=5, **{
        "allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 500})
    results = transport.publish([Record(topic=topic, value=b"v", key=b"k"),
                                 Record(topic=topic, value=b"w", key=b"k")])
    assert [r.outcome for r in results] == [Outcome.FAILED, Outcome.RETRY]
    assert "Unknown topic" in (results[0].error or "")


def test_broker_down_is_retry_within_the_delivery_timeout() -> None:
    transport = KafkaTransport(bootstrap_servers="127.0.0.1:9", delivery_timeout=1.5, log_level=0)
    results = transport.publish([Record(topic="t", value=b"v", key=b"k"),
                                 Record(topic="t", value=b"v")])
    assert [r.outcome for r in results] == [Outcome.RETRY, Outcome.RETRY]


def test_librdkafka_lines_go_to_python_logging_once_a_minute_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused connection is logged once, as a WARNING, not once per attempt as an ERROR."""
    import logging

    from transports.kafka._logging import LibrdkafkaLog

    caplog.set_level(logging.DEBUG, logger="transports.kafka.librdkafka")
    log = LibrdkafkaLog(every=60)
    refused = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after {}ms)"
    for ms in range(5):
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", refused.format(ms))
    log.log(logging.ERROR, "%s [%s] %s", "SASL", "rdkafka#producer-1", "authentication failed")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, "FAIL [rdkafka#producer-1] " + refused.format(0)),
        (logging.ERROR, "SASL [rdkafka#producer-1] authentication failed"),
    ]
    log.every = 0  # the next line of a kind says how many were dropped
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", refused.format(9))
    assert caplog.records[-1].getMessage().endswith("(4 more like it in the last 0 s)")


def test_the_producer_logs_through_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    """No raw ``%3|…|FAIL|`` line on stderr: librdkafka's lines reach the logger at flush."""
    import logging

    caplog.set_level(logging.WARNING, logger="transports.kafka.librdkafka")
    transport = KafkaTransport(bootstrap_servers="127.0.0.1:1", delivery_timeout=1.0)
    transport._producer.produce("t", b"x")
    transport.close(timeout=2.0)
    assert any("Connection refused" in r.getMessage() for r in caplog.records
               if r.name == "transports.kafka.librdkafka")
