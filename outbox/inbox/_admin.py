"""Operator actions on parked keys: list, replay in order, discard one message.

These are for a person who fixed the cause of a failure (see
docs/runbook-parked-keys.md). A replay takes a key's parked messages
``replay_batch`` at a time, one transaction per batch, through the live path's
phases: dedup rows, handler writes and the key's ``last_seq`` commit together,
and a failure rolls back only its own message (its SAVEPOINT), so the messages
before it commit. They may run while consumers are live: every
step locks the key's row first, and a live message of a parked key is parked
behind the replayed ones, so nothing overtakes.

Nothing vanishes here: a parked message leaves ``inbox_parked`` only when it
was applied, was recorded as skipped, was already recorded in
``inbox_messages``, or was discarded with a record of who, when and why.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from ..core._envelope import utcnow
from ..core._errors import OutboxError
from ..core._tables import InboxOutcome
from ._calls import Error, Redo
from ._conflicts import rebuilt
from ._delivery import KeyedDelivery, KeyId, OrderedDelivery
from ._kinds import Reason
from ._sessions import Sessions
from ._transaction import TransactionStep
from .storage import InboxStorage, KeyState, ParkedRow


class NotParkedError(OutboxError, LookupError):
    """``discard`` named a message, or ``replay`` a key, with nothing in ``inbox_parked`` for this group."""


class DiscardRefusedError(OutboxError, ValueError):
    """``discard`` named a message with earlier messages of its key still parked.

    Skipping it would move the key past those earlier messages, so they could
    never be applied: replay or discard them first.
    """


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """One row of ``inbox_parked``, as ``Inbox.parked()`` lists it."""

    message_id: uuid.UUID
    topic: str
    key: str | None
    seq: int | None
    reason: Reason
    error: str | None
    attempts: int
    first_failure_at: datetime
    last_failure_at: datetime
    partition: int | None
    offset: int | None


@dataclass(frozen=True, slots=True)
class ParkedReplay:
    """What ``replay`` did: how many applied, how many still parked, and why it stopped."""

    applied: int
    remaining: int
    unparked: bool
    error: str | None = None


class ParkedAdmin:
    """Replays and discards for one group; safe to call from several threads.

    Each public method runs as a whole through ``Sessions.run`` (on an async
    inbox, on its event loop).
    """

    replay_batch = 500
    """Parked messages of a key a replay takes per transaction."""

    def __init__(self, sessions: Sessions, storage: InboxStorage, step: TransactionStep) -> None:
        self.sessions = sessions
        self.storage = storage
        self.step = step

    def parked(self, topic: str | None = None, key: str | None = None) -> list[ParkedMessage]:
        """Parked messages of the group (optionally one topic / key), per key in seq order."""
        return self.sessions.run(self._parked, topic, key)

    def _parked(self, topic: str | None, key: str | None) -> list[ParkedMessage]:
        with self.sessions() as session:
            rows = self.storage.parked.rows(session, topic, key)
        return [_listed(r) for r in rows]

    def parked_key_count(self) -> int:
        return self.sessions.run(self._parked_key_count)

    def _parked_key_count(self) -> int:
        with self.sessions() as session:
            return self.storage.keys.parked_count(session)

    def replay(self, topic: str, key: str | None) -> ParkedReplay:
        """Re-run the key's parked messages in seq order (a key without seqs: in the order they
        arrived; a key with both, ours and another producer's: in the order they arrived, ours
        in seq order among them); unpark it when none is left.

        Stops at the first message that fails again (it stays parked, with its
        attempts and error updated) or at a hole in the seqs after the first
        message. A message parked as a conflict (``new_incarnation``,
        ``seq_conflict``) starts its key again at its seq, recorded as
        ``started_at_seq``: the operator's decision to apply the rebuilt
        producer's messages. The first message may be ahead of the key's ``last_seq`` (a
        key parked for a gap): replaying it accepts that the missing messages
        are gone, and they count as duplicates if they arrive later.
        ``key=None`` replays the topic's parked unkeyed messages, oldest first.
        Foreign records are never replayed: discard them. Raises
        ``NotParkedError`` when nothing of the key is parked (a typo, or replayed
        meanwhile), before writing anything: a key row made up for a key never
        seen would set its start for good.
        """
        return self.sessions.run(self._replay, topic, key)

    def _replay(self, topic: str, key: str | None) -> ParkedReplay:
        lane = (topic, key) if key is not None else None
        storage = self.storage
        with self.sessions() as session:
            state = storage.keys.states(session, [lane]).get(lane) if lane else None
            if not (state and state.parked) and not storage.parked.rows(session, topic, key, replayable=True,
                                                                         limit=1):
                name = f"key {key!r}" if key is not None else "unkeyed message"
                raise NotParkedError(f"no {name} of topic {topic!r} is parked in group {storage.group!r}")
        applied = 0
        while True:
            with self.sessions() as session, session.begin():
                states = storage.keys.lock(session, [lane]) if lane else {}
                # One row more than the batch: whether anything is left after it. Nobody parks
                # a row of the key while its lock is held, and the batch unparks every row it
                # replays unless it stops, so the batch's last transaction unparks the key.
                rows = storage.parked.replay_page(session, topic, key, self.replay_batch + 1)
                if not rows:
                    return self._replayed_all(session, lane, states, applied)
                batch = _Batch(applied)
                stopped = self._replay_batch(session, states, rows[:self.replay_batch], batch)
                applied = batch.applied
                if stopped is not None:
                    return self._stopped(session, topic, key, applied, stopped)
                if len(rows) <= self.replay_batch:
                    return self._replayed_all(session, lane, states, applied)

    def _replayed_all(self, session: Session, lane: KeyId | None, states: dict[KeyId, KeyState],
                      applied: int) -> ParkedReplay:
        if lane:
            self.storage.keys.unpark(session, lane, last_seq=states[lane].last_seq)
        return ParkedReplay(applied, 0, unparked=True)

    def _replay_batch(self, session: Session, states: dict[KeyId, KeyState], rows: list[ParkedRow],
                      batch: _Batch) -> str | None:
        """Replay ``rows`` (a key's next parked messages, in order) in the caller's transaction.

        The leading rows that need none of replay's own rules (each the next
        seq of its key, or the replay's very first message) run as one run
        through the phases, handlers called bare inside a SAVEPOINT; a run
        that meets a failure or a recorded id is rolled back and its rows
        replayed one at a time (``_replay_one``), which applies the rules and
        stops where the one-message-per-transaction replay would. Returns why
        the replay stopped, if it did; ``batch.applied`` counts what applied.
        """
        known: dict[uuid.UUID, Error] = {}
        one_by_one = False  # after a run rolled back: the rest of the batch goes one at a time
        n = 0
        while n < len(rows):
            run = [] if one_by_one else self._clean_run(rows[n:], states, first=not batch.applied)
            if len(run) > 1:
                redo = self._replay_run(session, states, run)
                if redo is None:
                    batch.applied += len(run)
                    n += len(run)
                    continue
                one_by_one = True
                if redo.delivery is not None:
                    known[redo.delivery.message.message_id] = redo.error  # not run a second time
            done = self._replay_one(session, states, rows[n], first=not batch.applied, known=known)
            if isinstance(done, str):
                return done
            if done is _Replayed.APPLIED:
                batch.applied += 1
            n += 1
        return None

    def _clean_run(self, rows: list[ParkedRow], states: dict[KeyId, KeyState], *,
                   first: bool) -> list[ParkedRow]:
        """The leading ``rows`` that follow their key's position one seq after another.

        None of them is at or below its key's last seq (replay's restart and
        recorded rules), nor after a hole (replay's stop), nor unreadable: a
        run of them is what the live path applies as one run.
        """
        run: list[ParkedRow] = []
        seen: set[uuid.UUID] = set()
        for row in rows:
            d = row.delivery
            if d.unreadable is not None or d.message.message_id in seen:
                break
            if isinstance(d, OrderedDelivery):
                state = states.get(d.lane)
                if state is None:
                    break
                expected = run[-1].delivery.message.seq if run else state.last_seq
                if not isinstance(expected, int) or d.seq <= state.last_seq:
                    break
                if d.seq != expected + 1 and (run or not first):
                    break
            elif run and isinstance(run[-1].delivery, OrderedDelivery):
                break
            seen.add(d.message.message_id)
            run.append(row)
        return run

    def _replay_run(self, session: Session, states: dict[KeyId, KeyState],
                    run: list[ParkedRow]) -> Redo | None:
        """Apply ``run`` as one run of the phases, in a SAVEPOINT; the ``Redo`` if it was rolled back.

        A recorded id in the run (claim cut it) or a handler that failed
        rolls the whole run back: the caller replays it one message at a time.
        """
        deliveries = [row.delivery for row in run]
        before = {lane: (s.last_seq, s.incarnation) for lane, s in states.items()}
        nested = session.begin_nested()
        try:
            tx = self.step.batch_transaction(session, states)
            fresh = tx.claim([deliveries])
            if fresh != [deliveries]:
                raise Redo(None, (LookupError("a replayed id was recorded meanwhile"), ""))
            tx.advance(tx.run(fresh))
            tx.finish()
            self.storage.parked.remove_run(session, [row.id for row in run])
        except Redo as redo:
            nested.rollback()
            for lane, (last_seq, incarnation) in before.items():
                states[lane].last_seq, states[lane].incarnation = last_seq, incarnation
            return redo
        nested.commit()
        return None

    def _replay_one(self, session: Session, states: dict[KeyId, KeyState], row: ParkedRow, *,
                    first: bool, known: dict[uuid.UUID, Error] | None = None) -> _Replayed | str:
        """Replay one parked message through the transaction's phases; why it stopped, if it did.

        The rules an operator's replay adds are here: a message at or below
        its key's last seq starts the key again when a rebuilt producer or a
        seq conflict parked it, and after the first message a hole in the seqs
        stops the replay. Claim, handler and advance are the live path's
        (``_transaction``).
        """
        storage, d = self.storage, row.delivery
        tx = self.step.transaction(session, states, known)
        state = states.get(d.lane) if isinstance(d, OrderedDelivery) else None
        if isinstance(d, OrderedDelivery) and state is not None:
            if d.seq <= state.last_seq:
                if storage.dedup.is_recorded(session, d.message.message_id):
                    storage.parked.remove(session, row.id)  # applied meanwhile: nothing to redo
                    return _Replayed.ALREADY
                if not (row.reason.restarts_on_replay
                        or rebuilt(state.incarnation, d.message.incarnation)):
                    return (f"seq {d.seq} is at or below the key's last seq {state.last_seq} "
                            "but was never applied: discard it")
                # A rebuilt producer or a seq conflict: the operator's replay starts the key
                # again here, as first_seen would have.
                tx.restart(d)
            elif d.seq > state.last_seq + 1 and not first:
                return f"{Reason.GAP}: seq {state.last_seq + 1} to {d.seq - 1} missing"
        fresh = tx.claim([[d]])
        if not fresh:
            storage.parked.remove(session, row.id)  # its id was processed already
            return _Replayed.ALREADY
        tx.advance(tx.run(fresh))
        tx.finish()
        if not tx.committed.failed:
            storage.parked.remove(session, row.id)
            return _Replayed.APPLIED
        failure = tx.committed.failed[0]
        error = f"{type(failure.error).__name__}: {failure.error}"
        storage.parked.failed_again(session, row.id, error, failure.traceback)
        return error

    def discard(self, message_id: uuid.UUID | str, *, by: str, reason: str) -> None:
        """Skip one parked message for good, keeping a record of who, why and when.

        The message is recorded in ``inbox_messages`` with ``outcome='discarded'``
        (so a redelivery is a duplicate) and leaves ``inbox_parked``. Its key
        moves past it; if nothing else of the key is parked, the key is unparked.
        Refused (``DiscardRefusedError``) while an earlier message of the key is
        parked: moving the key past that one would lose it.
        """
        if not by or not by.strip() or not reason or not reason.strip():
            raise ValueError("discard needs who (by=) and why (reason=), both non-empty")
        mid = message_id if isinstance(message_id, uuid.UUID) else uuid.UUID(str(message_id))
        self.sessions.run(self._discard, mid, by, reason)

    def _discard(self, mid: uuid.UUID, by: str, reason: str) -> None:
        storage = self.storage
        with self.sessions() as session, session.begin():
            row = storage.parked.by_id(session, mid)
            if row is None:
                raise NotParkedError(f"message {mid} is not parked in group {storage.group!r}")
            d = row.delivery
            lane = d.lane if isinstance(d, KeyedDelivery) else None
            state = storage.keys.lock(session, [lane])[lane] if lane else None
            if isinstance(d, OrderedDelivery) and state is not None:
                earlier = storage.parked.count_before(session, d.lane, d.seq)
                if earlier:
                    raise DiscardRefusedError(
                        f"message {mid} is seq {d.seq} of {d.lane[0]}/{d.lane[1]}, and {earlier} "
                        f"earlier message(s) of that key are parked: replay or discard them first, "
                        f"or the key would move past them")
            note = f"discarded by {by.strip()} at {utcnow().isoformat()}: {reason.strip()}"
            storage.dedup.mark(session, d, InboxOutcome.DISCARDED, note)
            storage.parked.remove(session, row.id)
            if lane and state is not None:
                last_seq = max(state.last_seq, d.message.seq or 0)
                if not storage.parked.rows(session, *lane, replayable=True, limit=1):
                    storage.keys.unpark(session, lane, last_seq=last_seq)
                else:
                    storage.keys.advance(session, {lane: last_seq})

    def _stopped(self, session: Session, topic: str, key: str | None, applied: int,
                 error: str) -> ParkedReplay:
        remaining = self.storage.parked.replayable_count(session, topic, key)
        return ParkedReplay(applied, remaining, unparked=False, error=error)


@dataclass(slots=True)
class _Batch:
    """What one replay transaction applied so far, counted from the replay's start."""

    applied: int


class _Replayed(enum.Enum):
    APPLIED = "applied"
    """Its handler ran (or skipped it) and the key advanced."""
    ALREADY = "already"
    """Its id was recorded meanwhile: unparked, nothing to redo."""


def _listed(r: ParkedRow) -> ParkedMessage:
    d = r.delivery
    return ParkedMessage(d.message.message_id, d.message.topic, d.message.key, d.message.seq,
                         r.reason, r.error, r.attempts, r.first_failure_at, r.last_failure_at,
                         d.partition, d.offset)

