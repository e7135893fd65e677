"""The phases of one inbox transaction, in rounds: triage, claim, run, advance, successors.

**This is where a delivery becomes applied or parked.** A batch holds a *run*
per key: its consecutive messages in seq order (see ``_runs``), so a busy key
pays one lock, one claim, one advance and one commit for the whole run, and
the handler once per message. One round:

1. **triage** walks each key's queue: what needs no handler is settled here
   (a second copy, a recorded id: duplicate; a gap: held; a foreign,
   undecodable or conflicting message, or one of a parked key: parked); what
   is next in its key starts the key's run;
2. **claim** inserts the runs' dedup rows in one statement; a recorded id
   ends its run (a duplicate), the rest of the key waits for the next round;
3. **run** calls the handlers (``_calls.AllAtOnce`` or ``OneByOne``): a
   message whose handler returned is *applied* (or skipped); one that failed
   comes back in ``Committed.failed`` and the rest of its key is not run
   (``Committed.blocked``); once the transaction's budget is spent, what was
   not called comes back in ``Committed.deferred`` with the rest of its key;
4. **advance** moves each key to its last applied seq and gives back the
   claims of what did not apply;
5. **successors** fetches the held messages that are next now: they join the
   next round, so a held message is applied in the same transaction, right
   after its predecessor.

Every decision lands in the transaction's ``_ledger.Ledger``; rounds repeat
until no lane holds anything, and **finish** then has the ledger write what
the rounds gathered (redelivery counts, held rows to delete, the keys' new
``last_seq``). The SQL behind each decision is the storage's
(``storage.InboxStorage``), whose ``park`` is the one way into
``inbox_parked``. ``_transaction.TransactionStep`` opens the transaction,
locks the keys, runs the rounds and commits.
"""

from __future__ import annotations

import enum
import uuid
from collections import deque
from datetime import timedelta

from sqlalchemy.orm import Session

from ..core._envelope import utcnow
from ..core._tables import InboxOutcome
from ._calls import Handlers
from ._committed import Committed, Failure
from ._conflicts import Verdict, describe, describe_held, judge, judge_held
from ._delivery import Delivery, KeyedDelivery, KeyId, OrderedDelivery, lane_of
from ._kinds import Reason, StartPolicy
from ._ledger import Ledger
from ._recorded import RecordedIds
from ._runs import Lanes
from ._signals import Disposition, SkipMessage
from .storage import InboxStorage, KeyState

HELD_RUN = 100
"""Held messages of a key fetched at most per round, when the key catches up to them."""


class Transaction:
    """The phases of one transaction over keys its caller locked; for one thread, one session.

    ``start`` and ``dedup_window`` are the group's (``TransactionStep``'s): how a
    key first met past seq 1 starts, and how old a message must be to count as
    an expired redelivery when its record is gone.
    """

    def __init__(self, storage: InboxStorage, session: Session, states: dict[KeyId, KeyState],
                 handlers: Handlers, lanes: Lanes, *, start: StartPolicy,
                 dedup_window: float | None) -> None:
        self.storage = storage
        self.start = start
        self.dedup_window = dedup_window
        self.session = session
        self.states = states
        self.handlers = handlers
        self.lanes = lanes
        self.ledger = Ledger(storage, session)
        self.dedup = RecordedIds(storage.dedup)
        self.seen: set[uuid.UUID] = set()
        self.lost: list[Delivery] = []
        """Claimed this round but not applied: their claims go back in ``advance``."""

    @property
    def committed(self) -> Committed:
        """What the transaction did, for the settle stage (the ledger's)."""
        return self.ledger.committed

    def look_up_behind(self, deliveries: list[Delivery]) -> None:
        """Only a recorded id is a duplicate: look up the ids at or below their key's position."""
        self.dedup.look_up(self.session, [d for d in deliveries if isinstance(d, OrderedDelivery)
                                          and d.seq <= self.states[d.lane].last_seq])

    def round(self) -> None:
        """One pass over every lane: triage, claim, run, advance, successors."""
        runs, behind = self.triage()
        fresh = self.claim(runs)
        if behind:  # met at or below its key's position only after a run: look them up now
            self.dedup.look_up(self.session, behind)
            self.seen.difference_update(d.message.message_id for d in behind)
            self.lanes.push_front(behind)  # the next round settles each as duplicate or conflict
        applied = self.advance(self.run(fresh))
        self.successors(applied)

    # -- triage -----------------------------------------------------------------

    def triage(self) -> tuple[list[list[Delivery]], list[Delivery]]:
        """Settle each lane's head deliveries that need no handler; the keys' runs, and what is behind."""
        runs: list[list[Delivery]] = []
        behind: list[Delivery] = []
        for queue in self.lanes.queues():
            run = self._walk(queue, behind)
            if run:
                runs.append(run)
        return runs, behind

    def _walk(self, queue: deque[Delivery], behind: list[Delivery]) -> list[Delivery]:
        """Settle a lane's head deliveries that need no handler; return the key's run.

        The run is the next message of the key and those that follow it in
        seq order without a gap (a key without seqs: in arrival order). It
        stops before anything else, which the next round settles against the
        state the run leaves.
        """
        run: list[Delivery] = []
        while queue:
            d = queue[0]
            if run:
                if (not _follows(d, run[-1]) or d.unreadable is not None
                        or d.message.message_id in self.seen):
                    break
                queue.popleft()
                self.seen.add(d.message.message_id)
                run.append(d)
                continue
            queue.popleft()
            # Two copies of one message (a resend, a lost ack): only the first may run.
            if d.message.message_id in self.seen:
                self.ledger.duplicate(d)
                continue
            verdict = self._triage(d)
            if verdict is _Triage.DUPLICATE:
                self.ledger.duplicate(d)
                continue
            self.seen.add(d.message.message_id)
            if verdict is _Triage.RUN:
                run.append(d)
            elif verdict is _Triage.BEHIND:
                behind.append(d)
                break  # the rest of the key waits until this one is settled
        return run

    def _triage(self, d: Delivery) -> _Triage:
        """Settle what needs neither a claim nor a handler; what to do with ``d`` otherwise."""
        unreadable = d.unreadable
        if unreadable is not None and unreadable.reason is Reason.FOREIGN:
            self.ledger.park(d, Reason.FOREIGN, unreadable.detail)
            return _Triage.SETTLED
        if not isinstance(d, KeyedDelivery):
            if unreadable is not None and unreadable.reason is Reason.UNDECODABLE:
                self.ledger.park(d, Reason.UNDECODABLE, unreadable.detail)
                return _Triage.SETTLED
            return _Triage.RUN
        if not isinstance(d, OrderedDelivery):
            return self._triage_unnumbered(d)
        state = self.states[d.lane]
        seq = d.seq
        if self.start is StartPolicy.FIRST_SEEN and state.untouched and seq > 1:
            state.last_seq, state.started_at_seq = seq - 1, seq
            self.ledger.started(d.lane, seq)
        if seq <= state.last_seq:
            if not self.dedup.looked_up(d.message.message_id):
                return _Triage.BEHIND
            if self.dedup.recorded(d.message.message_id):
                return _Triage.DUPLICATE
            return self._conflict(d, state)
        if state.parked:
            self.ledger.park_behind(d)
            return _Triage.SETTLED
        if unreadable is not None and unreadable.reason is Reason.UNDECODABLE:
            self.ledger.park(d, Reason.UNDECODABLE, unreadable.detail)
            state.parked = True
            return _Triage.SETTLED
        if seq > state.last_seq + 1:
            holder = None if d.from_held else self.storage.held.hold(self.session, d)
            if holder is not None:
                return self._held_conflict(d, holder, state)
            self.ledger.held(d)
            return _Triage.SETTLED
        return _Triage.RUN

    def _triage_unnumbered(self, d: KeyedDelivery) -> _Triage:
        """A keyed message without a seq: behind its parked key, parked as undecodable, or run.

        Its key's position does not move (there is none to move): only its
        parked flag counts. A redelivery is found by its id when it is claimed.
        """
        state = self.states[d.lane]
        if state.parked:
            self.ledger.park_behind(d)
            return _Triage.SETTLED
        if d.unreadable is not None and d.unreadable.reason is Reason.UNDECODABLE:
            self.ledger.park(d, Reason.UNDECODABLE, d.unreadable.detail)
            state.parked = True
            return _Triage.SETTLED
        return _Triage.RUN

    def _held_conflict(self, d: OrderedDelivery, holder: OrderedDelivery, state: KeyState) -> _Triage:
        """Settle ``d``, ahead of a gap, whose seq another held message claims already.

        A recorded id is a duplicate whatever its seq (a key that restarted
        below it holds resends of what it applied before): if either of the
        two is recorded, it is the duplicate and the other is held. Otherwise
        the key can hold one message per seq, and which of the two follows the
        gap is not for the inbox to guess: ``d`` parks with its key (the held
        one behind it), under either start policy, as a conflict below the
        key's position would (``_conflicts.judge_held``).
        """
        recorded = self.storage.dedup.known(self.session, [d, holder])
        if d.message.message_id in recorded:
            return _Triage.DUPLICATE  # a resend of a message applied before its key restarted
        if holder.message.message_id in recorded:
            # The held one is such a resend: it goes (counted as a redelivery), ``d`` takes its place.
            self.storage.held.remove(self.session, [holder.message.message_id])
            self.storage.dedup.count_redelivery(self.session, [holder.message.message_id])
            if self.storage.held.hold(self.session, d) is None:
                self.ledger.held(d)
                return _Triage.SETTLED
        verdict = judge_held(d, holder)
        self.ledger.conflict(d, verdict)
        self.ledger.park(d, verdict.reason or Reason.SEQ_CONFLICT, describe_held(verdict, d, holder, state))
        state.parked = True
        return _Triage.SETTLED

    def _conflict(self, d: OrderedDelivery, state: KeyState) -> _Triage:
        """Settle a new id at or below its key's last seq by its verdict (``_conflicts``)."""
        window = self.dedup_window
        expired_before = utcnow() - timedelta(seconds=window) if window is not None else None
        verdict = judge(d, state, self.start, expired_before)
        self.ledger.conflict(d, verdict)
        if verdict is Verdict.EXPIRED:
            return _Triage.DUPLICATE
        if verdict is Verdict.RESTART:
            # Recorded like a first_seen start once its first message applies (set_started),
            # which also records the new incarnation (set_last_seq).
            self.restart(d)
            return _Triage.RUN
        reason = verdict.reason
        if reason is None:
            raise AssertionError(f"verdict {verdict} parks nothing")  # EXPIRED, RESTART: above
        self.ledger.park(d, reason, describe(verdict, d, state))
        if reason.parks_key:
            state.parked = True
        return _Triage.SETTLED

    def restart(self, d: OrderedDelivery) -> None:
        """Start ``d``'s key again at ``d``'s seq (a rebuilt producer, an operator's replay)."""
        state = self.states[d.lane]
        state.last_seq, state.started_at_seq = d.seq - 1, d.seq
        self.ledger.started(d.lane, d.seq)

    # -- claim ------------------------------------------------------------------

    def claim(self, runs: list[list[Delivery]]) -> list[list[Delivery]]:
        """Insert the runs' dedup rows, one statement; the runs cut before their first recorded id."""
        candidates = [d for run in runs for d in run]
        claimed = self.storage.dedup.claim(self.session, candidates)
        if len(claimed) == len(candidates):
            return runs  # every id new: the common case
        fresh: list[list[Delivery]] = []
        for run in runs:
            # A recorded id ends the run: what follows it waits for the next round, against
            # the key's real state (it is held there, as the key did not advance).
            cut = next((n for n, d in enumerate(run) if d.message.message_id not in claimed), len(run))
            if cut < len(run):
                self.ledger.duplicate(run[cut])
                # What follows goes back to be walked again, its claims given back; an id in it
                # that was recorded before (its key restarted below it) is a duplicate too, and
                # keeps its record.
                rest = [d for d in run[cut + 1:] if d.message.message_id in claimed]
                for d in run[cut + 1:]:
                    if d.message.message_id not in claimed:
                        self.ledger.duplicate(d)
                self.lost.extend(rest)
                self.seen.difference_update(d.message.message_id for d in rest)
                self.lanes.push_front(rest)
            if cut:
                fresh.append(run[:cut])
        return fresh

    # -- run --------------------------------------------------------------------

    def run(self, fresh: list[list[Delivery]]) -> list[list[Delivery]]:
        """Call the handlers of the claimed runs; each run's messages that applied (or were skipped)."""
        self.handlers.call(self.session, [d for run in fresh for d in run])
        return [self._run(run) for run in fresh]

    def _run(self, run: list[Delivery]) -> list[Delivery]:
        for n, d in enumerate(run):
            if self.handlers.deferred(d):
                # The budget was spent: the rest of the key goes to the next transaction, unclaimed.
                self.ledger.deferred(run[n:] + self.lanes.stop(d))
                self.lost.extend(run[n:])
                return run[:n]
            error = self.handlers.error(self.session, d)
            if error is not None and not isinstance(error[0], SkipMessage):
                # Nothing after a failure may apply: the rest of the key waits for it.
                self.ledger.failed(Failure(d, *error), run[n + 1:] + self.lanes.stop(d))
                self.lost.extend(run[n:])
                return run[:n]
            if error is not None:
                self.storage.dedup.mark(self.session, d, InboxOutcome.SKIPPED,
                                        str(error[0]) or "skipped by handler")
            self.ledger.applied(d, Disposition.SKIPPED if error else Disposition.APPLIED)
        return run

    # -- advance ----------------------------------------------------------------

    def advance(self, applied: list[list[Delivery]]) -> dict[KeyId, tuple[int, int]]:
        """Move each key to its last applied seq; give back the claims of what did not apply.

        Returns each advanced key's (first, last) seq applied in this transaction.
        """
        ranges: dict[KeyId, tuple[int, int]] = {}
        for run in applied:
            first, last = (run[0], run[-1]) if run else (None, None)
            if not (isinstance(first, OrderedDelivery) and isinstance(last, OrderedDelivery)):
                continue
            lane, state = first.lane, self.states[first.lane]
            incarnation = last.message.incarnation
            changed = incarnation if incarnation is not None and incarnation != state.incarnation else None
            state.last_seq = last.seq
            if changed is not None:
                state.incarnation = changed
            self.ledger.advanced(lane, last.seq, changed)
            ranges[lane] = (ranges[lane][0] if lane in ranges else first.seq, last.seq)
        self.storage.dedup.unclaim(self.session, (d.message.message_id for d in self.lost))
        self.lost = []
        return ranges

    # -- successors -------------------------------------------------------------

    def successors(self, applied: dict[KeyId, tuple[int, int]]) -> None:
        """Held copies of what was applied go; the held ones that are next join the next round."""
        blocked = {lane_of(f.delivery) for f in self.committed.failed}
        expected = {lane: last + 1 for lane, (_, last) in applied.items()}
        for d in self.storage.held.successors(self.session, {
                lane: (first, last if lane in blocked else last + HELD_RUN)
                for lane, (first, last) in applied.items()}):
            if self.ledger.settled_held(d.message.message_id):
                continue  # the held row this transaction applied
            if d.seq <= self.states[d.lane].last_seq:
                self.lanes.push_front([d])  # a duplicate only if its id is recorded: the next round
            elif d.seq == expected[d.lane]:
                self.lanes.push_front([d])
                expected[d.lane] += 1
            # else: behind another gap; it stays held

    # -- finish -----------------------------------------------------------------

    def finish(self) -> None:
        """Write what the rounds gathered: redeliveries, held rows applied, the keys' new positions."""
        self.ledger.write()


def _follows(d: Delivery, last: Delivery) -> bool:
    """Whether ``d`` continues the run that ends with ``last``: the next seq of its key, or the
    next arrival of a key without seqs."""
    if isinstance(d, OrderedDelivery) or isinstance(last, OrderedDelivery):
        return (isinstance(d, OrderedDelivery) and isinstance(last, OrderedDelivery)
                and d.seq == last.seq + 1)
    return isinstance(d, KeyedDelivery) and isinstance(last, KeyedDelivery)


class _Triage(enum.Enum):
    RUN = "run"
    """Next in its key (or unkeyed): claim it and run its handler."""
    DUPLICATE = "duplicate"
    """At or below its key's last seq with a recorded id (or expired): applied already."""
    BEHIND = "behind"
    """At or below its key's last seq, its id not looked up yet: settled in the next round."""
    SETTLED = "settled"
    """Held or parked without a claim."""
