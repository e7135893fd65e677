"""The inbox's stores on SQLite: plain SQL with ``ON CONFLICT`` and ``RETURNING``.

Also the reference for the other dialects: each statement here is the
simplest form of what ``_pg`` and ``_mysql`` do faster on their servers.
SQLite needs no row locks (``BEGIN IMMEDIATE`` already serialises writers), so
``lock`` only reads, creating the keys it does not find.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Row, and_, bindparam, func, or_, select
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from ...core._envelope import utcnow
from ...core._tables import OutboxTables
from .._delivery import Delivery, KeyId
from ._dedup import DedupTable
from ._held import HeldTable
from ._inserts import SQLITE_INSERTS
from ._keys import KeysTable, KeyState
from ._parked import ParkedTable
from ._storage import InboxStorage

RANGES_PER_STATEMENT = 200
"""Held-row ranges OR-ed in one statement: SQLite limits the depth of an expression."""


class SQLiteKeys(KeysTable):
    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, SQLITE_INSERTS)
        incarnation = tables.inbox_keys.c.incarnation
        self._advance = self._key_update(
            last_seq=bindparam("b_seq"),
            incarnation=func.coalesce(bindparam("b_incarnation", type_=incarnation.type), incarnation))

    def lock(self, session: Session, keys: Iterable[KeyId]) -> dict[KeyId, KeyState]:
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        states = self._select(session, wanted)
        missing = [key for key in wanted if key not in states]
        if missing:
            self._create(session, missing)
            states |= self._select(session, missing)
        return states

    def advance(self, session: Session, seqs: dict[KeyId, int],
                incarnations: Mapping[KeyId, str] | None = None) -> None:
        if not seqs:
            return
        incarnations = incarnations or {}
        session.execute(self._advance, [
            {"b_topic": t, "b_key": key, "b_seq": seq, "b_incarnation": incarnations.get((t, key))}
            for (t, key), seq in seqs.items()
        ])


class SQLiteDedup(DedupTable):
    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, SQLITE_INSERTS)

    def claim(self, session: Session, deliveries: Sequence[Delivery]) -> set[uuid.UUID]:
        if not deliveries:
            return set()
        m = self.t.inbox_messages
        now = utcnow()
        rows = [self.done_row(d, now) for d in deliveries]
        stmt = sqlite.insert(m).on_conflict_do_nothing().returning(m.c.message_id)
        return set(session.scalars(stmt, rows))


class SQLiteHeld(HeldTable):
    def __init__(self, tables: OutboxTables, group: str) -> None:
        super().__init__(tables, group, SQLITE_INSERTS)

    def _rows(self, session: Session, ranges: dict[KeyId, tuple[int, int]]) -> Sequence[Row[Any]]:
        h, wanted = self.t.inbox_held, list(ranges.items())
        rows: list[Row[Any]] = []
        for n in range(0, len(wanted), RANGES_PER_STATEMENT):  # an OR of ranges
            rows.extend(session.execute(select(h).where(
                h.c.consumer_group == self.group,
                or_(*[and_(h.c.topic == t, h.c.key == key, h.c.seq.between(first, last))
                      for (t, key), (first, last) in wanted[n:n + RANGES_PER_STATEMENT]]))))
        return rows


def sqlite_storage(tables: OutboxTables, group: str) -> InboxStorage:
    """The inbox's storage of ``group`` on SQLite."""
    return InboxStorage(group, SQLiteDedup(tables, group), SQLiteKeys(tables, group),
                        SQLiteHeld(tables, group), ParkedTable(tables, group, SQLITE_INSERTS))
