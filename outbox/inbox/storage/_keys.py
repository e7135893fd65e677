"""Key positions (``inbox_keys``): each key's last applied seq, start point, incarnation and parked flag.

Ordering rests on one rule: a transaction that reads or changes a key's state
first locks the key's ``inbox_keys`` row (``lock``: ``SELECT … FOR UPDATE`` on
PostgreSQL and MySQL/MariaDB; SQLite's ``BEGIN IMMEDIATE`` already serialises
writers), so two consumers that briefly both hold a partition during a
rebalance still apply a key's messages one at a time, in seq order.

``lock`` and ``advance`` are the per-batch statements, spelled per dialect
(``_sqlite``, ``_pg``, ``_mysql``); the rest is ``KeysTable``'s, shared.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Update, bindparam, func, select, tuple_, update
from sqlalchemy.orm import Session

from ...core._tables import OutboxTables
from .._delivery import KeyId
from ._inserts import GroupStore, Inserts

SELECT_AT_ONCE = 500
"""Keys whose states one statement reads (``KeysTable._select``): a batch's keys in one, a sweep's
many in several. (SQLite takes 32,766 parameters a statement; 500 keys are 1,001.)"""


@dataclass(slots=True)
class KeyState:
    last_seq: int
    parked: bool
    started_at_seq: int | None = None
    incarnation: str | None = None
    """The producer incarnation of the key's last applied message (None: not known)."""

    @property
    def untouched(self) -> bool:
        """Nothing of this key was applied yet, nor was a start point chosen."""
        return self.last_seq == 0 and self.started_at_seq is None


class KeyPositions(Protocol):
    """Where each key of one group stands; every method runs in the caller's transaction."""

    def lock(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        """Lock and read the state of ``keys``, creating missing ones at seq 0.

        Keys are locked in sorted order, so two transactions cannot deadlock on each other.
        """
        ...

    def states(self, session: Session, keys: Sequence[KeyId]) -> dict[KeyId, KeyState]:
        """Read (without locking) the state of those of ``keys`` that exist."""
        ...

    def advance(self, session: Session, seqs: dict[KeyId, int],
                incarnations: Mapping[KeyId, str] | None = None) -> None:
        """Move keys (locked by the caller) to ``seqs``, in one statement.

        A key in ``incarnations`` also records the producer incarnation its
        message came from; the others keep theirs.
        """
        ...

    def set_started(self, session: Session, starts: dict[KeyId, int]) -> None:
        """Record the seq at which keys started (start policy ``first_seen``)."""
        ...

    def mark_parked(self, session: Session, key: KeyId, note: str, at: datetime) -> None:
        """Mark ``key`` parked, saying why (``InboxStorage.park`` does, and nothing else)."""
        ...

    def unpark(self, session: Session, key: KeyId, *, last_seq: int) -> None:
        """Unpark ``key`` at ``last_seq`` (an operator's replay or discard)."""
        ...

    def parked_count(self, session: Session) -> int:
        """How many keys of the group are parked."""
        ...


class KeysTable(GroupStore, abc.ABC):
    """``KeyPositions`` on ``inbox_keys``: what every dialect shares; safe to share between threads."""

    def __init__(self, tables: OutboxTables, group: str, inserts: Inserts) -> None:
        super().__init__(tables, group, inserts)
        self._set_started = self._key_update(started_at_seq=bindparam("b_seq"))

    def _key_update(self, **values: Any) -> Update:
        """An UPDATE of one key of the group, named by ``b_topic`` and ``b_key``: one executemany a batch."""
        k = self.t.inbox_keys
        return update(k).where(k.c.consumer_group == self.group, k.c.topic == bindparam("b_topic"),
                               k.c.key == bindparam("b_key")).values(**values)

    @abc.abstractmethod
    def lock(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        """See ``KeyPositions.lock``."""

    @abc.abstractmethod
    def advance(self, session: Session, seqs: dict[KeyId, int],
                incarnations: Mapping[KeyId, str] | None = None) -> None:
        """See ``KeyPositions.advance``."""

    def states(self, session: Session, keys: Sequence[KeyId]) -> dict[KeyId, KeyState]:
        return self._select(session, keys) if keys else {}

    def _select(self, session: Session, keys: Sequence[KeyId]) -> dict[KeyId, KeyState]:
        """The states of ``keys``, ``SELECT_AT_ONCE`` keys a statement: a sweep may ask for every key
        whose gap is held, and one ``(topic, key) IN`` of 10,000 was more than PostgreSQL would parse
        ("stack depth limit exceeded": every sweep failed, no gap was parked)."""
        k = self.t.inbox_keys
        states = {}
        for start in range(0, len(keys), SELECT_AT_ONCE):
            stmt = (
                select(k.c.topic, k.c.key, k.c.last_seq, k.c.parked, k.c.started_at_seq, k.c.incarnation)
                .where(k.c.consumer_group == self.group,
                       tuple_(k.c.topic, k.c.key).in_(keys[start:start + SELECT_AT_ONCE]))
                .order_by(k.c.topic, k.c.key)
            )
            states.update({(r.topic, r.key): KeyState(r.last_seq, r.parked, r.started_at_seq, r.incarnation)
                           for r in session.execute(stmt)})
        return states

    def _create(self, session: Session, keys: Sequence[KeyId]) -> None:
        """Insert ``keys`` at seq 0, leaving those that exist as they are."""
        session.execute(self.inserts.new(self.t.inbox_keys), [
            {"consumer_group": self.group, "topic": t, "key": key, "last_seq": 0, "parked": False}
            for t, key in keys])

    def set_started(self, session: Session, starts: dict[KeyId, int]) -> None:
        if starts:
            session.execute(self._set_started, [
                {"b_topic": t, "b_key": key, "b_seq": seq} for (t, key), seq in starts.items()
            ])

    def mark_parked(self, session: Session, key: KeyId, note: str, at: datetime) -> None:
        k = self.t.inbox_keys
        session.execute(
            update(k)
            .where(k.c.consumer_group == self.group, k.c.topic == key[0], k.c.key == key[1])
            .values(parked=True, parked_reason=note[:2000], parked_at=at)
        )

    def unpark(self, session: Session, key: KeyId, *, last_seq: int) -> None:
        k = self.t.inbox_keys
        session.execute(
            update(k)
            .where(k.c.consumer_group == self.group, k.c.topic == key[0], k.c.key == key[1])
            .values(parked=False, parked_reason=None, parked_at=None, last_seq=last_seq)
        )

    def parked_count(self, session: Session) -> int:
        k = self.t.inbox_keys
        return session.scalar(select(func.count()).where(
            k.c.consumer_group == self.group, k.c.parked.is_(True))) or 0
