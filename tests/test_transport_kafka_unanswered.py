"""An admin request whose answer does not come in time is an outage, never a bare ``TimeoutError``.

confluent-kafka's admin calls return ``concurrent.futures.Future``s; ``result(timeout)`` raises
the built-in ``TimeoutError`` (no message, not a ``KafkaException``) when the future is not done
in time. A client whose metadata still names a killed leader is answered only at its request
timeout, which a wait as long often beats (on a real broker: ``test_transport_kafka_left_open.py``,
where the commit check's read raised it out of ``send`` and a shard's producer sent its rows
again). The progress reads of ``_read_back`` wait the same way: each must say what it could not
read, as the ``RetriableTransportError`` the relay waits out.

The admin client here is a stand-in whose futures never finish: no broker answers late on
demand, and what is proved is only what the code does with an unfinished future.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox import RetriableTransportError
from transports.kafka import KafkaTransport


class Unanswered:
    """An admin client whose metadata answers, and whose other requests never do."""

    def __init__(self, _config: Any = None) -> None: ...

    def list_topics(self, topic: str, timeout: float) -> Any:
        partition = SimpleNamespace(leader=1)
        # cluster_id as librdkafka's ClusterMetadata has it (None: not told), looked at since e7e99f2.
        return SimpleNamespace(cluster_id=None,
                               topics={topic: SimpleNamespace(error=None, partitions={0: partition})})

    def list_offsets(self, request: dict[Any, Any], **_: Any) -> dict[Any, Future[Any]]:
        return {tp: Future() for tp in request}

    def describe_configs(self, resources: list[Any], **_: Any) -> dict[Any, Future[Any]]:
        return {r: Future() for r in resources}

    def create_topics(self, topics: list[Any], **_: Any) -> dict[str, Future[Any]]:
        return {t.topic: Future() for t in topics}


@pytest.fixture
def transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[KafkaTransport]:
    """A transport whose progress reads get the admin client that is never answered."""
    monkeypatch.setattr("transports.kafka._read_back.AdminClient", Unanswered)
    monkeypatch.setattr("transports.kafka._progress_topic.AdminClient", Unanswered)
    made = KafkaTransport(bootstrap_servers="127.0.0.1:9")
    yield made
    made.close(0)


def test_the_progress_partitions_bounds_unanswered_are_an_outage(transport: KafkaTransport) -> None:
    with pytest.raises(RetriableTransportError, match="cannot read 'progress': no answer in time"):
        transport.last_committed("progress", 0, b"k", 0.2)


def test_the_progress_topics_configuration_unanswered_is_an_outage(transport: KafkaTransport) -> None:
    with pytest.raises(RetriableTransportError, match="configuration of topic 'progress': no answer in time"):
        transport.ensure_compacted_topic("progress", 4, 0.2)  # found: its configuration is read


def test_the_progress_topics_creation_unanswered_is_an_outage(
        transport: KafkaTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Unanswered, "list_topics",  # not there yet
                        lambda self, topic, timeout: SimpleNamespace(cluster_id=None, topics={}))
    with pytest.raises(RetriableTransportError, match="cannot create topic 'progress': no answer in time"):
        transport.ensure_compacted_topic("progress", 4, 0.2)


def test_a_progress_topic_its_broker_does_not_know_yet_is_an_outage_not_a_refusal(
        transport: KafkaTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found, or its creation refused as existing (another relay made it a moment before), and the
    broker asked for its configuration does not know it yet: UNKNOWN_TOPIC_OR_PART is a wait, not
    the ``ConfigurationError`` ("needs DescribeConfigs") that stops a relay at its start (seen on
    three nodes right after the topic was made)."""
    def unknown(self: Unanswered, resources: list[Any], **_: Any) -> dict[Any, Future[Any]]:
        futures: dict[Any, Future[Any]] = {}
        for resource in resources:
            future: Future[Any] = Future()
            future.set_exception(KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)))
            futures[resource] = future
        return futures
    monkeypatch.setattr(Unanswered, "describe_configs", unknown)
    with pytest.raises(RetriableTransportError,
                       match="configuration of topic 'progress': Broker: Unknown topic or partition"):
        transport.ensure_compacted_topic("progress", 4, 0.2)
