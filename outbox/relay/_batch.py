"""One relay batch: fetch due rows, send them, record every outcome in fenced bulk updates.

The rules that keep per-key order live here:

- the fetch returns a key's due rows in seq order and no row of a key whose
  earlier row failed or waits for a later attempt (``_sql``);
- keys whose head waits in the timing wheel are dropped after the fetch;
- the transport never writes a key's record after an earlier one of that key
  was not delivered;
- a key stops at its first row that was not delivered: that row gets its
  attempt count, error and next attempt time (retry) or ``failed`` status,
  and the key's later rows stay pending, untouched (decided in ``_outcomes``,
  written here).

A record to be retried because the broker did not answer about it
(``SendResult.unreachable``: no report in time, the connection down) waited for
an outage, whole or partial (DESIGN §9: never counted against a message): its
row gets an error and a short, capped next attempt time but keeps its attempt
count, whatever became of the batch's other records. (A node that dies under a
batch leaves the records it led unanswered while the others are delivered.) A
batch whose every retry is unreachable and of which nothing was delivered is
the broker being down, which the relay logs.

Pipelined batches (``run(wait=False)``, on the dialects whose statements say
``pipelines``: PostgreSQL and MySQL, used by ``Relay.run``) write their
outcomes on a helper thread, in batch order, while the next batches are fetched
and sent (up to ``WRITES_IN_FLIGHT`` writes unfinished at once); the rows being
written are excluded from those fetches (``RelayStatements.fetch_params`` and
``without_busy``: on PostgreSQL in the statement, on MySQL after it) and the
keys each write stops (retried or failed heads) are held in memory until it
commits.

Only the relay's worker thread calls ``run``, ``finish`` and ``close``; writes
(with their metrics and alerts) may run on the one helper thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict

import tenacity
from sqlalchemy import Connection, Engine

from transports import SendResult, Transport
from transports._logsafe import safe_logger

from ..core._alerts import Alert, AlertKind, AlertSink, deliver
from ..core._cloudevents import CloudEvents
from ..core._envelope import utcnow
from ..core._outage import OutageTracker, is_database_outage
from ..core._tracing import INSTALLED as TRACING_INSTALLED
from ..core._tracing import start_send
from ..core._wheel import TimingWheel
from ._exactly_once import ExactlyOnce
from ._metrics import RelayMetrics
from ._outcomes import ROW_ID, ROW_KEY, ROW_SHARD, ROW_TOPIC, Plan, Planner
from ._progress import message_tag
from ._rows import RowEncoder, safe_reason
from ._sql import Marks, RelayStatements
from ._sql_shared import ROW_OCTETS
from ._unreadable import find_unreadable
from ._writer import BackgroundWriter, Writer

log = safe_logger("outbox.relay")

WRITES_IN_FLIGHT = 2
"""Pipelined batches whose outcome writes may be unfinished at once. With one, the next batch
waited for the previous one's write after every third batch at 1,000 msg/s (a mark's commit
took 10-17 ms at load 5-10, as long as a whole batch): a message committed meanwhile waited
too (bench_relay_latency.py). Beyond this many, a batch waits for the oldest write.
Exactly-once mode keeps one: a shard's progress record names every row committed and not known
marked, and ``_progress.check_progress_fits`` sized the batch for two batches' ids."""


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one ``run_once`` did; ``full`` means more may be waiting."""

    fetched: int = 0
    sent: int = 0
    published: int = 0
    retried: int = 0
    failed: int = 0
    held: int = 0
    """Rows not sent because their key waits in the timing wheel."""
    fenced: int = 0
    """Rows delivered but not marked because this relay lost the shard's lease."""
    error: str | None = None
    """The first error of a row to be retried, if any."""
    broker_unreachable: bool = False
    """Nothing delivered, nothing refused, no answer for any record: the broker is down."""
    full: bool = False
    """The fetch stopped at its row or byte limit: more rows may be due (``RelayStatements.fetch``)."""


class _Written(TypedDict):
    """The counts of a batch's outcome write, as ``BatchResult`` fields."""

    published: int
    retried: int
    failed: int
    fenced: int


@dataclass(frozen=True, slots=True)
class _Writing:
    """A pipelined batch's outcome write: until it commits, its rows are excluded from the fetch
    (``busy``) and the keys it stops (retried or failed heads) are held in memory (``held``)."""

    future: Future[_Written]
    busy: list[int]
    held: set[tuple[str, str]]


class BatchRunner:
    """Runs one relay's batches one after the other (see the module doc); each gives a ``BatchResult``."""

    def __init__(
        self,
        engine: Engine,
        sql: RelayStatements,
        transport: Transport,
        wheel: TimingWheel[tuple[str, str]],
        *,
        backoff: tenacity.wait.wait_base,
        alert: AlertSink | Callable[[Alert], None],
        metrics: RelayMetrics,
        worker_id: str,
        batch_size: int,
        max_batch_bytes: int,
        database_outage: OutageTracker,
        incarnation: str | None = None,
        cloudevents: CloudEvents | None = None,
        writer: Writer | None = None,
        exactly_once: ExactlyOnce | None = None,
        lease_ttl: float | None = None,
    ) -> None:
        self.engine, self.sql, self.transport, self.wheel = engine, sql, transport, wheel
        # Exactly-once mode: a transaction per shard instead of ``transport.publish`` (``_exactly_once``).
        self.exactly_once = exactly_once
        self.database_outage = database_outage
        self.backoff, self.alert, self.metrics = backoff, alert, metrics
        self.worker_id, self.batch_size, self.max_batch_bytes = worker_id, batch_size, max_batch_bytes
        # A mark's transaction left idle this long is ended by the database (``_marking``).
        self._idle_limit = lease_ttl
        # Pipelining (PostgreSQL, inside Relay.run): earlier batches' outcomes are written
        # on a helper thread while this batch is fetched and sent (up to WRITES_IN_FLIGHT).
        # Their rows are excluded from the fetch ("busy") and the keys they stop (retried
        # or failed heads) held in memory until their write commits: until then the
        # database does not know they wait, and a wheel timer may already have fired.
        # ``writer``: where the writes run (a fleet's shared writers); else a thread of its own.
        self._writer: Writer | None = writer
        self._own_writer: BackgroundWriter | None = None
        self._writes: deque[_Writing] = deque()  # oldest first
        self._planner = Planner(wheel, metrics, backoff)
        # The last fetch was full: more rows are due than a batch takes (``RelayStatements.fetch``).
        # A relay starts as if it was: after a restart there usually is a backlog, and the
        # keeping-up form would read up to a batch per shard of it (on PostgreSQL, 16x the rows).
        self._backlog = True
        # This database's identity, in every envelope.
        self._encoder = RowEncoder(incarnation, check_ids=sql.ids_need_checking, cloudevents=cloudevents)

    def run(self, owned: dict[int, int], *, wait: bool = True,
            idle: Callable[[Connection], object] | None = None, limit: int | None = None) -> BatchResult:
        """One batch over the shards in ``owned`` (shard -> lease epoch), of ``limit`` rows at most
        (default ``batch_size``).

        With ``wait=False`` (where ``sql.pipelines``) the outcomes are written in the
        background while the next batch runs; the counts returned are then what
        is being written, and ``finish`` waits for it. ``idle``: called on the
        fetch's connection, in its transaction, when the fetch was not full: it
        read every row due (a fleet's step looks ahead there, ``RelayStep.run``).
        """
        started = time.perf_counter()
        if self.exactly_once is not None:
            # Shards taken since the last batch: earlier owners fenced, committed rows marked.
            owned, error = self.exactly_once.prepare(owned)
            if not owned:
                self.finish()
                return BatchResult(error=error, broker_unreachable=error is not None)
        self._settle()  # writes that committed: their rows and keys are the database's to tell
        sql = self.sql
        busy = [row_id for writing in self._writes for row_id in writing.busy]  # being marked
        asked = time.monotonic()  # a fetch begun before an outage was told does not end it
        with self.engine.connect() as conn:
            conn = sql.prepare_fetch(conn)
            limit = limit or self.batch_size
            params = sql.fetch_params(utcnow(), limit, busy, self.max_batch_bytes)
            try:
                rows: Sequence[Any] = conn.execute(sql.fetch(owned, backlog=self._backlog), params).all()
                unreadable = None
            except Exception as exc:
                if is_database_outage(exc):
                    raise
                unreadable = exc
            # Full: stopped at its rows, or at its bytes (the running total of the last row reached them).
            full = unreadable is None and (
                len(rows) >= params["limit"] or (bool(rows) and rows[-1][ROW_OCTETS] >= self.max_batch_bytes))
            if idle is not None and unreadable is None and not full:
                idle(conn)
            # Read only, so a commit ends it as a rollback would; but psycopg forgets its prepared
            # statements at every rollback, and kept, the fetch is not parsed and planned again
            # each batch (``RelayStatements.fetch``). In autocommit (PostgreSQL) both are no-ops.
            if unreadable is None:
                conn.commit()
            else:
                conn.rollback()
        if unreadable is not None:  # outside the fetch's transaction: SQLite's lock is gone
            return self._fail_unreadable(owned, params, unreadable, started)
        if busy:  # params["limit"] counts the busy rows too on MySQL, which may be marked by now
            rows = sql.without_busy(rows, busy, limit)
            full = full or len(rows) >= limit
        self._backlog = full
        self.database_outage.answered(asked)
        wheel = self.wheel
        held = set().union(*(writing.held for writing in self._writes))
        # Rows are unpacked by position: a Row's attribute access costs more per row
        # than building its record.
        sendable = rows if not (len(wheel) or held) else [
            r for r in rows
            if r[ROW_KEY] is None
            or ((r[ROW_TOPIC], r[ROW_KEY]) not in wheel and (r[ROW_TOPIC], r[ROW_KEY]) not in held)
        ]
        if (not sendable and self._writes and self.exactly_once is None
                and (rows or full or any(key not in wheel for key in held))):
            # Nothing to send for the writes in flight: every row fetched is of a key their writes
            # stop (a fetch cut by its bytes to them), or was one being written (MySQL reads them
            # and drops them after: a fetch full of them), or a retried row is left out as being
            # written though its backoff has ended (the wheel let its key go before the mark
            # committed). Nothing wakes the relay when a mark commits: wait for the writes, and
            # fetch again, which then reads which keys wait and which retries are due.
            self._settle(keep=0)
            return self.run(owned, wait=wait, idle=idle, limit=limit)
        if not rows:
            return BatchResult()
        # Each row is encoded on its own: one that can never be a record fails alone (``_rows``).
        records, sendable, unsendable = self._encoder.records(sendable)
        traced = None
        if TRACING_INSTALLED and records:  # a send span per traced record, when an SDK records
            records, traced = start_send(records, lambda i: str(sendable[i][1]))
        if not records:
            results: list[SendResult] = []
        elif self.exactly_once is not None:
            results = self.exactly_once.send(records, [(r[ROW_ID], r[ROW_SHARD]) for r in sendable])
        else:
            results = self.transport.publish(records)
        if traced is not None:
            traced.finish(results)
        if len(results) != len(records):
            raise RuntimeError(f"{self.transport!r} returned {len(results)} results for {len(records)}")
        plan = self._planner.plan(sendable, results, owned, unsendable)
        pipelined = not wait and sql.pipelines
        in_flight = WRITES_IN_FLIGHT if self.exactly_once is None else 1
        self._settle(keep=in_flight - 1 if pipelined else 0)  # written in batch order
        if not pipelined:
            outcome = self._write(plan)
        else:
            busy = (plan.published.ids + plan.retried.ids + plan.postponed.ids
                    + [row.id for row, _, _ in plan.failed])
            if self._writer is None:
                self._writer = self._own_writer = BackgroundWriter("outbox-relay-writer")
            self._writes.append(_Writing(self._writer.submit(lambda: self._write_behind(plan)),
                                         busy, plan.stopped))
            outcome = {"published": len(plan.published.ids),
                       "retried": len(plan.retried.ids) + len(plan.postponed.ids),
                       "failed": len(plan.failed), "fenced": 0}
        self.metrics.batch_duration.observe(time.perf_counter() - started)
        self.metrics.wheel_size.labels(self.worker_id).set(len(wheel))
        return BatchResult(fetched=len(rows), sent=len(records), full=full,
                           held=len(rows) - len(sendable) - len(unsendable),
                           error=plan.error, broker_unreachable=plan.broker_unreachable and not (
                               self.exactly_once is not None and self.exactly_once.held_back), **outcome)

    @property
    def writing(self) -> bool:
        """A write of an earlier batch's outcomes has not been collected yet."""
        return bool(self._writes)

    def finish(self) -> None:
        """Wait for the background writes of earlier batches, if any; re-raises the first error."""
        self._collect(keep=0)

    def _collect(self, keep: int | None = None) -> None:
        """Drop the writes that finished, oldest first; with ``keep``, first wait until at most
        ``keep`` are unfinished. Re-raises the first error of those dropped."""
        error: Exception | None = None
        writes = self._writes
        while writes and (writes[0].future.done() or (keep is not None and len(writes) > keep)):
            try:
                writes.popleft().future.result()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def _settle(self, keep: int | None = None) -> None:
        """``_collect``, whose error is reported here: the rows of a write that failed stay pending
        and are sent again (duplicates); the batch goes on."""
        try:
            self._collect(keep)
        except Exception as exc:
            if is_database_outage(exc):
                self.database_outage.failed(exc)
            else:
                log.exception("relay %s could not record a batch's outcomes", self.worker_id)

    def mark_committed(self, shard: int, epoch: int, ids: list[int]) -> bool:
        """Mark rows a committed transaction carried published (exactly-once take-over), fenced;
        whether the lease still held (some of the rows may have been marked before: no count tells)."""
        n = len(ids)
        unknown: list[Any] = [None] * n  # their partitions and offsets are the broker's to say
        marks = Marks(ids, [shard] * n, [epoch] * n, {"kafka_partition": unknown, "kafka_offset": unknown})
        with self._marking() as conn:
            self.sql.published(conn, self.worker_id, marks, utcnow())
            return self.sql.holds(conn, self.worker_id, shard, epoch)

    def message_tags(self, ids: Sequence[int]) -> dict[int, str]:
        """The tag (``_progress.message_tag``) of the message each row of ``ids`` there is holds: what an
        exactly-once take-over checks a progress record's rows by (``_shard_producer``)."""
        with self.engine.connect() as conn:
            return {row: message_tag(message) for row, message in self.sql.messages(conn, ids).items()}

    def close(self) -> None:
        try:
            self.finish()
        finally:
            if self.exactly_once is not None:
                self.exactly_once.close()
        if self._own_writer is not None:
            self._own_writer.shutdown()
            self._own_writer = self._writer = None

    def _write_behind(self, plan: Plan) -> _Written:
        """``_write`` on the writer: a database outage is told when it happens, not when it is waited for.

        The next batch may wait for this write only after the outage is over
        (its fetch fails first): told then, it would read as a second outage
        just after the first ended. Its rows stay pending and are sent again.
        """
        try:
            return self._write(plan)
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            self.database_outage.failed(exc)
            return {"published": 0, "retried": 0, "failed": 0, "fenced": 0}

    def _write(self, plan: Plan) -> _Written:
        """Write a batch's outcomes in one transaction; metrics and alerts after commit."""
        published, failed = plan.published, plan.failed
        known = published.ids  # rows known marked (exactly-once)
        with self._marking() as conn:
            marked = self.sql.published(conn, self.worker_id, published, plan.now)
            self.sql.retried(conn, self.worker_id, plan.retried)
            self.sql.postponed(conn, self.worker_id, plan.postponed)
            newly_failed = self._mark_failed(conn, failed)
            if self.exactly_once is not None and marked < len(published.ids):
                known = self._marked_under_held_leases(conn, published)
        if self.exactly_once is not None:
            # No later progress record needs to name them. A mark fenced (a lease lost) leaves
            # its rows pending: they stay "committed" in memory, so a batch the worker runs on
            # the lost lease before its renewal noticed never sends them again.
            self.exactly_once.marked(known)
        for topic, n in plan.published_topics.items():
            self.metrics.published.labels(topic).inc(n)
        self._alert_failed(newly_failed)
        fenced = len(published.ids) - marked
        if fenced:
            log.warning("relay %s lost a lease: %d delivered rows left to the new owner",
                        self.worker_id, fenced)
        return {"published": marked, "retried": len(plan.retried.ids) + len(plan.postponed.ids),
                "failed": len(newly_failed),
                "fenced": fenced}

    @contextmanager
    def _marking(self) -> Iterator[Connection]:
        """A transaction of marks that the database ends if this relay stalls inside it for a lease TTL.

        Its rows stay locked until it commits, and the relay that takes the shards
        of a relay frozen there (past its lease) marks the same rows: without the
        bound it would wait, publishing nothing, for as long as the frozen one
        sleeps (``RelayStatements.end_if_idle``). Ended, the marks are undone: the
        rows stay pending, and the new owner marks (exactly-once: the committed
        progress names them) or sends them.
        """
        with self.engine.begin() as conn:
            if self._idle_limit is not None:
                self.sql.end_if_idle(conn, self._idle_limit)
            yield conn

    def _marked_under_held_leases(self, conn: Connection, published: Marks) -> list[int]:
        """The rows of ``published`` whose shard's lease this relay still holds (their mark committed)."""
        held = {(shard, epoch) for shard, epoch in set(zip(published.shards, published.epochs, strict=True))
                if self.sql.holds(conn, self.worker_id, shard, epoch)}
        return [row_id for row_id, shard, epoch in zip(published.ids, published.shards, published.epochs,
                                                         strict=True) if (shard, epoch) in held]

    def _fail_unreadable(self, owned: dict[int, int], params: dict[str, Any], error: Exception,
                         started: float) -> BatchResult:
        """The fetch failed on a value it cannot read: fail those rows alone (``_unreadable``).

        Nothing is sent in this batch; the next fetch no longer meets the failed rows,
        and the key of each waits behind it like behind any failed row.
        """
        self.finish()
        found = find_unreadable(self.engine, self.sql, sorted(owned), params)
        if not found:
            raise error  # not a row's fault: the loop reports it
        failed = [(row, owned[row.shard], safe_reason(f"cannot be read: {reason}"))
                  for row, reason in found]
        with self._marking() as conn:
            newly_failed = self._mark_failed(conn, failed)
        self._alert_failed(newly_failed)
        self.metrics.batch_duration.observe(time.perf_counter() - started)
        # Full: the fetch's readable rows are still due, and the step goes again at once for them.
        return BatchResult(fetched=len(found), failed=len(newly_failed), full=True)

    def _alert_failed(self, newly_failed: list[tuple[Any, str]]) -> None:
        """One alert per row that became failed (after its write committed)."""
        for row, error in newly_failed:
            self.metrics.failed.labels(row.topic).inc()
            message_id = str(row.message_id) if row.message_id is not None else None
            deliver(self.alert, Alert(kind=AlertKind.MESSAGE_FAILED, topic=row.topic, key=row.key,
                                      message_id=message_id, error=error,
                                      details={"id": row.id, "seq": row.seq}))

    def _mark_failed(self, conn: Connection, failed: list[tuple[Any, int, str]]) -> list[tuple[Any, str]]:
        """Failed rows are rare: one update each, so only rows that really changed alert."""
        changed: list[tuple[Any, str]] = []
        for row, epoch, error in failed:
            one = Marks([row.id], [row.shard], [epoch], {"last_error": [error]})
            if self.sql.failed(conn, self.worker_id, one):
                changed.append((row, error))
        return changed

