"""One inbox transaction: the step every stage that writes a delivery's outcome goes through.

``TransactionStep`` has three entry points, each one transaction: ``apply`` a
batch, ``park`` a message whose attempts are spent (the settle stage decides
*when*, this module *how*), and ``transaction`` / ``batch_transaction`` for an
operator's replay. Everything before it (decode, schedule) and after it
(settle, commit offsets) works on its plain results (``_committed``). The
phases inside the transaction — triage, claim, run, advance, successors —
are ``_phases``; the one other place that parks is the gap sweeper
(``_gaps``: a gap that outlived ``gap_timeout``). An operator's replay
(``_admin``) runs parked messages through these same phases; a discard
records one as discarded.

The dedup rows, the keys' new ``last_seq`` and the handlers' writes commit
together: that is what makes effects inside the inbox database happen once.

A batch first runs without savepoints (they cost two round trips per message),
and so does a lone message at its first try. When a handler fails, the batch
is redone with each message in its own SAVEPOINT, so the failure rolls back
only its own writes: the messages before it in its key commit, the key
advances to the one before it. A batch handler gets all of a batch's messages
of its topic in one call, each key's in seq order; when that call fails, the
redo calls it once per message, each in its SAVEPOINT, to find the message
that fails.

Failures are not retried here: they come back in ``Committed.failed`` for the
settle stage. A database outage under a handler aborts the whole transaction
(``Outage``): it is nobody's attempt.

Each transaction runs through ``Sessions.run``: in the calling thread on a
sync inbox, on the inbox's event loop on an async one (``_sessions``). The
rules here are the same for both.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping

from sqlalchemy.orm import Session

from transports._logsafe import safe_logger

from ._calls import AllAtOnce, Error, HandlerCalls, Handlers, OneByOne, Redo, TopicHandlers
from ._committed import Committed, Parked
from ._conflicts import Verdict
from ._delivery import Delivery, KeyedDelivery, KeyId, OrderedDelivery
from ._kinds import Reason, StartPolicy
from ._metrics import InboxMetrics
from ._phases import Transaction
from ._runs import Lanes
from ._sessions import Sessions
from ._signals import Disposition
from ._typed import EventNotHandled
from .storage import InboxStorage, KeyState

log = safe_logger("outbox.inbox")


class TransactionStep:
    """Runs inbox transactions; safe to call from several threads (each call has its own session)."""

    def __init__(self, sessions: Sessions, storage: InboxStorage,
                 handlers: Mapping[str, TopicHandlers], metrics: InboxMetrics,
                 start: StartPolicy = StartPolicy.STRICT, dedup_window: float | None = None,
                 batch_budget: float | None = None) -> None:
        self.sessions = sessions
        self.storage = storage
        self.handlers = handlers
        self.metrics = metrics
        self.calls = HandlerCalls(handlers, metrics, storage.group)
        self.start = start
        self.dedup_window = dedup_window
        """Seconds after which this group's dedup records may be pruned; None: never."""
        self.batch_budget = batch_budget
        """Seconds an ``apply`` transaction starts handlers for (``_calls.Budget``); None: no end."""

    # -- apply ------------------------------------------------------------------

    def apply(self, deliveries: list[Delivery]) -> Committed:
        """Handle ``deliveries`` (any number per key) in one transaction and commit.

        A batch first runs without savepoints (they cost two round trips per
        message), as does a lone message at its first try (a lone retry goes
        straight to its SAVEPOINT: it is likely to fail again); if a handler
        fails, that transaction is rolled back and the batch redone with a
        SAVEPOINT per message, reusing the failure instead of running the
        failed handler again (a failed batch-handler call has no single
        culprit: the redo calls it once per message to find it).
        Either way the others commit. Past ``batch_budget`` seconds no handler
        starts: what was not called comes back in ``Committed.deferred``, for
        the next transaction. Raises what the database raised when the
        transaction itself failed (``Outage`` among them).
        """
        known: dict[uuid.UUID, Error] = {}
        # A lone message that failed before is likely to fail again: straight to its SAVEPOINT
        # rather than a transaction rolled back and redone. A first try goes bare like a batch.
        if len(deliveries) > 1 or deliveries[0].attempts.count == 0:
            try:
                return self._transaction(deliveries, AllAtOnce(self.calls, self.batch_budget))
            except Redo as redo:
                if redo.delivery is not None:
                    known[redo.delivery.message.message_id] = redo.error
        return self._transaction(deliveries, OneByOne(self.calls, known, self.batch_budget))

    def _transaction(self, deliveries: list[Delivery], handlers: Handlers) -> Committed:
        committed = self.sessions.run(self._commit, deliveries, handlers)
        for (topic, disposition), count in Counter(
                (d.message.topic, disposition) for d, disposition in committed.done).items():
            self.metrics.counted(topic, disposition, count)
        if committed.conflicts:
            self._report_conflicts(committed.conflicts)
        return committed

    def _report_conflicts(self, conflicts: list[tuple[OrderedDelivery, Verdict]]) -> None:
        """Count every verdict; log the ones that park nothing (parks raise their own alerts)."""
        for (topic, verdict), count in Counter((d.message.topic, v) for d, v in conflicts).items():
            self.metrics.conflicts(topic, verdict, count)
        for d, verdict in conflicts:
            msg = d.message
            if verdict is Verdict.RESTART:
                log.warning("group %r: key %r of topic %r starts again at seq %s of producer "
                            "incarnation %s (start policy first_seen)", self.storage.group, msg.key,
                            msg.topic, msg.seq, msg.incarnation)
            elif verdict is Verdict.EXPIRED:
                log.warning("group %r: message %s (%r/%r seq %s, created %s) is older than the dedup "
                            "window and its record was pruned: taken for a redelivery, not applied",
                            self.storage.group, msg.message_id, msg.topic, msg.key, msg.seq,
                            msg.created_at.isoformat())

    def _commit(self, deliveries: list[Delivery], handlers: Handlers) -> Committed:
        with self.sessions() as session, session.begin():
            lanes = Lanes(deliveries)
            tx = self._phases(session, self.storage.keys.lock(session, lanes.keys()),
                              handlers, lanes)  # every key of the batch locked, one statement
            tx.look_up_behind(deliveries)
            while lanes:
                tx.round()
            tx.finish()
        return tx.committed

    def transaction(self, session: Session, states: dict[KeyId, KeyState],
                    known: dict[uuid.UUID, Error] | None = None) -> Transaction:
        """The phases over keys the caller locked, each message in its SAVEPOINT (an operator's replay).

        ``known`` holds failures a ``batch_transaction`` met already: reused,
        so a failing handler is not run twice for one replay.
        """
        return self._phases(session, states, OneByOne(self.calls, known or {}), Lanes(()))

    def batch_transaction(self, session: Session, states: dict[KeyId, KeyState]) -> Transaction:
        """The phases over keys the caller locked, every handler called bare (an operator's replay of a run).

        A failing handler raises ``Redo`` out of ``run``: the caller rolls the
        run back (it runs it inside a SAVEPOINT) and redoes it one message at
        a time, as ``apply`` does.
        """
        return self._phases(session, states, AllAtOnce(self.calls), Lanes(()))

    def _phases(self, session: Session, states: dict[KeyId, KeyState], handlers: Handlers,
                lanes: Lanes) -> Transaction:
        return Transaction(self.storage, session, states, handlers, lanes, start=self.start,
                           dedup_window=self.dedup_window)

    # -- park -------------------------------------------------------------------

    def park(self, d: Delivery, error: BaseException, trace: str) -> tuple[Disposition, Parked | None]:
        """Park a message whose attempts are spent (and its key), in its own transaction."""
        return self.sessions.run(self._park_spent, d, error, trace)

    def _park_spent(self, d: Delivery, error: BaseException,
                    trace: str) -> tuple[Disposition, Parked | None]:
        text = f"{type(error).__name__}: {error}"
        with self.sessions() as session, session.begin():
            state = (self.storage.keys.lock(session, [d.lane])[d.lane]
                     if isinstance(d, KeyedDelivery) else None)
            if (state is not None and isinstance(d, OrderedDelivery) and d.seq <= state.last_seq
                    and self.storage.dedup.is_recorded(session, d.message.message_id)):
                return Disposition.DUPLICATE, None  # applied meanwhile by another consumer
            reason = (Reason.KEY_PARKED if state is not None and state.parked
                      else error.reason if isinstance(error, EventNotHandled) else Reason.FAILED)
            if reason is Reason.KEY_PARKED:
                key_parked = self.storage.park(session, d, reason)
            else:
                key_parked = self.storage.park(session, d, reason, error=text, traceback=trace,
                                               attempts=d.attempts.count)
        return Disposition.PARKED, Parked(d, reason, text, key_parked)
