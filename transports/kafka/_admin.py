"""Looking the cluster up without changing it: the settings an admin client or consumer shares with the
producer, and which topics exist (a lookup that makes no topic).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from .._errors import RetriableTransportError

# Settings a consumer shares with the producer: how to reach and authenticate to the cluster.
CONNECTION_PREFIXES = ("bootstrap.servers", "security.protocol", "sasl.", "ssl.", "client.id",
                       "socket.", "broker.address.", "enable.ssl.", "enable.sasl.", "oauthbearer")

# An admin client is a producer to librdkafka: looking a missing topic up would make the broker
# create it (auto.create.topics.enable, Kafka's default) with its defaults, not compacted, its
# partitions not one per shard, and the relay would then find it there and never make its own.
ADMIN = {"log_level": 0, "allow.auto.create.topics": False}

NO_ANSWER = "no answer in time"
"""Why an admin request failed whose future was not done when the wait for it ended: concurrent.futures'
bare ``TimeoutError``, not a ``KafkaException`` (a client whose metadata still names a killed leader is
answered only at its request timeout, which a wait as long often beats). Retriable, as any outage."""


def connection_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of ``config`` that say how to reach the cluster (for a consumer or admin client)."""
    return {k: v for k, v in config.items() if k.startswith(CONNECTION_PREFIXES)}


def partition_counts(config: Mapping[str, Any], topics: Sequence[str], deadline: float) -> dict[str, int]:
    """The partition count of each of ``topics`` that exists now, in their order, looked up without
    making any and without a cache (a topic made anew may have fewer partitions than it had);
    ``RetriableTransportError`` if the cluster does not answer by ``deadline`` (``time.monotonic``)."""
    admin = AdminClient({**connection_settings(config), **ADMIN})
    try:
        found = admin.list_topics(timeout=max(0.1, deadline - time.monotonic())).topics
    except KafkaException as exc:
        raise RetriableTransportError(f"cannot list the cluster's topics: {exc.args[0].str()}") from None
    return {t: len(info.partitions) for t in topics
            if (info := found.get(t)) is not None and info.error is None and info.partitions}
