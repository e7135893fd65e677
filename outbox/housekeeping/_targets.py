"""What retention may delete, table by table: the settled rows older than a cutoff.

Only two tables hold rows that can settle for good:

- ``outbox_messages``: a row the broker acknowledged (``published``). Pending,
  failed and skipped rows stay: a pending or failed row is unfinished work, a
  skipped one is an operator's record that holds a key's history.
- ``inbox_messages``: a dedup record (processed, or discarded by an operator)
  whose message was created *and* processed before the cutoff. The inbox judges
  an unrecorded id at or below its key's position by the message's
  ``created_at`` (``Inbox(dedup_window=)``), so a record goes only when its
  message is older than the window by that same clock.

Nothing else is ever touched: ``outbox_keys`` (a key's next seq),
``inbox_keys`` (a key's position, parked flag, incarnation), ``inbox_held``
and ``inbox_parked`` keep every row, so a key's position survives the deletion
of its dedup rows and no waiting or parked message can vanish.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Column, ColumnElement, Table, or_

from ..core._tables import OutboxStatus as Status
from ..core._tables import OutboxTables


@dataclass(frozen=True)
class Target:
    """One table retention cleans: its primary key (the order batches walk) and its settled rows."""

    table: Table
    key: tuple[Column[object], ...]
    settled: Callable[[datetime], list[ColumnElement[bool]]]
    final: bool
    """Whether nothing writes or locks a settled row any more, so that a batch may delete without
    locking its rows first (``_pg_batches``): true of a published outbox row (the relay marks
    pending rows, an operator's actions select failed ones); an inbox counting a redelivery
    locks its dedup record."""

    newest_kept: Column[object] | None = None
    """A column whose greatest value's row is never deleted (``outbox_target``), or None."""

    @property
    def name(self) -> str:
        return self.table.name


def outbox_target(tables: OutboxTables) -> Target:
    """Published rows past the cutoff, but for the row of the greatest id (``newest_kept``).

    SQLite (whose id column has no AUTOINCREMENT) gives a new row one more than the greatest id
    left, and MySQL before 8.0 sets its counter so at each restart: deleting the greatest ids gave
    them again. An exactly-once shard's last progress record names rows by id (``relay._progress``),
    and a take-over marks the pending rows it names published without sending them: a new row of a
    reused id was marked and never sent. Kept, the greatest id is never given again. (PostgreSQL's
    sequences never give an id twice; its batches do not need it, ``_pg_batches``.)
    """
    m = tables.messages
    return Target(m, (m.c.id,), lambda cutoff: [m.c.status == Status.PUBLISHED, m.c.created_at < cutoff],
                  final=True, newest_kept=m.c.id)


def inbox_target(tables: OutboxTables, group: str | None = None) -> Target:
    """Dedup records of every group, or of ``group`` only (its own window)."""
    i = tables.inbox_messages
    of_group = [] if group is None else [i.c.consumer_group == group]
    return Target(i, (i.c.consumer_group, i.c.message_id), lambda cutoff: [
        *of_group, i.c.processed_at < cutoff, or_(i.c.created_at.is_(None), i.c.created_at < cutoff)],
        final=False)
