"""The relay's SQL every dialect shares: the due-rows query, the fenced bulk updates' shape, the marks.

One fetch and at most three bulk updates per batch. Every update is fenced:
it touches a row only while the row is still pending and the row's shard
lease still names this relay with the epoch it fetched under. A relay that
lost a lease (paused, partitioned, too slow) therefore changes nothing; what
it sent becomes a duplicate, which at-least-once allows.

``RelayStatements`` builds the statements of one ``OutboxTables``; what a
dialect spells its own way — the probe of an earlier row that holds a key
back, how the message id is read, the fetch over several shards, the bulk
update, what runs before a fetch — is one subclass per dialect in ``_sql``,
chosen once by ``_sql.statements_for``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    DateTime,
    Exists,
    FromClause,
    Integer,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    or_,
    select,
)

from ..core._engine import EACH_RUN
from ..core._tables import OutboxStatus, OutboxTables

ROW_COLUMNS = (
    "id", "message_id", "topic", "key", "seq", "shard", "payload", "content_type", "headers",
    "created_at", "available_at", "attempts", "event_type",
)

MESSAGES_AT_ONCE = 500
"""Ids a statement of ``RelayStatements.messages`` asks for: a bound parameter each, well within every
driver's limit (SQLite's 999 before 3.32)."""

ROW_OCTETS = len(ROW_COLUMNS)
"""Where a fetched row carries, after ``ROW_COLUMNS``, the bytes of payload and headers of its
batch up to and including it (``RelayStatements.fetch``)."""


@dataclass(slots=True)
class Marks:
    """Per-row values of one bulk update, as parallel lists (ids[i] goes with epochs[i] …)."""

    ids: list[int]
    shards: list[int]
    epochs: list[int]
    values: dict[str, list[Any]]


class RelayStatements(abc.ABC):
    """Statements for one ``OutboxTables`` on one dialect (``_sql.statements_for`` shares them)."""

    pipelines = False
    """A batch's outcomes may be written on a helper thread while the next batch is fetched and
    sent (``BatchRunner.run(wait=False)``): the fetch then leaves out the rows being written."""
    ids_need_checking = False
    """A fetched message id may be text that is no UUID (MySQL/MariaDB's CHAR(32)): the encoder
    checks each (``_rows.RowEncoder``)."""

    def __init__(self, tables: OutboxTables) -> None:
        m, leases = tables.messages, tables.leases
        self._m, self._leases = m, leases
        now = bindparam("now", type_=m.c.available_at.type)
        prior = m.alias("prior")
        # An earlier row of the key that must go first and cannot go now: the key waits.
        blocks_now = or_(prior.c.status == OutboxStatus.FAILED,
                         and_(prior.c.status == OutboxStatus.PENDING, prior.c.available_at > now))
        same_key_before = (prior.c.topic == m.c.topic, prior.c.key == m.c.key, prior.c.seq < m.c.seq)
        key_waits = self._key_waits(tables, prior, (*same_key_before, blocks_now))
        # Due: asked for no delay and never pushed back (both timestamps were written by
        # one host in one statement, so no clock is compared with another), or the time
        # has come. A row that is not due therefore has available_at > created_at and is
        # in ix_outbox_key_waits, where key_waits finds it: whatever the clocks of
        # publishers and relays, a row is fetched only together with (or after) every
        # earlier unpublished row of its key. See "Clocks" in docs/relay.md.
        due = or_(m.c.available_at <= m.c.created_at, m.c.available_at <= now)
        columns = [self._column(m, name) for name in ROW_COLUMNS]
        self._columns = columns
        self._due = select(*columns).where(
            m.c.status == OutboxStatus.PENDING, due, or_(m.c.key.is_(None), ~key_waits),
        )
        self._fetch_by_shards: dict[tuple[tuple[int, ...], bool], Select[Any]] = {}
        self._marks: dict[str, Any] = {}  # bulk update kind -> its statement (``_mark_statement``)
        self._next_delayed = select(func.min(m.c.available_at)).where(
            m.c.status != OutboxStatus.PUBLISHED,
            or_(m.c.status == OutboxStatus.FAILED, m.c.available_at > m.c.created_at),
            m.c.status == OutboxStatus.PENDING, self._of_shards(m),
            m.c.available_at > bindparam("since", type_=m.c.available_at.type)).execution_options(**EACH_RUN)
        later = m.c.available_at > bindparam("since", type_=m.c.available_at.type)
        self._look_ahead = select(func.min(case((later, m.c.available_at))),
                                  func.count(case((m.c.attempts > 0, 1)))).where(
            m.c.status != OutboxStatus.PUBLISHED,
            or_(m.c.status == OutboxStatus.FAILED, m.c.available_at > m.c.created_at),
            m.c.status == OutboxStatus.PENDING, self._of_shards(m),
        ).execution_options(**EACH_RUN)
        # The look-ahead, and whether any row of the shards is due (the fetch's rows, unread).
        self._probe = self._look_ahead.add_columns(
            self._due.where(self._of_shards(m)).correlate(None).exists().label("due"))

    def _key_waits(self, tables: OutboxTables, prior: FromClause,
                   conditions: tuple[ColumnElement[bool], ...]) -> Exists:
        """An earlier row of the key meets ``conditions``: the probe of ix_outbox_key_waits.

        Its first two conditions repeat the index's predicate (only failed,
        delayed or retried rows), so the probe reads that tiny index.
        """
        return exists().where(
            prior.c.status != OutboxStatus.PUBLISHED,
            or_(prior.c.status == OutboxStatus.FAILED, prior.c.available_at > prior.c.created_at),
            *conditions)

    def _of_shards(self, m: Table) -> ColumnElement[bool]:
        """The row is of one of the shards in parameter ``shards`` (a list of ints)."""
        return m.c.shard.in_(bindparam("shards", expanding=True))

    def _column(self, m: Table, name: str) -> Any:
        """How the fetch reads column ``name``.

        Headers come as JSON text and are decoded only when not empty (most
        are): decoding "{}" 5,000 times a batch is measurable.
        """
        return cast(m.c[name], Text).label(name) if name == "headers" else m.c[name]

    # -- the fetch ----------------------------------------------------------

    def fetch(self, shards: Iterable[int], *, backlog: bool = False) -> Select[Any]:
        """Due rows of ``shards`` in id order, ``limit`` of them at most and no more bytes than
        ``max_bytes`` and one row; its parameters are ``fetch_params``'.

        ``backlog``: the last fetch was full, so more rows are due than a batch
        takes; a dialect may then read them another way (PostgreSQL). Either
        statement returns the same rows.

        The bytes: a row comes only if the payload and headers of the rows
        before it hold fewer than ``max_bytes`` (so the first row always
        comes, however large), and each carries the running total at
        ``ROW_OCTETS``, so the relay can tell a fetch cut short by its bytes
        (more are due) from one that found all there was. Without it a batch's
        memory was its rows times their size: 5,000 rows of a megabyte, five
        gigabytes, twice (rows and records). The database counts them, in the
        statement, so what it leaves out never crosses the wire.
        """
        key = (tuple(sorted(shards)), backlog)
        found = self._fetch_by_shards.get(key)
        if found is not None:
            return found
        found = self._sized(self._fetch_of(key[0], backlog=backlog))
        if len(self._fetch_by_shards) > 64:
            self._fetch_by_shards.clear()
        self._fetch_by_shards[key] = found
        return found

    def _sized(self, fetch: Select[Any]) -> Select[Any]:
        """``fetch``'s rows while the bytes before each are under ``max_bytes``, with their running
        total (``fetch`` says why); a running sum over at most ``limit`` rows in the order they
        come, so no index or sort changes."""
        batch = fetch.subquery("batch")
        own = self._octets(batch.c.payload) + func.coalesce(self._octets(batch.c.headers), 0)
        upto = func.sum(own).over(order_by=batch.c.id)
        sized = select(*batch.c, upto.label("octets"), own.label("own")).subquery("sized")
        before = sized.c.octets - sized.c.own
        return (select(*(sized.c[name] for name in ROW_COLUMNS), sized.c.octets)
                .where(before < bindparam("max_bytes", type_=BigInteger())).order_by(sized.c.id)
                .execution_options(**fetch.get_execution_options()))

    def _octets(self, column: Any) -> Any:
        """The bytes of a fetched column's value (text in the database's encoding, UTF-8)."""
        return func.octet_length(column)

    def _fetch_of(self, shards: tuple[int, ...], *, backlog: bool) -> Select[Any]:
        """One filtered scan of the pending rows of ``shards``, in id order."""
        m, limit = self._m, bindparam("limit", type_=Integer())
        return self._due.where(m.c.shard.in_(shards)).order_by(m.c.id).limit(limit)

    def prepare_fetch(self, conn: Connection) -> Connection:
        """The fetch's connection made ready for it (``conn`` as it is but on PostgreSQL)."""
        return conn

    def end_if_idle(self, conn: Connection, seconds: float) -> None:
        """Have the database end this transaction if the relay leaves it idle for ``seconds``.

        A mark's rows stay locked until its COMMIT: a relay frozen between the two
        (SIGSTOP, a VM or GC stall) past its lease would hold the relay that takes
        its shards, which marks the same rows (the rows a committed transaction
        carried, or the rows it sent again). Only PostgreSQL can bound the idle
        time of one transaction (``idle_in_transaction_session_timeout``); elsewhere
        nothing is done, and the taker waits until the frozen relay resumes or dies.
        """
        return None

    def fetch_params(self, now: datetime, limit: int, busy: Sequence[int], max_bytes: int) -> dict[str, Any]:
        """``fetch``'s parameters: rows due at ``now``, ``limit`` of them and ``max_bytes`` (and one
        row), none of ``busy``.

        ``busy`` holds the ids whose outcome is being written (empty unless
        ``pipelines``); a dialect whose statement cannot leave them out asks
        for more rows and drops them after (``without_busy``).
        """
        return {"now": now, "limit": limit, "max_bytes": max_bytes}

    def without_busy(self, rows: Sequence[Any], busy: Sequence[int], limit: int) -> Sequence[Any]:
        """The fetched ``rows`` that are not ``busy``, ``limit`` at most (the statement left them out)."""
        return rows

    def next_delayed(self) -> Select[Any]:
        """The earliest ``available_at`` after ``since`` of the delayed or retried pending rows of ``shards``.

        Its parameters are ``since`` (a datetime) and ``shards`` (a list); it
        is NULL when there is no such row. What a relay that polls rarely must wake for
        (``RelayStep.poll_within``): no notification comes when such a row comes
        due. A row due by ``since`` and still pending waits for an earlier row of
        its key, which no poll changes. Its condition repeats ix_outbox_key_waits'
        predicate, so it reads that tiny index.
        """
        return self._next_delayed

    def look_ahead(self) -> Select[Any, int]:
        """``next_delayed``'s answer, and how many pending rows of ``shards`` are being retried.

        Same parameters and the same tiny index: its rows are the delayed or
        retried pending rows of ``shards``, the retried ones (``attempts > 0``)
        a superset of what the stuck-key check (``retrying_heads``) reads. None
        retried: that check has nothing to find (``RelayStep._look_ahead``).
        """
        return self._look_ahead

    def probe(self) -> Select[Any]:
        """``look_ahead``'s answer and whether any row of ``shards`` is due now (``now``): a poll
        that finds none fetches nothing (``RelayStep.run(probe=True)``)."""
        return self._probe

    # -- rows the fetch cannot read (``_unreadable``) ---------------------------

    def due_ids(self, shards: Iterable[int]) -> Select[Any]:
        """The ids and shards of what ``fetch`` returns (same params): integers always read."""
        due = self.fetch(shards).subquery("due_rows")
        return select(due.c.id, due.c.shard).order_by(due.c.id)

    def row(self) -> Select[Any]:
        """One row by ``id``, with ``fetch``'s columns."""
        return select(*self._columns).where(self._m.c.id == bindparam("id"))

    def row_field(self, name: str) -> Select[Any]:
        """One column of one row by ``id``, as text where the fetch reads it so."""
        column = self._columns[ROW_COLUMNS.index(name)]
        return select(column).where(self._m.c.id == bindparam("id"))

    # -- bulk, fenced updates ----------------------------------------------

    def mark(self, conn: Connection, owner: str, marks: Marks, kind: str, *,
             now: datetime | None = None) -> int:
        """Apply the bulk update ``kind`` (``MARK_KINDS``) to the fenced rows of ``marks``.

        Returns how many rows changed; rows whose lease moved on are left alone.
        ``now``: the published time (kind "published").
        """
        if not marks.ids:
            return 0
        return self._mark(conn, marks, self._mark_statement(kind),
                          {"owner": owner, "mark_now": now}, MARK_KINDS[kind].per_row)

    def _mark_statement(self, kind: str) -> Any:
        """The statement of bulk update ``kind``, built once per kind and kept.

        Built per batch, its SQLAlchemy construction and cache key cost more CPU
        than anything else in writing a small batch's outcomes (about 0.9 ms of
        the writer's 1.4 ms of CPU for 3 rows): at 1,000 msg/s a relay
        writes a few hundred batches a second. What varies (the owner, the
        published time, the rows) is bound, so one statement serves every relay
        sharing these statements (``_sql.statements_for``), from any thread.
        """
        found = self._marks.get(kind)
        if found is None:
            shape = MARK_KINDS[kind]
            m = self._m
            set_ = {name: _mark_value(m, value) for name, value in shape.set_.items()}
            found = self._marks[kind] = self._build_mark(set_, shape.per_row).execution_options(**EACH_RUN)
        return found

    @abc.abstractmethod
    def _build_mark(self, set_: dict[str, Any], per_row: dict[str, Any]) -> Any:
        """The fenced bulk update setting ``set_`` and ``per_row`` (column -> type); the owner is
        ``bindparam("owner")``, and ``set_`` may name ``bindparam("mark_now")``."""

    @abc.abstractmethod
    def _mark(self, conn: Connection, marks: Marks, stmt: Any, params: dict[str, Any],
              per_row: dict[str, Any]) -> int:
        """Run ``stmt`` (``_build_mark``'s) over at least one row, with ``params`` (owner, now)."""

    def published(self, conn: Connection, owner: str, marks: Marks, now: datetime) -> int:
        return self.mark(conn, owner, marks, "published", now=now)

    def holds(self, conn: Connection, owner: str, shard: int, epoch: int) -> bool:
        """``owner`` still holds ``shard``'s lease of ``epoch``. Asked after a mark, in its
        transaction: epochs only grow, so a lease held then was held when the mark ran."""
        leases = self._leases
        found = conn.execute(select(leases.c.epoch).where(
            leases.c.shard == shard, leases.c.owner == owner)).scalar()
        return found == epoch

    def messages(self, conn: Connection, ids: Sequence[int]) -> dict[int, Any]:
        """The message id of each row of ``ids`` there is, read as the fetch reads it (``_column``),
        ``MESSAGES_AT_ONCE`` ids a statement."""
        m = self._m
        found: dict[int, Any] = {}
        for start in range(0, len(ids), MESSAGES_AT_ONCE):
            chunk = list(ids[start:start + MESSAGES_AT_ONCE])
            found.update((row, message) for row, message in conn.execute(
                select(m.c.id, self._column(m, "message_id")).where(m.c.id.in_(chunk))))
        return found

    def retried(self, conn: Connection, owner: str, marks: Marks) -> int:
        return self.mark(conn, owner, marks, "retried")

    def postponed(self, conn: Connection, owner: str, marks: Marks) -> int:
        """Like ``retried`` without counting an attempt: the broker was unreachable (an outage)."""
        return self.mark(conn, owner, marks, "postponed")

    def failed(self, conn: Connection, owner: str, marks: Marks) -> int:
        return self.mark(conn, owner, marks, "failed")


@dataclass(frozen=True)
class MarkKind:
    """What one kind of bulk update sets: ``set_`` the same for every row (a status, ``NOW`` for the
    published time, ``ATTEMPT`` for one more attempt), ``per_row`` one value per row (column -> type)."""

    set_: dict[str, Any]
    per_row: dict[str, Any]


class _Value:
    """A value of ``MarkKind.set_`` made of the statement, not a constant."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NOW = _Value("NOW")
"""In ``MarkKind.set_``: the published time, bound per statement (``mark(..., now=)``)."""
ATTEMPT = _Value("ATTEMPT")
"""In ``MarkKind.set_``: the row's attempts plus one."""

MARK_KINDS = {
    "published": MarkKind({"status": OutboxStatus.PUBLISHED, "published_at": NOW, "attempts": ATTEMPT},
                          {"kafka_partition": Integer(), "kafka_offset": BigInteger()}),
    "retried": MarkKind({"attempts": ATTEMPT},
                        {"available_at": DateTime(timezone=True), "last_error": Text()}),
    "postponed": MarkKind({}, {"available_at": DateTime(timezone=True), "last_error": Text()}),
    "failed": MarkKind({"status": OutboxStatus.FAILED, "attempts": ATTEMPT}, {"last_error": Text()}),
}


def _mark_value(m: Table, value: Any) -> Any:
    if value is NOW:
        return bindparam("mark_now", type_=m.c.published_at.type)
    if value is ATTEMPT:
        return m.c.attempts + 1
    return value


def empty_marks() -> Marks:
    return Marks([], [], [], {})


def add_mark(marks: Marks, row_id: int, shard: int, epoch: int, **values: Any) -> None:
    marks.ids.append(row_id)
    marks.shards.append(shard)
    marks.epochs.append(epoch)
    for name, value in values.items():
        marks.values.setdefault(name, []).append(value)


