"""KafkaPythonTransport: the same conformance suite over a kafka-python-ng KafkaProducer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kafka import KafkaProducer

from outbox import ConfigurationError
from transports import Transport
from transports.kafka_python import KafkaPythonTransport
from transports.testing import TransportConformance


@pytest.mark.kafka
class TestKafkaPythonTransportConformance(TransportConformance):
    @pytest.fixture
    def transport(self, kafka: str) -> Iterator[KafkaPythonTransport]:
        producer = KafkaProducer(bootstrap_servers=kafka.split(","), acks="all", linger_ms=2,
                                 max_in_flight_requests_per_connection=1)
        yield KafkaPythonTransport(producer, delivery_timeout=10)
        producer.close(5)


def test_needs_a_producer() -> None:
    with pytest.raises(ConfigurationError, match="KafkaProducer"):
        KafkaPythonTransport(object())


def test_is_a_transport() -> None:
    class Stub:
        def send(self): ...
        def flush(self): ...
        def partitions_for(self): ...

    assert isinstance(KafkaPythonTransport(Stub()), Transport)
