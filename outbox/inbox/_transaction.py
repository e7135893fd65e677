"""One inbox transaction: claim, order check, handler, advance — and commit.

This is the seam where the database work happens, and the only stage that
touches a session: everything before it (decode, schedule) and after it
(settle, commit offsets) works on its plain results. ``TransactionStep`` has
three entry points, each one transaction: ``apply`` a batch, ``park`` a message
whose attempts are spent, and ``run_handler`` inside an operator's replay.

A batch holds a *run* per key: its consecutive messages in seq order (see
``_runs``), so a busy key pays one lock, one claim, one advance and one commit
for the whole run, and the handler once per message. When a handler fails,
the batch is redone with each message in its own SAVEPOINT, so the failure
rolls back only its own writes: the messages before it in its key commit,
the key advances to the one before it, and the rest of its key is not run
(``Batch.blocked``: it waits for the failed one). A batch handler gets all of
a batch's messages of its topic in one call, each key's in seq order; when
that call fails, the redo calls it once per message, each in its SAVEPOINT,
to find the message that fails. The dedup rows, the key's new ``last_seq`` and
the handler's writes commit together: that is what makes effects inside the
inbox database happen once. A held message that becomes next is applied in
the same transaction, right after its predecessor.

Failures are not retried here: they come back in ``Batch.failed`` for the
settle stage. A database outage under a handler aborts the whole transaction
(``Outage``): it is nobody's attempt.

Each transaction runs through ``Sessions.run``: in the calling thread on a
sync inbox, on the inbox's event loop on an async one (``_sessions``). The
rules here are the same for both.
"""

from __future__ import annotations

import enum
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy.orm import Session

from transports._logsafe import safe_logger

from .._envelope import utcnow
from ._calls import Error, HandlerCalls, Redo, TopicHandler
from ._conflicts import Verdict, describe, describe_held, judge, judge_held
from ._delivery import Delivery
from ._kinds import Outcome, Reason, StartPolicy
from ._metrics import InboxMetrics
from ._runs import Lanes, lane_of
from ._sessions import Sessions
from ._signals import Disposition, SkipMessage
from ._store import InboxStore, KeyId, KeyState


@dataclass(slots=True)
class Failure:
    delivery: Delivery
    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class Parked:
    """A message this transaction parked, for the alerts and metrics raised after commit."""

    delivery: Delivery
    reason: Reason
    error: str
    key_parked: bool


@dataclass(slots=True)
class Batch:
    """The outcome of one committed transaction."""

    done: list[tuple[Delivery, Disposition]] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    parked: list[Parked] = field(default_factory=list)
    blocked: list[Delivery] = field(default_factory=list)
    """Later messages of a failed message's key: not run, they wait for it, in seq order."""
    conflicts: list[tuple[Delivery, Verdict]] = field(default_factory=list)
    """New ids met at or below their key's last seq, and what became of each (``_conflicts``)."""


log = safe_logger("outbox.inbox")

HELD_RUN = 100
"""Held messages of a key fetched at most per round, when the key catches up to them."""


class TransactionStep:
    """Runs inbox transactions; safe to call from several threads (each call has its own session)."""

    def __init__(self, sessions: Sessions, store: InboxStore,
                 handlers: Mapping[str, TopicHandler], metrics: InboxMetrics,
                 start: StartPolicy = StartPolicy.STRICT, dedup_window: float | None = None) -> None:
        self.sessions = sessions
        self.store = store
        self.handlers = handlers
        self.metrics = metrics
        self.calls = HandlerCalls(handlers, metrics, store.group)
        self.start = start
        self.dedup_window = dedup_window
        """Seconds after which this group's dedup records may be pruned; None: never."""

    # -- apply ------------------------------------------------------------------

    def apply(self, deliveries: list[Delivery]) -> Batch:
        """Handle ``deliveries`` (any number per key) in one transaction and commit.

        A batch first runs without savepoints (they cost two round trips per
        message); if a handler fails, that transaction is rolled back and the
        batch redone with a SAVEPOINT per message, reusing the failure instead
        of running the failed handler again (a failed batch-handler call has
        no single culprit: the redo calls it once per message to find it).
        Either way the others commit. Raises what the database raised when the
        transaction itself failed (``Outage`` among them).
        """
        known: dict[uuid.UUID, Error] = {}
        if len(deliveries) > 1:
            try:
                return self._transaction(deliveries, known, savepoints=False)
            except Redo as redo:
                if redo.delivery is not None:
                    known[redo.delivery.message.message_id] = redo.error
        return self._transaction(deliveries, known, savepoints=True)

    def _transaction(self, deliveries: list[Delivery], known: dict[uuid.UUID, Error], *,
                     savepoints: bool) -> Batch:
        batch = self.sessions.run(self._commit, deliveries, known, savepoints)
        for (topic, disposition), count in Counter(
                (d.message.topic, disposition) for d, disposition in batch.done).items():
            self.metrics.counted(topic, disposition, count)
        if batch.conflicts:
            self._report_conflicts(batch.conflicts)
        return batch

    def _report_conflicts(self, conflicts: list[tuple[Delivery, Verdict]]) -> None:
        """Count every verdict; log the ones that park nothing (parks raise their own alerts)."""
        for (topic, verdict), count in Counter((d.message.topic, v) for d, v in conflicts).items():
            self.metrics.conflicts(topic, verdict, count)
        for d, verdict in conflicts:
            msg = d.message
            if verdict is Verdict.RESTART:
                log.warning("group %r: key %r of topic %r starts again at seq %s of producer "
                            "incarnation %s (start policy first_seen)", self.store.group, msg.key,
                            msg.topic, msg.seq, msg.incarnation)
            elif verdict is Verdict.EXPIRED:
                log.warning("group %r: message %s (%r/%r seq %s, created %s) is older than the dedup "
                            "window and its record was pruned: taken for a redelivery, not applied",
                            self.store.group, msg.message_id, msg.topic, msg.key, msg.seq,
                            msg.created_at.isoformat())

    def _commit(self, deliveries: list[Delivery], known: dict[uuid.UUID, Error],
                savepoints: bool) -> Batch:
        batch = Batch()
        with self.sessions() as session, session.begin():
            self._apply(session, deliveries, batch, known, savepoints)
        return batch

    def _apply(self, session: Session, deliveries: list[Delivery], batch: Batch,
               known: dict[uuid.UUID, Error], savepoints: bool) -> None:
        store = self.store
        lanes = Lanes(deliveries)
        states = store.lock_keys(session, lanes.keys())  # every key of the batch, one statement
        # Only a recorded id is a duplicate: the ids at or below their key's position, one statement.
        dedup = _Recorded(store)
        dedup.look_up(session, [d for d in deliveries
                                if d.ordered and d.message.seq <= states[d.lane].last_seq])  # type: ignore[index,operator]
        new_seqs: dict[KeyId, int] = {}
        incarnations: dict[KeyId, str] = {}  # keys whose applied message changed their incarnation
        starts: dict[KeyId, int] = {}
        seen: set[uuid.UUID] = set()
        duplicates: list[Delivery] = []
        unhold: dict[uuid.UUID, Delivery] = {}

        def duplicate(d: Delivery) -> None:
            duplicates.append(d)
            if d.from_held:
                unhold[d.message.message_id] = d

        while lanes:
            runs: list[list[Delivery]] = []
            behind: list[Delivery] = []
            for queue in lanes.queues():
                run = self._walk(session, queue, states, starts, seen, batch, duplicate, behind, dedup)
                if run:
                    runs.append(run)
            candidates = [d for run in runs for d in run]
            claimed = store.claim(session, candidates)
            if behind:  # met at or below its key's position only after a run: look them up now
                dedup.look_up(session, behind)
                seen.difference_update(d.message.message_id for d in behind)
                lanes.push_front(behind)  # the next round settles each as duplicate or conflict
            lost: list[Delivery] = []
            fresh: list[list[Delivery]] = []
            if len(claimed) == len(candidates):
                fresh = runs  # every id new: the common case
            for run in runs if fresh is not runs else ():
                # A recorded id ends the run: what follows it waits for the next round, against
                # the key's real state (it is held there, as the key did not advance).
                cut = next((n for n, d in enumerate(run) if d.message.message_id not in claimed), len(run))
                if cut < len(run):
                    duplicate(run[cut])
                    # What follows goes back to be walked again, its claims given back; an id
                    # in it that was recorded before (its key restarted below it) is a
                    # duplicate too, and keeps its record.
                    rest = [d for d in run[cut + 1:] if d.message.message_id in claimed]
                    for d in run[cut + 1:]:
                        if d.message.message_id not in claimed:
                            duplicate(d)
                    lost.extend(rest)
                    seen.difference_update(d.message.message_id for d in rest)
                    lanes.push_front(rest)
                if cut:
                    fresh.append(run[:cut])
            if not savepoints:
                self.calls.unguarded(session, candidates if fresh is runs else
                                     [d for run in fresh for d in run])
            applied: dict[KeyId, tuple[int, int]] = {}
            for run in fresh:
                done = len(run)
                for n, d in enumerate(run):
                    error = None
                    if savepoints:
                        error = known.get(d.message.message_id) or self.calls.one(session, d)
                    if error is not None and not isinstance(error[0], SkipMessage):
                        # Nothing after a failure may apply: the rest of the key waits for it.
                        batch.failed.append(Failure(d, *error))
                        lost.extend(run[n:])
                        batch.blocked.extend(run[n + 1:] + lanes.stop(d))
                        done = n
                        break
                    if error is not None:
                        store.mark(session, d, Outcome.SKIPPED, str(error[0]) or "skipped by handler")
                    batch.done.append((d, Disposition.SKIPPED if error else Disposition.APPLIED))
                    if d.from_held:
                        unhold[d.message.message_id] = d
                if done and run[0].ordered:
                    lane: KeyId = run[0].lane  # type: ignore[assignment]
                    first, last = run[0].message.seq, run[done - 1].message.seq
                    states[lane].last_seq = new_seqs[lane] = last  # type: ignore[assignment]
                    incarnation = run[done - 1].message.incarnation
                    if incarnation is not None and incarnation != states[lane].incarnation:
                        states[lane].incarnation = incarnations[lane] = incarnation
                    applied[lane] = (applied[lane][0] if lane in applied else first, last)  # type: ignore[assignment]
            store.unclaim(session, (d.message.message_id for d in lost))
            # Held copies of what was applied go; the held ones that are next join the next round.
            blocked = {lane_of(f.delivery) for f in batch.failed}
            expected = {lane: last + 1 for lane, (_, last) in applied.items()}
            for d in store.successors(session, {
                    lane: (first, last if lane in blocked else last + HELD_RUN)
                    for lane, (first, last) in applied.items()}):
                lane = d.lane  # type: ignore[assignment]
                if d.message.message_id in unhold:
                    continue  # the held row this transaction applied
                if d.message.seq <= states[lane].last_seq:  # type: ignore[operator]
                    lanes.push_front([d])  # a duplicate only if its id is recorded: the next round
                elif d.message.seq == expected[lane]:
                    lanes.push_front([d])
                    expected[lane] += 1
                # else: behind another gap; it stays held
        store.count_redelivery(session, (d.message.message_id for d in duplicates))
        store.unhold(session, unhold)
        store.set_last_seq(session, new_seqs, incarnations)
        # A key starts where its first message applied; if that one failed, its retry starts it.
        store.set_started(session, {lane: seq for lane, seq in starts.items() if lane in new_seqs})
        batch.done.extend((d, Disposition.DUPLICATE) for d in duplicates)

    def _walk(self, session: Session, queue: deque[Delivery], states: dict[KeyId, KeyState],
              starts: dict[KeyId, int], seen: set[uuid.UUID], batch: Batch,
              duplicate: Callable[[Delivery], None], behind: list[Delivery],
              dedup: _Recorded) -> list[Delivery]:
        """Settle a lane's head deliveries that need no handler; return the key's run.

        The run is the next message of the key and those that follow it in
        seq order without a gap. It stops before anything else, which the next
        round settles against the state the run leaves.
        """
        run: list[Delivery] = []
        while queue:
            d = queue[0]
            if run:
                last = run[-1].message
                if (d.message.seq != last.seq + 1 or d.problem is not None  # type: ignore[operator]
                        or d.message.message_id in seen):
                    break
                queue.popleft()
                seen.add(d.message.message_id)
                run.append(d)
                continue
            queue.popleft()
            # Two copies of one message (a resend, a lost ack): only the first may run.
            if d.message.message_id in seen:
                duplicate(d)
                continue
            verdict = self._triage(session, d, states, starts, batch, dedup)
            if verdict is _Triage.DUPLICATE:
                duplicate(d)
                continue
            seen.add(d.message.message_id)
            if verdict is _Triage.RUN:
                run.append(d)
            elif verdict is _Triage.BEHIND:
                behind.append(d)
                break  # the rest of the key waits until this one is settled
        return run

    def _triage(self, session: Session, d: Delivery, states: dict[KeyId, KeyState],
                starts: dict[KeyId, int], batch: Batch, dedup: _Recorded) -> _Triage:
        """Settle what needs neither a claim nor a handler; what to do with ``d`` otherwise."""
        msg = d.message
        if d.problem is Reason.FOREIGN:
            self._park(session, d, batch, Reason.FOREIGN, d.problem_detail or "")
            return _Triage.SETTLED
        if not d.ordered:
            if d.problem is Reason.UNDECODABLE:
                self._park(session, d, batch, Reason.UNDECODABLE, d.problem_detail or "")
                return _Triage.SETTLED
            return _Triage.RUN
        lane: KeyId = d.lane  # type: ignore[assignment]
        state = states[lane]
        seq: int = msg.seq  # type: ignore[assignment]
        if self.start is StartPolicy.FIRST_SEEN and state.untouched and seq > 1:
            state.last_seq, state.started_at_seq = seq - 1, seq
            starts[lane] = seq
        if seq <= state.last_seq:
            if not dedup.looked_up(msg.message_id):
                return _Triage.BEHIND
            if dedup.recorded(msg.message_id):
                return _Triage.DUPLICATE
            return self._conflict(session, d, state, starts, batch)
        if state.parked:
            self._park(session, d, batch, Reason.KEY_PARKED, "")
            return _Triage.SETTLED
        if d.problem is Reason.UNDECODABLE:
            self._park(session, d, batch, Reason.UNDECODABLE, d.problem_detail or "")
            state.parked = True
            return _Triage.SETTLED
        if seq > state.last_seq + 1:
            holder = None if d.from_held else self.store.hold(session, d)
            if holder is not None:
                return self._held_conflict(session, d, holder, state, batch)
            batch.done.append((d, Disposition.HELD))
            return _Triage.SETTLED
        return _Triage.RUN

    def _conflict(self, session: Session, d: Delivery, state: KeyState, starts: dict[KeyId, int],
                  batch: Batch) -> _Triage:
        """Settle a new id at or below its key's last seq by its verdict (``_conflicts``)."""
        expired_before = (utcnow() - timedelta(seconds=self.dedup_window)
                          if self.dedup_window is not None else None)
        verdict = judge(d, state, self.start, expired_before)
        batch.conflicts.append((d, verdict))
        if verdict is Verdict.EXPIRED:
            return _Triage.DUPLICATE
        seq: int = d.message.seq  # type: ignore[assignment]
        if verdict is Verdict.RESTART:
            # Recorded like a first_seen start once its first message applies (set_started),
            # which also records the new incarnation (set_last_seq).
            state.last_seq, state.started_at_seq = seq - 1, seq
            starts[d.lane] = seq  # type: ignore[index]
            return _Triage.RUN
        reason: Reason = verdict.reason  # type: ignore[assignment]
        self._park(session, d, batch, reason, describe(verdict, d, state))
        if reason.parks_key:
            state.parked = True
        return _Triage.SETTLED

    def _held_conflict(self, session: Session, d: Delivery, holder: Delivery, state: KeyState,
                       batch: Batch) -> _Triage:
        """Settle ``d``, ahead of a gap, whose seq another held message claims already.

        A recorded id is a duplicate whatever its seq (a key that restarted
        below it holds resends of what it applied before): if either of the
        two is recorded, it is the duplicate and the other is held.

        The key can hold one message per seq, and which of the two follows the
        gap is not for the inbox to guess: ``d`` parks with its key (the held
        one behind it), under either start policy, as a conflict below the
        key's position would (``_conflicts.judge_held``).
        """
        recorded = self.store.known(session, [d, holder])
        if d.message.message_id in recorded:
            return _Triage.DUPLICATE  # a resend of a message applied before its key restarted
        if holder.message.message_id in recorded:
            # The held one is such a resend: it goes (counted as a redelivery), ``d`` takes its place.
            self.store.unhold(session, [holder.message.message_id])
            self.store.count_redelivery(session, [holder.message.message_id])
            if self.store.hold(session, d) is None:
                batch.done.append((d, Disposition.HELD))
                return _Triage.SETTLED
        verdict = judge_held(d, holder)
        batch.conflicts.append((d, verdict))
        self._park(session, d, batch, verdict.reason or Reason.SEQ_CONFLICT,
                   describe_held(verdict, d, holder, state))
        state.parked = True
        return _Triage.SETTLED

    def _park(self, session: Session, d: Delivery, batch: Batch, reason: Reason, error: str) -> None:
        key_parked = self.store.park(session, d, reason, error=error or None)
        batch.parked.append(Parked(d, reason, error, key_parked))
        batch.done.append((d, Disposition.PARKED))

    # -- park -------------------------------------------------------------------

    def park(self, d: Delivery, error: BaseException, trace: str) -> tuple[Disposition, Parked | None]:
        """Park a message whose attempts are spent (and its key), in its own transaction."""
        return self.sessions.run(self._park_spent, d, error, trace)

    def _park_spent(self, d: Delivery, error: BaseException,
                    trace: str) -> tuple[Disposition, Parked | None]:
        text = f"{type(error).__name__}: {error}"
        with self.sessions() as session, session.begin():
            lane = d.lane if d.ordered else None
            state = self.store.lock_keys(session, [lane])[lane] if lane is not None else None
            if (state is not None and d.message.seq <= state.last_seq  # type: ignore[operator]
                    and self.store.is_recorded(session, d.message.message_id)):
                return Disposition.DUPLICATE, None  # applied meanwhile by another consumer
            reason = Reason.KEY_PARKED if state is not None and state.parked else Reason.FAILED
            if reason is Reason.KEY_PARKED:
                key_parked = self.store.park(session, d, reason)
            else:
                key_parked = self.store.park(session, d, reason, error=text, traceback=trace,
                                             attempts=d.attempts)
        return Disposition.PARKED, Parked(d, reason, text, key_parked)

    def run_handler(self, session: Session, d: Delivery) -> Error | None:
        """Run the topic's handler for ``d`` alone in a SAVEPOINT (an operator's replay).

        Raises ``Outage`` when the database failed under the handler.
        """
        return self.calls.one(session, d)


class _Triage(enum.Enum):
    RUN = "run"
    """Next in its key (or unkeyed): claim it and run its handler."""
    DUPLICATE = "duplicate"
    """At or below its key's last seq with a recorded id (or expired): applied already."""
    BEHIND = "behind"
    """At or below its key's last seq, its id not looked up yet: settled in the next round."""
    SETTLED = "settled"
    """Held or parked without a claim."""


class _Recorded:
    """Which message ids of one transaction the group recorded already, looked up a batch at a time."""

    def __init__(self, store: InboxStore) -> None:
        self._store = store
        self._asked: set[uuid.UUID] = set()
        self._found: set[uuid.UUID] = set()

    def look_up(self, session: Session, deliveries: list[Delivery]) -> None:
        """One statement for all of ``deliveries`` (none when it is empty: the steady state)."""
        if deliveries:
            self._asked.update(d.message.message_id for d in deliveries)
            self._found |= self._store.known(session, deliveries)

    def looked_up(self, message_id: uuid.UUID) -> bool:
        return message_id in self._asked

    def recorded(self, message_id: uuid.UUID) -> bool:
        return message_id in self._found
