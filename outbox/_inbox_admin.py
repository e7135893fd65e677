"""Operator actions on parked keys: list, replay in order, discard one message.

These are for a person who fixed the cause of a failure (see
docs/runbook-parked-keys.md). Each replayed message runs in its own
transaction, exactly like a live one: dedup row, handler writes and the key's
``last_seq`` commit together. They may run while consumers are live: every
step locks the key's row first, and a live message of a parked key is parked
behind the replayed ones, so nothing overtakes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from ._envelope import utcnow
from ._errors import OutboxError
from ._inbox_apply import SKIPPED, Applier
from ._inbox_delivery import FOREIGN
from ._inbox_signals import SkipMessage
from ._inbox_store import GAP, delivery_from_row
from ._tables import DISCARDED


class NotParkedError(OutboxError, LookupError):
    """``discard`` named a message that is not in ``inbox_parked`` for this group."""


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """One row of ``inbox_parked``, as ``Inbox.parked()`` lists it."""

    message_id: uuid.UUID
    topic: str
    key: str | None
    seq: int | None
    reason: str
    error: str | None
    attempts: int
    first_failure_at: datetime
    last_failure_at: datetime
    partition: int | None
    offset: int | None


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What ``replay`` did: how many applied, how many still parked, and why it stopped."""

    applied: int
    remaining: int
    unparked: bool
    error: str | None = None


class ParkedAdmin:
    """Replays and discards for one group; safe to call from several threads."""

    def __init__(self, applier: Applier) -> None:
        self.applier = applier
        self.store = applier.store
        self.t = applier.store.t

    def parked(self, topic: str | None = None, key: str | None = None) -> list[ParkedMessage]:
        """Parked messages of the group (optionally one topic / key), oldest key first, in seq order."""
        p = self.t.inbox_parked
        stmt = select(p).where(p.c.consumer_group == self.store.group)
        if topic is not None:
            stmt = stmt.where(p.c.topic == topic)
        if key is not None:
            stmt = stmt.where(p.c.key == key)
        with self.applier.sessions() as session:
            rows = session.execute(stmt.order_by(p.c.topic, p.c.key, p.c.seq, p.c.id)).all()
        return [ParkedMessage(r.message_id, r.topic, r.key, r.seq, r.reason, r.error, r.attempts,
                              r.first_failure_at, r.last_failure_at, r.kafka_partition,
                              r.kafka_offset) for r in rows]

    def parked_key_count(self) -> int:
        k = self.t.inbox_keys
        with self.applier.sessions() as session:
            return session.scalar(select(func.count()).where(
                k.c.consumer_group == self.store.group, k.c.parked.is_(True))) or 0

    def replay(self, topic: str, key: str | None) -> ReplayResult:
        """Re-run the key's parked messages in seq order; unpark it when none is left.

        Stops at the first message that fails again (it stays parked, with its
        attempts and error updated) or at a hole in the seqs after the first
        message. The first message may be ahead of the key's ``last_seq`` (a
        key parked for a gap): replaying it accepts that the missing messages
        are gone, and they count as duplicates if they arrive later.
        ``key=None`` replays the topic's parked unkeyed messages, oldest first.
        Foreign records are never replayed: discard them.
        """
        applied = 0
        lane = (topic, key) if key is not None else None
        while True:
            with self.applier.sessions() as session, session.begin():
                state = self.store.lock_keys(session, [lane])[lane] if lane else None
                row = self._next_parked(session, topic, key)
                if row is None:
                    if lane and state:
                        self.store.unpark_key(session, lane, last_seq=state.last_seq)
                    return ReplayResult(applied, 0, unparked=True)
                d = delivery_from_row(row)
                seq = d.message.seq if state else None
                if seq is not None and seq <= state.last_seq:  # type: ignore[union-attr]
                    self._unpark_row(session, row.id)  # applied meanwhile: nothing to redo
                    continue
                if seq is not None and seq > state.last_seq + 1 and applied:  # type: ignore[union-attr]
                    return self._stopped(session, topic, key, applied,
                                         f"{GAP}: seq {state.last_seq + 1} to {seq - 1} missing")  # type: ignore[union-attr]
                if not self.store.claim(session, [d]):
                    self._unpark_row(session, row.id)  # its id was processed already
                    continue
                failure = self.applier.run_handler(session, d)
                if failure is None or isinstance(failure[0], SkipMessage):
                    if failure is not None:
                        self.store.mark(session, d, SKIPPED, str(failure[0]) or "skipped by handler")
                    self._unpark_row(session, row.id)
                    if lane and seq is not None:
                        self.store.set_last_seq(session, {lane: seq})
                    applied += 1
                    continue
                self.store.unclaim(session, [d.message.message_id])
                error = f"{type(failure[0]).__name__}: {failure[0]}"
                p = self.t.inbox_parked
                session.execute(update(p).where(p.c.id == row.id).values(
                    attempts=p.c.attempts + 1, error=error, traceback=failure[1],
                    last_failure_at=utcnow()))
                return self._stopped(session, topic, key, applied, error)

    def discard(self, message_id: uuid.UUID | str, *, by: str, reason: str) -> None:
        """Skip one parked message for good, keeping a record of who, why and when.

        The message is recorded in ``inbox_messages`` with ``outcome='discarded'``
        (so a redelivery is a duplicate) and leaves ``inbox_parked``. Its key
        moves past it; if nothing else of the key is parked, the key is unparked.
        """
        if not by or not by.strip() or not reason or not reason.strip():
            raise ValueError("discard needs who (by=) and why (reason=), both non-empty")
        mid = message_id if isinstance(message_id, uuid.UUID) else uuid.UUID(str(message_id))
        p = self.t.inbox_parked
        with self.applier.sessions() as session, session.begin():
            row = session.execute(select(p).where(p.c.consumer_group == self.store.group,
                                                  p.c.message_id == mid)).first()
            if row is None:
                raise NotParkedError(f"message {mid} is not parked in group {self.store.group!r}")
            d = delivery_from_row(row)
            lane = d.lane
            state = self.store.lock_keys(session, [lane])[lane] if lane and d.ordered else None
            note = f"discarded by {by.strip()} at {utcnow().isoformat()}: {reason.strip()}"
            self.store.mark(session, d, DISCARDED, note)
            self._unpark_row(session, row.id)
            if state is not None and lane is not None:
                last_seq = max(state.last_seq, d.message.seq or 0)
                if self._next_parked(session, *lane) is None:
                    self.store.unpark_key(session, lane, last_seq=last_seq)
                else:
                    self.store.set_last_seq(session, {lane: last_seq})

    def _next_parked(self, session: Session, topic: str, key: str | None):  # type: ignore[no-untyped-def]
        p = self.t.inbox_parked
        return session.execute(
            select(p).where(*self._of_key(topic, key)).order_by(p.c.seq, p.c.id).limit(1)
        ).first()

    def _of_key(self, topic: str, key: str | None) -> list[Any]:
        """Replayable parked rows of one key (or of the unkeyed messages when ``key`` is None)."""
        p = self.t.inbox_parked
        return [p.c.consumer_group == self.store.group, p.c.topic == topic,
                p.c.key.is_(None) if key is None else p.c.key == key, p.c.reason != FOREIGN]

    def _unpark_row(self, session: Session, row_id: int) -> None:
        p = self.t.inbox_parked
        session.execute(delete(p).where(p.c.id == row_id))

    def _stopped(self, session: Session, topic: str, key: str | None, applied: int,
                 error: str) -> ReplayResult:
        p = self.t.inbox_parked
        remaining = session.scalar(select(func.count()).select_from(p).where(
            *self._of_key(topic, key))) or 0
        return ReplayResult(applied, remaining, unparked=False, error=error)
