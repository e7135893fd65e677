"""Settle: what becomes of each delivery after its transaction — done, retry later, or park.

The settle stage never waits. It returns, per delivery, either a final
``Disposition`` or the delay after which to try it again, and the caller
decides how to wait: the runner puts the delivery on a timer and frees the
worker thread; ``Inbox.handle`` sleeps in its caller's thread.

- A handler failure counts one attempt; below ``max_attempts`` the message is
  tried again after an exponential backoff with jitter (tenacity's), alone in
  its own transaction; at ``max_attempts`` it is parked with its key, and the
  alert sink hears of it once.
- ``RetryLater`` tries again after its delay and counts nothing.
- ``ParkMessage`` parks at once.
- What the transaction did not run because its budget was spent
  (``Committed.deferred``) is tried again at once, counting nothing.
- The messages of a key that a transaction did not run because one before
  them failed (``Committed.blocked``) wait as long as that one, and go back to
  their key right behind it: they count no attempt.
- A database outage (``is_outage``) counts nothing, parks nothing and alerts
  nothing: the whole batch is tried again after a capped backoff.
- The inbox's own tables missing (or not upgraded: ``is_missing_schema``, raised
  by the transaction itself, never a handler's, which comes back as a failure)
  is the setup's failure, not the message's: it counts nothing and parks
  nothing, and is raised to the caller: ``Inbox.handle``'s, which delivers the
  record again (the FastStream subscriber seeks back); the tenant router,
  which checks the tables and waits; ``Inbox.run``, which refused to start
  without them and ends when they go. Counted, it would park the key
  whenever the tables were made between its last attempt and the park.
- Any other database error of the transaction itself (a deferred constraint
  broken by one handler's writes, failing at COMMIT) belongs to one message:
  the batch is split until it is found, and that message fails like a handler
  that raised.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import tenacity
from sqlalchemy.exc import DBAPIError

from transports._logsafe import safe_logger

from ..core._outage import delay_before, is_missing_schema
from ..core._stopping import StopRequested
from ._alerting import Alerter
from ._committed import Committed, Failure, Parked
from ._delivery import Delivery, lane_of
from ._outage import OutageLog, is_outage
from ._signals import Disposition, ParkMessage, RetryLater
from ._transaction import TransactionStep

log = safe_logger("outbox.inbox")


@dataclass(slots=True)
class Settled:
    """Deliveries that reached a disposition, and those to try again after a delay (seconds)."""

    done: list[tuple[Delivery, Disposition]] = field(default_factory=list)
    later: list[tuple[Delivery, float]] = field(default_factory=list)


class Settler:
    """Runs a batch through its transaction and settles every delivery; safe from several threads."""

    def __init__(self, step: TransactionStep, alerter: Alerter, outages: OutageLog, *,
                 max_attempts: int, wait: tenacity.wait.wait_base) -> None:
        self.step = step
        self.alerter = alerter
        self.outages = outages
        self.max_attempts = max_attempts
        self.wait = wait

    def settle(self, deliveries: list[Delivery]) -> Settled:
        """Apply ``deliveries`` (a run of consecutive messages per key) and settle each one; never sleeps.

        The only calls into the transaction step are here (``apply``, ``park``);
        the decisions are the ``after_*`` methods. On an async inbox the step
        runs each transaction on the inbox's event loop (``_sessions``); this
        stage is the same for both.
        """
        try:
            committed = self.step.apply(deliveries)
        except Exception as exc:
            if is_missing_schema(exc):
                raise  # no inbox tables (yet): the setup's failure, nobody's attempt
            if isinstance(exc, DBAPIError) and not is_outage(exc) and len(deliveries) > 1:
                settled = Settled()  # one message broke the commit: find it by applying each alone
                for d in deliveries:
                    alone = self.settle([d])
                    settled.done.extend(alone.done)
                    settled.later.extend(alone.later)
                return settled
            settled, to_park = self.after_error(deliveries, exc)
        else:
            settled, to_park = self.after_apply(committed)
        for failure in to_park:
            try:
                outcome = self.step.park(failure.delivery, failure.error, failure.traceback)
            except Exception as exc:
                self.after_park_error(failure.delivery, exc, settled)
            else:
                self.after_park(failure.delivery, outcome, settled)
        return settled

    def after_error(self, deliveries: list[Delivery], error: Exception) -> tuple[Settled, list[Failure]]:
        """The transaction failed as a whole: wait out an outage, else fail its one delivery."""
        settled = Settled()
        if is_outage(error):
            delay = self.outages.failed(error)
            settled.later.extend((d, delay) for d in deliveries)
            return settled, []
        if not isinstance(error, DBAPIError):
            raise error  # a bug, not the message's fault nor the database's
        [d] = deliveries
        log.warning("inbox transaction of %s/%s seq %s rejected: %s", d.message.topic,
                    d.message.key, d.message.seq, error.orig)
        to_park = self._failed(Failure(d, error, traceback.format_exc()), settled)
        return settled, [] if to_park is None else [to_park]

    def after_apply(self, committed: Committed) -> tuple[Settled, list[Failure]]:
        """A committed transaction: what is done, what to try again when, and what to park now."""
        self.outages.answered()
        self.alerter.parked(committed.parked)
        settled = Settled(done=list(committed.done))
        to_park: list[Failure] = []
        waits: dict[Hashable, float] = {}
        for failure in committed.failed:
            if self._failed(failure, settled) is None:
                waits[lane_of(failure.delivery)] = settled.later[-1][1]
            else:
                to_park.append(failure)
                waits[lane_of(failure.delivery)] = 0.0  # parked first: then they park behind it
        # A key's messages behind its failed one wait as long as it does, and run after it.
        settled.later.extend((d, waits[lane_of(d)]) for d in committed.blocked)
        # Not run for want of time (the transaction's budget): next, at once, nobody's attempt.
        settled.later.extend((d, 0.0) for d in committed.deferred)
        return settled, to_park

    def after_park(self, d: Delivery, outcome: tuple[Disposition, Parked | None],
                   settled: Settled) -> None:
        self.outages.answered()
        disposition, parked = outcome
        if parked is not None:
            self.alerter.parked([parked])
        settled.done.append((d, disposition))

    def after_park_error(self, d: Delivery, error: Exception, settled: Settled) -> None:
        if not is_outage(error):
            raise error
        d.attempts.count -= 1  # parking did not happen: the next try ends here again
        # Ahead of the rest of its key, which waits behind it.
        lane = lane_of(d)
        at = next((n for n, (other, _) in enumerate(settled.later) if lane_of(other) == lane),
                  len(settled.later))
        settled.later.insert(at, (d, self.outages.failed(error)))

    def _failed(self, failure: Failure, settled: Settled) -> Failure | None:
        """Count the attempt; the failure back when the message must be parked now."""
        d, error = failure.delivery, failure.error
        if isinstance(error, RetryLater):
            settled.later.append((d, error.delay))
            return None
        attempts = d.attempts.failed()
        if isinstance(error, ParkMessage) or attempts >= self.max_attempts:
            return failure
        log.warning("handler failed on %s/%s seq %s (attempt %d of %d): %r", d.message.topic,
                    d.message.key, d.message.seq, attempts, self.max_attempts, error)
        settled.later.append((d, self._backoff(attempts)))
        return None

    def _backoff(self, attempt: int) -> float:
        return delay_before(self.wait, attempt)


def settle_alone(settle: Callable[[list[Delivery]], Settled], d: Delivery,
                 cancel: threading.Event | None = None) -> Disposition:
    """Settle ``d`` to the end in this thread: ``settle([d])`` again after each delay it asks for.

    What ``Inbox.handle`` does with a record, and a routing replay with a
    message it sends to its tenant: retries, ``RetryLater`` and outages are
    waited out here. ``cancel``, when set, ends the waiting with
    ``StopRequested``: ``d`` is then not finished.
    """
    while True:
        if cancel is not None and cancel.is_set():
            raise StopRequested(f"stopped before {d.message.topic}/{d.message.key} seq "
                                f"{d.message.seq} was finished; it is delivered again")
        settled = settle([d])
        for done, disposition in settled.done:
            if done is d:
                return disposition
        [(_, delay)] = [(later, delay) for later, delay in settled.later if later is d]
        if cancel is None:
            time.sleep(delay)
        else:
            cancel.wait(delay)
