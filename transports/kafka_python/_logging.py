"""kafka-python-ng's log lines, at the right level and without the connection-refused flood.

kafka-python-ng logs through Python logging already (loggers ``kafka.conn``,
``kafka.client`` …), but at ERROR for every refused connection attempt,
several a second while a broker is down. ``route_kafka_logs`` (called by the
transport and the source) stops the ``kafka`` logger's records from
propagating and re-logs them through ``transports.kafka_python.client``:
a failed connection as a WARNING (the relay and the inbox wait a broker
outage out and say so themselves), and each kind of line at most once a
minute (``transports._repeats``). Handlers you attached to ``kafka`` itself
still see every record.
"""

from __future__ import annotations

import logging
import threading

from .._logsafe import safe_logger
from .._repeats import Repeats

LOGGER = safe_logger("transports.kafka_python.client")
_CONNECTION_LOGGERS = ("kafka.conn", "kafka.client")
_lock = threading.Lock()


class _Reroute(logging.Handler):
    def __init__(self, every: float) -> None:
        super().__init__()
        self._repeats = Repeats(every)

    def emit(self, record: logging.LogRecord) -> None:
        level = record.levelno
        if record.name.startswith(_CONNECTION_LOGGERS) and level > logging.WARNING:
            level = logging.WARNING
        if not LOGGER.isEnabledFor(level):
            return
        try:
            text = f"{record.name}: {record.getMessage()}"
        except Exception:  # a library's malformed log call must not break the client
            return
        admitted = self._repeats.admit(text)
        if admitted is not None:
            LOGGER.log(level, "%s", admitted)


def route_kafka_logs(every: float = 60.0) -> None:
    """Send the ``kafka`` logger's records through ``LOGGER`` (see the module doc); idempotent.

    Every call stops the propagation again, even when the handler is there already: whatever
    set ``propagate`` back (a logging configuration, a test restoring loggers) would let the
    library's ERROR flood reach the root logger's handlers beside the routed WARNINGs.
    """
    library = logging.getLogger("kafka")
    with _lock:
        if not any(isinstance(h, _Reroute) for h in library.handlers):
            library.addHandler(_Reroute(every))
        library.propagate = False
