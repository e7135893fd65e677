"""Telling a topic being created from a topic that does not exist, by how long it has been unknown.

Apache Kafka answers the metadata request that starts a topic's auto-creation
with UNKNOWN_TOPIC_OR_PARTITION (a KRaft broker forwards the creation to the
controller and answers at once: ``AutoTopicCreationManager``), and a broker
that a new topic has not reached yet answers the same; the topic exists a
moment later. librdkafka's own ``produce()`` believes "unknown" only after
``topic.metadata.propagation.max.ms`` (30 s by default); the transports' own
metadata lookups do the same with this clock, counted from the first time a
topic was unknown to them, so a topic that really is absent (auto-creation
off, a misspelt name) costs the wait once, not once per batch.
"""

from __future__ import annotations

import time

PROPAGATION_SECONDS = 30.0
"""librdkafka's default ``topic.metadata.propagation.max.ms``."""


class UnknownTopics:
    """When each topic was first called unknown; how long before that answer is believed."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._since: dict[str, float] = {}

    def wait_left(self, topic: str) -> float:
        """Seconds to go on asking before ``topic``'s "unknown" is believed (0: believe it now).

        The first call for a topic starts its clock.
        """
        now = time.monotonic()
        first = self._since.setdefault(topic, now)
        return max(0.0, first + self.window - now)

    def known(self, topic: str) -> None:
        """``topic`` was found: a later "unknown" (it was deleted) starts a new clock."""
        self._since.pop(topic, None)
