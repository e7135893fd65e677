"""librdkafka's log lines through Python logging, each kind at most once a minute.

Without a ``logger`` setting librdkafka writes ``%3|…|FAIL|rdkafka#producer-1| …``
straight to stderr, past the application's log format and level, and it logs
every failed connection attempt: several lines a second while a broker is down.
``LibrdkafkaLog`` is given as confluent-kafka's ``logger`` setting (any object
with ``log(level, msg, *args)``), so the lines go to the ``transports.kafka.librdkafka``
logger; a line that differs from an earlier one only in its numbers (timings,
counts) is dropped for ``every`` seconds, and the next one says how many were
(``transports._repeats``).
A failed connection is a WARNING, not an ERROR: the relay and the inbox wait a
broker outage out and say so themselves.

confluent-kafka hands the lines over only inside ``poll``/``flush``/``consume``
(never from librdkafka's own threads), so they arrive when the client is next
used: at once for a consumer, at the next ``publish`` for the relay's producer.
"""

from __future__ import annotations

import logging
from typing import Any

from .._logsafe import safe_logger
from .._repeats import Repeats

LOGGER = safe_logger("transports.kafka.librdkafka")
_CONNECTION_FACILITIES = frozenset({"FAIL", "ERROR"})


class LibrdkafkaLog:
    """The ``logger`` setting of a confluent-kafka client; see the module doc."""

    def __init__(self, logger: logging.Logger = LOGGER, every: float = 60.0) -> None:
        self.logger = logger
        self._repeats = Repeats(every)

    @property
    def every(self) -> float:
        """Seconds a kind of line stays quiet after it was logged."""
        return self._repeats.every

    @every.setter
    def every(self, seconds: float) -> None:
        self._repeats.every = seconds

    def log(self, level: int, msg: str, *args: Any) -> None:
        text = msg % args if args else msg
        facility = str(args[0]) if args else ""
        if facility in _CONNECTION_FACILITIES and level > logging.WARNING:
            level = logging.WARNING
        if not self.logger.isEnabledFor(level):
            return
        admitted = self._repeats.admit(text)
        if admitted is not None:
            self.logger.log(level, "%s", admitted)
