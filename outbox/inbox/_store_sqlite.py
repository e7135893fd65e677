"""The inbox's per-dialect statements on SQLite: plain SQL with ``ON CONFLICT`` and ``RETURNING``.

Also the reference for the other stores: each statement here is the simplest
form of what ``_store_pg`` and ``_store_mysql`` do faster on their servers.
SQLite needs no row locks (``BEGIN IMMEDIATE`` already serialises writers), so
``lock_keys`` only reads, creating the keys it does not find.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Row, Table, and_, bindparam, func, or_, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from .._envelope import utcnow
from .._tables import OutboxTables
from ._delivery import Delivery, KeyId
from ._store import KeyState, OnConflictStore

RANGES_PER_STATEMENT = 200
"""Held-row ranges OR-ed in one statement: SQLite limits the depth of an expression."""


class SQLiteStore(OnConflictStore):
    """Statements for one group on SQLite; safe to share between threads."""

    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group)
        k = tables.inbox_keys
        self._set_last_seq = (
            update(k)
            .where(k.c.consumer_group == group, k.c.topic == bindparam("b_topic"),
                   k.c.key == bindparam("b_key"))
            .values(last_seq=bindparam("b_seq"),
                    incarnation=func.coalesce(bindparam("b_incarnation", type_=k.c.incarnation.type),
                                              k.c.incarnation))
        )

    def _insert(self, table: Table) -> sqlite.Insert:
        return sqlite.insert(table)

    def lock_keys(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        states = self._select_keys(session, wanted)
        missing = [key for key in wanted if key not in states]
        if missing:
            k = self.t.inbox_keys
            session.execute(
                self._insert_new(k),
                [{"consumer_group": self.group, "topic": t, "key": key, "last_seq": 0,
                  "parked": False} for t, key in missing],
            )
            states |= self._select_keys(session, missing)
        return states

    def set_last_seq(self, session: Session, seqs: dict[KeyId, int],
                     incarnations: Mapping[KeyId, str] | None = None) -> None:
        if not seqs:
            return
        incarnations = incarnations or {}
        session.execute(self._set_last_seq, [
            {"b_topic": t, "b_key": key, "b_seq": seq, "b_incarnation": incarnations.get((t, key))}
            for (t, key), seq in seqs.items()
        ])

    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        if not deliveries:
            return set()
        m = self.t.inbox_messages
        now = utcnow()
        rows = [self._done_row(d, now) for d in deliveries]
        stmt = self._insert(m).on_conflict_do_nothing().returning(m.c.message_id)
        return set(session.scalars(stmt, rows))

    def _held_rows(self, session: Session, ranges: dict[KeyId, tuple[int, int]]) -> Sequence[Row[Any]]:
        h, wanted = self.t.inbox_held, list(ranges.items())
        rows: list[Row[Any]] = []
        for n in range(0, len(wanted), RANGES_PER_STATEMENT):  # an OR of ranges
            rows.extend(session.execute(select(h).where(
                h.c.consumer_group == self.group,
                or_(*[and_(h.c.topic == t, h.c.key == key, h.c.seq.between(first, last))
                      for (t, key), (first, last) in wanted[n:n + RANGES_PER_STATEMENT]]))))
        return rows

