"""Retries, parking and alerts: how a failing message is settled.

A failed handler is retried, alone in its own transaction, with tenacity's
exponential backoff and jitter, up to ``max_attempts`` attempts in total (the
one inside the batch counts). ``RetryLater`` waits without counting;
``ParkMessage`` parks at once. When the attempts are spent the message goes to
``inbox_parked`` with its error, traceback and attempt count, its key is
marked parked (so its later messages are parked behind it, in order, without
calling the handler) and the alert sink is called once for that key.

While a key retries, its worker thread sleeps; other keys keep flowing on the
other workers. A stop or a partition revocation interrupts the sleep and
abandons the message unfinished, so the next owner of the partition gets it.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from datetime import datetime

import tenacity
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from ._alerts import Alert, AlertSink, deliver
from ._envelope import utcnow
from ._inbox_apply import Applier, Batch, Failure, make_alert, park_key
from ._inbox_delivery import Delivery
from ._inbox_signals import Disposition, ParkMessage, RetryLater
from ._inbox_store import FAILED, KEY_PARKED

log = logging.getLogger("outbox.inbox")


class Abandoned(Exception):
    """Work given up because the inbox stops or lost the partition; it was not committed."""


def is_outage(error: DBAPIError) -> bool:
    """The database could not be reached or could not serve the transaction now (retry it as is).

    Lost connections, deadlocks, serialization failures, lock timeouts and a
    full disk are OperationalErrors in psycopg and SQLite; integrity, data and
    programming errors are not, and retrying them unchanged never succeeds.
    """
    return error.connection_invalidated or isinstance(error, OperationalError | InterfaceError)


class Retrier:
    """Settles deliveries: apply in one batch, then retry or park each failure.

    ``should_abandon(delivery)`` is asked while waiting between attempts.
    Safe to call from several threads.
    """

    def __init__(self, applier: Applier, *, max_attempts: int, wait: tenacity.wait.wait_base,
                 alert: AlertSink, should_abandon: Callable[[Delivery], bool]) -> None:
        self.applier = applier
        self.max_attempts = max_attempts
        self.wait = wait
        self.alert = alert
        self.should_abandon = should_abandon
        self._foreign_alerted: set[str] = set()
        self._lock = threading.Lock()

    def settle(self, deliveries: list[Delivery]) -> list[tuple[Delivery, Disposition]]:
        """Take ``deliveries`` (at most one per key) to a final disposition.

        Returns the deliveries that reached one (plus any held successors
        applied with them). One whose retries were abandoned is missing from
        the result. Raises ``Abandoned``, with nothing committed, when the inbox
        stops or loses the partition while the database is unreachable.
        """
        batch = self._until_database_answers(deliveries)
        done = list(batch.done)
        for failure in batch.failed:
            try:
                done.extend(self._retry(failure))
            except Abandoned:
                continue  # left unfinished: its offset is not committed, the next owner redoes it
        return done

    def _until_database_answers(self, deliveries: list[Delivery]) -> Batch:
        """Infrastructure errors (database down) are not the message's fault: never count them.

        Any other database error outside the handler's call (a deferred
        constraint the handler's writes broke, failing at COMMIT) belongs to
        one message of the batch: the batch is split until it is found, and
        that message fails like a handler that raised.
        """
        outage = 0
        while True:
            try:
                batch = self.applier.apply(deliveries)
            except DBAPIError as exc:
                if not is_outage(exc):
                    return self._rejected(deliveries, exc)
                outage += 1
                log.warning("inbox transaction failed (%s); retrying the batch", exc.__class__.__name__)
                self._sleep(min(0.2 * 2 ** min(outage, 5), 5.0), deliveries)
                continue
            self.raise_alerts(batch.alerts)
            return batch

    def _rejected(self, deliveries: list[Delivery], error: DBAPIError) -> Batch:
        if len(deliveries) == 1:
            log.warning("inbox transaction of %s/%s seq %s rejected: %s", deliveries[0].message.topic,
                        deliveries[0].message.key, deliveries[0].message.seq, error.orig)
            return Batch(failed=[Failure(deliveries[0], error, traceback.format_exc())])
        batch = Batch()
        for d in deliveries:
            alone = self._until_database_answers([d])
            batch.done.extend(alone.done)
            batch.failed.extend(alone.failed)
        return batch

    def _retry(self, failure: Failure) -> list[tuple[Delivery, Disposition]]:
        d, error, trace = failure.delivery, failure.error, failure.traceback
        attempts = 0 if isinstance(error, RetryLater) else 1
        first_failure_at = utcnow()
        while not isinstance(error, ParkMessage) and attempts < self.max_attempts:
            if isinstance(error, RetryLater):
                delay = error.delay
            else:
                log.warning("handler failed on %s/%s seq %s (attempt %d of %d): %r",
                            d.message.topic, d.message.key, d.message.seq, attempts,
                            self.max_attempts, error)
                delay = self._backoff(attempts)
            self._sleep(delay, [d])
            batch = self._until_database_answers([d])
            if not batch.failed:
                return batch.done
            error, trace = batch.failed[0].error, batch.failed[0].traceback
            attempts += 0 if isinstance(error, RetryLater) else 1
        return [(d, self.park_failed(d, error, trace, attempts, first_failure_at))]

    def park_failed(self, d: Delivery, error: BaseException, trace: str, attempts: int,
                    first_failure_at: datetime) -> Disposition:
        """Park a message whose attempts are spent, and its key; alert once per key."""
        text = f"{type(error).__name__}: {error}"
        alerts: list[Alert] = []
        store = self.applier.store
        with self.applier.sessions() as session, session.begin():
            state = store.lock_keys(session, [d.lane]).get(d.lane) if d.ordered else None  # type: ignore[list-item]
            if state is not None and d.message.seq <= state.last_seq:  # type: ignore[operator]
                return Disposition.DUPLICATE  # applied meanwhile by another consumer
            if state is not None and state.parked:
                store.park(session, d, reason=KEY_PARKED)
            else:
                store.park(session, d, reason=FAILED, error=text, traceback=trace,
                           attempts=attempts, first_failure_at=first_failure_at)
                if state is not None:
                    alerts = park_key(store, session, d, FAILED, text)
                else:
                    alerts = [make_alert("message_parked", d, text, store.group)]
        self.applier.metrics.parked(d.message.topic, FAILED)
        self.raise_alerts(alerts)
        return Disposition.PARKED

    def raise_alerts(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            if alert.kind == "foreign_record":
                # One per topic and process: a misrouted producer must not flood the pager.
                with self._lock:
                    if alert.topic in self._foreign_alerted:
                        continue
                    self._foreign_alerted.add(alert.topic)
            deliver(self.alert, alert)

    def _backoff(self, attempt: int) -> float:
        state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        return float(self.wait(state))

    def _sleep(self, seconds: float, deliveries: list[Delivery]) -> None:
        """Wait, looking every 50 ms whether the work has been taken away meanwhile."""
        deadline = time.monotonic() + seconds
        while True:
            if any(self.should_abandon(d) for d in deliveries):
                raise Abandoned()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))
