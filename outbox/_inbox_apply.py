"""One inbox transaction: classify, dedup, run handlers, advance key state, commit.

A batch holds deliveries of *different* keys (the scheduler guarantees it);
when one handler fails, the batch is redone with each message in its own
SAVEPOINT, so the failure rolls back only its own writes and the others
commit. A batch handler gets all of a batch's messages of its topic in one
call; when that call fails, the redo calls it once per message, each in its
SAVEPOINT, to find the message that fails. The dedup rows, the key's new
``last_seq`` and the handler's writes commit together: that is what makes
effects inside the inbox database happen once. A held message that becomes
next is applied in the same transaction, right after its predecessor.

Failures are not retried here: they come back in ``Batch.failed`` and the
caller retries them one at a time (``_inbox_retry``), so a poison message
never holds up the rest of its batch.
"""

from __future__ import annotations

import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ._alerts import Alert
from ._envelope import Message
from ._inbox_delivery import FOREIGN, UNDECODABLE, Delivery
from ._inbox_metrics import InboxMetrics
from ._inbox_signals import Disposition, ParkMessage, SkipMessage
from ._inbox_store import KEY_PARKED, InboxStore, KeyId, KeyState

SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class TopicHandler:
    """A registered handler: ``fn(session, message)``, or ``fn(session, messages)`` when ``batch``."""

    fn: Callable[[Session, Any], Any]
    batch: bool = False

    def __call__(self, session: Session, messages: list[Message]) -> None:
        if self.batch:
            self.fn(session, messages)
        else:
            for message in messages:
                self.fn(session, message)


@dataclass(slots=True)
class Failure:
    delivery: Delivery
    error: BaseException
    traceback: str


@dataclass(slots=True)
class Batch:
    """The outcome of one transaction; ``alerts`` are raised after it committed."""

    done: list[tuple[Delivery, Disposition]] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    parked: list[tuple[str, str]] = field(default_factory=list)
    """(topic, reason) of each message parked, for the metrics."""


class Applier:
    """Runs batches; safe to call from several threads (each call has its own session)."""

    def __init__(self, sessions: sessionmaker[Session], store: InboxStore,
                 handlers: Mapping[str, TopicHandler], metrics: InboxMetrics) -> None:
        self.sessions = sessions
        self.store = store
        self.handlers = handlers
        self.metrics = metrics

    def apply(self, deliveries: list[Delivery]) -> Batch:
        """Handle ``deliveries`` (at most one per key) in one transaction and commit.

        A batch first runs without savepoints (they cost two round trips per
        message); if a handler fails, that transaction is rolled back and the
        batch redone with a SAVEPOINT per message, reusing the failure instead
        of running the failed handler again (a failed batch-handler call has
        no single culprit: the redo calls it once per message to find it).
        Either way the others commit.
        """
        known: dict[uuid.UUID, tuple[BaseException, str]] = {}
        if len(deliveries) > 1:
            try:
                return self._transaction(deliveries, known, savepoints=False)
            except _Redo as redo:
                if redo.delivery is not None:
                    known[redo.delivery.message.message_id] = redo.error
        return self._transaction(deliveries, known, savepoints=True)

    def _transaction(self, deliveries: list[Delivery], known: dict[uuid.UUID, tuple[BaseException, str]],
                     *, savepoints: bool) -> Batch:
        batch = Batch()
        with self.sessions() as session, session.begin():
            self._apply(session, deliveries, batch, known, savepoints)
        for (topic, disposition), count in Counter(
                (d.message.topic, disposition) for d, disposition in batch.done).items():
            self.metrics.counted(topic, disposition, count)
        for topic, reason in batch.parked:
            self.metrics.parked(topic, reason)
        return batch

    def _apply(self, session: Session, pending: list[Delivery], batch: Batch,
               known: dict[uuid.UUID, tuple[BaseException, str]], savepoints: bool) -> None:
        store = self.store
        states: dict[KeyId, KeyState] = {}
        new_seqs: dict[KeyId, int] = {}
        duplicates: list[Delivery] = []
        unhold: list[Delivery] = []
        while pending:
            to_lock = {d.lane for d in pending if d.ordered} - states.keys()
            states |= store.lock_keys(session, to_lock)  # type: ignore[arg-type]
            ready = [d for d in pending if self._triage(session, d, states, duplicates, unhold, batch)]
            claimed = store.claim(session, ready)
            fresh = [d for d in ready if d.message.message_id in claimed]
            duplicates.extend(d for d in ready if d.message.message_id not in claimed)
            if savepoints:
                outcomes = [(d, known.get(d.message.message_id) or self.run_handler(session, d))
                            for d in fresh]
            else:
                self._run_unguarded(session, fresh)
                outcomes = [(d, None) for d in fresh]
            advanced: dict[KeyId, int] = {}
            lost: list[Delivery] = []
            for d, error in outcomes:
                if error is not None and not isinstance(error[0], SkipMessage):
                    lost.append(d)
                    batch.failed.append(Failure(d, *error))
                    continue
                if error is not None:
                    store.mark(session, d, SKIPPED, str(error[0]) or "skipped by handler")
                batch.done.append((d, Disposition.SKIPPED if error else Disposition.APPLIED))
                if d.from_held:
                    unhold.append(d)
                if d.ordered:
                    lane: KeyId = d.lane  # type: ignore[assignment]
                    states[lane].last_seq = advanced[lane] = new_seqs[lane] = d.message.seq  # type: ignore[assignment]
            store.unclaim(session, (d.message.message_id for d in lost))
            pending = store.successors(session, {k: seq + 1 for k, seq in advanced.items()})
        store.count_redelivery(session, (d.message.message_id for d in duplicates))
        store.unhold(session, (d.message.message_id for d in unhold))
        store.set_last_seq(session, new_seqs)
        batch.done.extend((d, Disposition.DUPLICATE) for d in duplicates)

    def _triage(self, session: Session, d: Delivery, states: dict[KeyId, KeyState],
                duplicates: list[Delivery], unhold: list[Delivery], batch: Batch) -> bool:
        """Settle what needs no handler; True when ``d`` should run its handler now."""
        store, msg = self.store, d.message
        if d.problem == FOREIGN:
            self._park(session, d, batch, reason=FOREIGN, error=d.problem_detail)
            batch.alerts.append(self._alert("foreign_record", d, d.problem_detail or FOREIGN))
            return False
        if not d.ordered:
            if d.problem == UNDECODABLE:
                self._park(session, d, batch, reason=UNDECODABLE, error=d.problem_detail)
                batch.alerts.append(self._alert("message_parked", d, d.problem_detail or ""))
                return False
            return True
        state = states[d.lane]  # type: ignore[index]
        if msg.seq <= state.last_seq:  # type: ignore[operator]
            duplicates.append(d)
            if d.from_held:
                unhold.append(d)
            return False
        if state.parked:
            self._park(session, d, batch, reason=KEY_PARKED)
            return False
        if d.problem == UNDECODABLE:
            self._park(session, d, batch, reason=UNDECODABLE, error=d.problem_detail)
            batch.alerts.extend(park_key(store, session, d, UNDECODABLE, d.problem_detail or ""))
            state.parked = True
            return False
        if msg.seq > state.last_seq + 1:  # type: ignore[operator]
            if not d.from_held:
                store.hold(session, d)
            batch.done.append((d, Disposition.HELD))
            return False
        return True

    def _park(self, session: Session, d: Delivery, batch: Batch, *, reason: str,
              error: str | None = None) -> None:
        self.store.park(session, d, reason=reason, error=error)
        batch.parked.append((d.message.topic, reason))
        batch.done.append((d, Disposition.PARKED))

    def _alert(self, kind: str, d: Delivery, error: str) -> Alert:
        return make_alert(kind, d, error, self.store.group)

    def _run_unguarded(self, session: Session, fresh: list[Delivery]) -> None:
        """Run the handlers without savepoints, a batch handler once per topic; ``_Redo`` on a failure."""
        by_topic: dict[str, list[Delivery]] = {}
        for d in fresh:
            by_topic.setdefault(d.message.topic, []).append(d)
        for topic, group in by_topic.items():
            handler = self.handlers.get(topic)
            if handler is not None and handler.batch and len(group) > 1:
                error = self._call(session, topic, [d.message for d in group], savepoint=False)
                if error is not None:
                    raise _Redo(None, error)  # which message failed is found by the redo
                continue
            for d in group:
                error = self._call(session, topic, [d.message], savepoint=False)
                if error is not None:
                    raise _Redo(d, error)

    def run_handler(self, session: Session, d: Delivery) -> tuple[BaseException, str] | None:
        """Run the topic's handler for ``d`` alone in a SAVEPOINT; the error and traceback if it raised."""
        return self._call(session, d.message.topic, [d.message], savepoint=True)

    def _call(self, session: Session, topic: str, messages: list[Message], *,
              savepoint: bool) -> tuple[BaseException, str] | None:
        handler = self.handlers.get(topic)
        started = time.perf_counter()
        nested = session.begin_nested() if savepoint else None
        try:
            if handler is None:
                raise ParkMessage(f"no handler registered for topic {topic!r}")
            handler(session, messages)
            session.flush()
            if nested is not None:
                nested.commit()
        except Exception as exc:
            if nested is not None:
                nested.rollback()
            # A failed call of several messages is no one's attempt yet: the redo finds whose it is.
            self.metrics.ran(topic, time.perf_counter() - started, failed=len(messages) == 1)
            return exc, traceback.format_exc()
        self.metrics.ran(topic, time.perf_counter() - started, failed=False)
        return None


class _Redo(Exception):
    """A handler failed in a batch without savepoints: roll it all back, redo with savepoints.

    ``delivery`` is the message that failed, when a call had only that one.
    """

    def __init__(self, delivery: Delivery | None, error: tuple[BaseException, str]) -> None:
        super().__init__(f"redo batch: {error[0]!r}")
        self.delivery = delivery
        self.error = error


def park_key(store: InboxStore, session: Session, d: Delivery, reason: str,
             error: str) -> list[Alert]:
    """Mark ``d``'s key parked and move its held messages behind it; the one alert."""
    key: KeyId = d.lane  # type: ignore[assignment]
    store.park_key(session, key, f"{reason}: message {d.message.message_id} "
                                 f"(seq {d.message.seq}): {error}")
    for held in store.held_of(session, key):
        if held.message.message_id != d.message.message_id:
            store.park(session, held, reason=KEY_PARKED)
    return [make_alert("key_parked", d, error, store.group, reason=reason)]


def make_alert(kind: str, d: Delivery, error: str, group: str, **details: Any) -> Alert:
    msg = d.message
    return Alert(kind=kind, topic=msg.topic, key=msg.key, message_id=str(msg.message_id),
                 error=error, group=group,
                 details={"seq": msg.seq, "partition": d.partition, "offset": d.offset, **details})
