"""The progress topic's check before an exactly-once relay's first send: made compacted if missing,
refused if found otherwise (or on librdkafka's mock cluster), and every wait for the broker ended
by the relay's stop.

The check waits up to the transaction timeout for a broker that does not answer: a stop must end it
at once (``answer``), and the metadata request, one C call nothing interrupts, is asked once on a
thread of its own (``listed``): a request asked again in slices is never answered by a broker
slower than a slice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from contextlib import suppress
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from .._errors import ConfigurationError, RetriableTransportError, UnsupportedBrokerError
from ._admin import ADMIN, NO_ANSWER, connection_settings

STOPPED = "stopped before the broker answered"
"""Why a wait for the broker given a ``stopping`` event ended early: the stop was asked for."""

_SLICE = 0.05
"""How often a wait for an admin request's answer looks at its ``stopping`` event."""

_METADATA_GRACE = 1.0
"""Seconds past its own timeout a metadata request asked on a thread (``listed``) is waited for."""

MOCK_CLUSTER = "mockCluster"
"""How librdkafka's mock cluster names itself: its cluster id (``rd_kafka_mock_cluster_new``) is this
and a number; Apache Kafka's is a base64 UUID."""

T = TypeVar("T")


def answer(future: Future[T], timeout: float, stopping: threading.Event | None) -> T:
    """``future.result(timeout)``, given up (``RetriableTransportError``, ``STOPPED``) once ``stopping``
    is set: a relay stopped while the broker is slow to answer, or never answers (librdkafka's mock
    cluster ignores CreateTopics), returns at once instead of waiting out the transaction timeout."""
    deadline = time.monotonic() + timeout
    while stopping is not None and not future.done() and (left := deadline - time.monotonic()) > 0:
        if stopping.wait(min(_SLICE, left)):
            raise RetriableTransportError(STOPPED)
    try:
        return future.result(max(0.0, deadline - time.monotonic()))
    finally:
        # The future keeps the exception it raises (the broker's refusal), whose traceback holds this
        # frame: a cycle with the admin client of the caller's frame, left for the collector.
        del future


def listed(admin: AdminClient, topic: str, timeout: float, stopping: threading.Event | None) -> Any:
    """``admin.list_topics(topic, timeout)``; with ``stopping``, asked on a daemon thread of its own
    ("outbox-metadata") and given up (``STOPPED``) once it is set.

    librdkafka's metadata request is one C call that nothing interrupts, and a request asked again
    in short slices is never answered by a broker slower than a slice (each answer comes after its
    request was given up). The thread keeps the admin client until the call returns (``timeout``),
    and frees it there.
    """
    if stopping is None:
        return admin.list_topics(topic, timeout=timeout)
    # The future holds the answer or the broker's error, never an exception: one raised from it
    # (``Future.result``) would be held by it, and its traceback holds this frame, which holds the
    # future and the admin client, a cycle left for the collector (module doc of
    # tests/test_transport_kafka_lifetime.py), once a lookup of every take-over in an outage.
    answered: Future[tuple[Any, KafkaError | None]] = Future()

    def ask() -> None:
        try:
            answered.set_result((admin.list_topics(topic, timeout=timeout), None))
        except KafkaException as exc:
            answered.set_result((None, exc.args[0]))
        except Exception as exc:  # not the broker's (rare): raised as it was, its traceback dropped
            answered.set_exception(exc.with_traceback(None))

    threading.Thread(target=ask, name="outbox-metadata", daemon=True).start()
    try:
        metadata, error = answer(answered, timeout + _METADATA_GRACE, stopping)
    except TimeoutError:  # concurrent.futures': list_topics did not return within its own timeout
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, NO_ANSWER)) from None
    if error is not None:
        raise KafkaException(error)
    return metadata


def ensure_compacted_topic(config: Mapping[str, Any], topic: str, partitions: int, timeout: float,
                           stopping: threading.Event | None = None) -> None:
    """Create ``topic`` with log compaction unless it exists; the cluster's default replication.

    A topic found existing whose records the broker may delete (``refuse_uncompacted``)
    is refused with ``ConfigurationError``, as is librdkafka's mock cluster, which answers
    neither the creation nor the look at the configuration. ``stopping``: once set, the wait for the
    broker ends within a moment (``RetriableTransportError``, ``STOPPED``).
    """
    admin = AdminClient({**connection_settings(config), **ADMIN})
    try:
        metadata = listed(admin, topic, timeout, stopping)
    except KafkaException as exc:
        raise RetriableTransportError(f"cannot look up topic {topic!r}: {exc.args[0].str()}") from None
    if str(metadata.cluster_id or "").startswith(MOCK_CLUSTER):
        raise UnsupportedBrokerError(
            f"cannot keep topic {topic!r} on librdkafka's mock cluster (cluster id {metadata.cluster_id}: "
            f"the embedded broker, `outbox dev-broker`): it answers no CreateTopics or DescribeConfigs "
            f"and fences no producer. Exactly once needs Apache Kafka")
    found = metadata.topics.get(topic)
    if found is not None and found.error is None and found.partitions:
        refuse_uncompacted(admin, config, topic, timeout, stopping)
        return
    new = NewTopic(topic, num_partitions=partitions, replication_factor=-1,
                   config={"cleanup.policy": "compact", "segment.ms": "3600000",
                           "min.compaction.lag.ms": "0"})
    deadline = time.monotonic() + timeout
    try:
        answer(admin.create_topics([new], operation_timeout=timeout)[topic], timeout, stopping)
    except TimeoutError:  # concurrent.futures': the future not done in time (see NO_ANSWER)
        raise RetriableTransportError(f"cannot create topic {topic!r}: {NO_ANSWER}") from None
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise RetriableTransportError(f"cannot create topic {topic!r}: {error.str()}") from None
        refuse_uncompacted(admin, config, topic, timeout, stopping)  # made meanwhile by someone else
    pause = stopping or threading.Event()
    while time.monotonic() < deadline:  # created: usable once every partition has a leader
        with suppress(KafkaException):
            found = listed(admin, topic, max(0.001, deadline - time.monotonic()), stopping).topics.get(topic)
            if (found is not None and found.error is None and found.partitions
                    and all(p.leader >= 0 for p in found.partitions.values())):
                return
        if pause.wait(0.1):
            raise RetriableTransportError(STOPPED)
    raise RetriableTransportError(f"topic {topic!r} has no leader for every partition yet")


def refuse_uncompacted(admin: AdminClient, config: Mapping[str, Any], topic: str, timeout: float,
                       stopping: threading.Event | None = None) -> None:
    """Raise ``ConfigurationError`` unless ``topic`` keeps each key's last record for good.

    The relay's progress record of a shard is the only account of rows a
    transaction committed whose mark did not: a broker that deletes it (after
    ``retention.ms``, or past ``retention.bytes``) while the shard is idle makes
    the next take-over send those rows again. Compaction keeps it; ``delete``
    beside it must keep everything (both retentions -1).
    """
    resource = ConfigResource("topic", topic)
    try:
        found = answer(admin.describe_configs([resource], request_timeout=timeout)[resource], timeout,
                       stopping)
    except TimeoutError:
        raise RetriableTransportError(
            f"cannot read the configuration of topic {topic!r}: {NO_ANSWER}") from None
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        # The topic exists (found, or its creation refused as existing): a broker that does not know
        # it yet (just made, its metadata not there) says UNKNOWN_TOPIC_OR_PART, as do others' races.
        if error.retriable() or error.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                                                 KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise RetriableTransportError(
                f"cannot read the configuration of topic {topic!r}: {error.str()}") from None
        raise ConfigurationError(f"cannot read the configuration of progress topic {topic!r} "
                                 f"({error.str()}): the relay needs DescribeConfigs on it") from None
    policy = found["cleanup.policy"].value if "cleanup.policy" in found else "delete"
    policies = {p.strip() for p in policy.split(",")}
    retention = {name: found[name].value for name in ("retention.ms", "retention.bytes") if name in found}
    finite = {name: value for name, value in retention.items() if value != "-1"}
    if "compact" in policies and ("delete" not in policies or not finite):
        return
    why = "".join(f", {name}={value}" for name, value in finite.items()) if "compact" in policies else ""
    servers = config.get("bootstrap.servers", "<broker>")
    raise ConfigurationError(
        f"progress topic {topic!r} has cleanup.policy={policy}{why}: the broker may delete a shard's "
        f"progress record, and a take-over would then send its committed rows again. Make it compacted: "
        f"kafka-configs.sh --bootstrap-server {servers} --alter --entity-type topics --entity-name {topic} "
        f"--add-config cleanup.policy=compact")
