"""One inbox transaction: classify, dedup, run handlers, advance key state, commit.

A batch holds deliveries of *different* keys (the scheduler guarantees it),
each handled in its own SAVEPOINT, so one failing handler rolls back only its
own writes and the others commit. The dedup rows, the key's new ``last_seq``
and the handler's writes commit together: that is what makes effects inside
the inbox database happen once. A held message that becomes next is applied
in the same transaction, right after its predecessor.

Failures are not retried here: they come back in ``Batch.failed`` and the
caller retries them one at a time (``_inbox_retry``), so a poison message
never holds up the rest of its batch.
"""

from __future__ import annotations

import time
import traceback
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

Handler = Callable[[Session, Message], Any]
SKIPPED = "skipped"


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


class Applier:
    """Runs batches; safe to call from several threads (each call has its own session)."""

    def __init__(self, sessions: sessionmaker[Session], store: InboxStore,
                 handlers: Mapping[str, Handler], metrics: InboxMetrics) -> None:
        self.sessions = sessions
        self.store = store
        self.handlers = handlers
        self.metrics = metrics

    def apply(self, deliveries: list[Delivery]) -> Batch:
        """Handle ``deliveries`` (at most one per key) in one transaction and commit."""
        batch = Batch()
        with self.sessions() as session, session.begin():
            self._apply(session, deliveries, batch)
        return batch

    def _apply(self, session: Session, pending: list[Delivery], batch: Batch) -> None:
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
            advanced: dict[KeyId, int] = {}
            lost: list[Delivery] = []
            for d in ready:
                if d.message.message_id not in claimed:
                    duplicates.append(d)
                    continue
                error = self.run_handler(session, d)
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
        for d in duplicates:
            self.metrics.duplicate(d.message.topic)
            batch.done.append((d, Disposition.DUPLICATE))

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
                self.metrics.held(msg.topic)
            batch.done.append((d, Disposition.HELD))
            return False
        return True

    def _park(self, session: Session, d: Delivery, batch: Batch, *, reason: str,
              error: str | None = None) -> None:
        self.store.park(session, d, reason=reason, error=error)
        self.metrics.parked(d.message.topic, reason)
        batch.done.append((d, Disposition.PARKED))

    def _alert(self, kind: str, d: Delivery, error: str) -> Alert:
        return make_alert(kind, d, error, self.store.group)

    def run_handler(self, session: Session, d: Delivery) -> tuple[BaseException, str] | None:
        """Run the topic's handler inside a SAVEPOINT; the error and traceback if it raised."""
        topic = d.message.topic
        handler = self.handlers.get(topic)
        started = time.perf_counter()
        savepoint = session.begin_nested()
        try:
            if handler is None:
                raise ParkMessage(f"no handler registered for topic {topic!r}")
            handler(session, d.message)
            session.flush()
            savepoint.commit()
        except Exception as exc:
            savepoint.rollback()
            self.metrics.failed(topic, time.perf_counter() - started)
            return exc, traceback.format_exc()
        self.metrics.handled(topic, time.perf_counter() - started)
        return None


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
