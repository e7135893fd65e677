"""Retention inside a running relay or inbox: a pass every few minutes on a thread of its own.

The worker's own threads never run a retention statement, so its hot path
only shares the database with it. A pass that fails is logged and tried again
at the next interval; it never ends the worker. A database outage is not a
failure: it is logged once when it starts and once when it ends
(``outbox.core._outage``), and the pass runs again as soon as the database answers
(capped backoff), not a whole interval later. ``stop`` ends a pass between
two batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from transports._logsafe import safe_logger

from ..core._outage import RELAY_WORDING, OutageBackoff, OutageTracker, is_database_outage
from ._retention import RetentionResult

log = safe_logger("outbox.housekeeping")


class RetentionThread:
    """Runs ``run_pass(stop)`` now and then every ``every`` seconds until ``stop()``."""

    def __init__(self, run_pass: Callable[[threading.Event], RetentionResult], every: float,
                 name: str = "outbox-retention") -> None:
        self._run_pass = run_pass
        self.every = every
        self._stop = threading.Event()
        self._database = OutageTracker("retention: the database", log=log, wording=RELAY_WORDING,
                                       backoff=OutageBackoff(first=1.0))
        self.passes = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> RetentionThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to end (between two batches) and wait up to ``timeout`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                result = self._run_pass(self._stop)
            except Exception as exc:
                if is_database_outage(exc):
                    self._stop.wait(min(self.every, self._database.failed(exc)))
                    continue
                log.exception("retention pass failed; next pass in %.0f s", self.every)
            else:
                self._database.answered()
                self.passes += 1
                if result.total:
                    log.info("retention deleted %s in %.1f s", _counts(result), time.monotonic() - started)
            self._stop.wait(self.every)


def _counts(result: RetentionResult) -> str:
    return ", ".join(f"{n} from {table}" for table, n in result.deleted.items()) or "nothing"
