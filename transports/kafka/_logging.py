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
import re
from typing import Any

from .._logsafe import safe_logger
from .._repeats import Repeats

LOGGER = safe_logger("transports.kafka.librdkafka")
_CONNECTION_FACILITIES = frozenset({"FAIL", "ERROR"})
# librdkafka warns at every producer start that a property the transport sets on
# purpose is experimental (``KafkaTransport``: a record the broker refuses for good
# must stop the producer, not let its key's next record through). Nobody can act on
# it, so it is logged at DEBUG; any other configuration warning stays a WARNING.
_EXPECTED_CONFWARN = "Configuration property enable.gapless.guarantee is experimental"


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
        if facility == "CONFWARN" and _EXPECTED_CONFWARN in text:
            level = logging.DEBUG
        if not self.logger.isEnabledFor(level):
            return
        admitted = self._repeats.admit(text)
        if admitted is not None:
            self.logger.log(level, "%s", admitted)


ERRORS = safe_logger("transports.kafka")
_NUMBERS = re.compile(r"\d+")
_DISCONNECTED = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN"})
"""A connection to a broker lost or refused (``ClientErrors.disconnects``): a broker killed or restarted,
not one that answers slowly (a quota mutes a connection, it does not close it)."""
_AUTHENTICATION = frozenset({"_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "_SSL",
                             "TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED",
                             "CLUSTER_AUTHORIZATION_FAILED"})


class ClientErrors:
    """confluent-kafka's ``error_cb``: a client's errors logged when they happen, once per change.

    librdkafka reports what keeps a client from working at all (the broker's
    name does not resolve, authentication fails, every broker is down) through
    this callback, inside ``poll``/``consume``/``flush``. Each kind (the text
    with its numbers masked) is logged the first time it comes, and again only
    after ``cleared()`` said the client worked meanwhile; an authentication failure
    and a fatal error are ERRORs (they will not pass by themselves), the rest
    WARNINGs (an outage the worker waits out). The text is librdkafka's, which
    names hosts but never a credential.
    """

    def __init__(self, client: str, logger: logging.Logger = ERRORS) -> None:
        self.client = client
        self.logger = logger
        self._seen: set[str] = set()
        self.disconnects = 0
        """Connections lost or refused so far (``_DISCONNECTED``), logged or not: a transactional
        producer tells a broker that went away during a transaction from a slow one by it."""

    def __call__(self, error: Any) -> None:
        if error.name() in _DISCONNECTED:
            self.disconnects += 1
        text = error.str()
        kind = f"{error.name()} {_NUMBERS.sub('#', text)}"
        if kind in self._seen:
            return
        self._seen = self._seen | {kind}  # replaced, never changed in place: no lock needed
        level = (logging.ERROR if error.fatal() or error.name() in _AUTHENTICATION
                 else logging.WARNING)
        self.logger.log(level, "Kafka %s: %s (%s)", self.client, text, error.name())

    def cleared(self) -> None:
        """The client worked: the next error is news again, even if it is the last one."""
        if self._seen:
            self._seen = set()
