"""``RelayStep``: one relay's state, and one step of work over it on the caller's thread.

A relay is a step and a loop around it. The step owns what one relay holds:
its shard leases, the timing wheel of its keys waiting for a retry, the batch
runner (fetch, send, mark) and the watch of its stuck keys. ``run`` is one
step: the leases renewed when due (unless the loop has a lease thread),
surplus shards given back between batches, the wheel advanced, one batch, the
broker's answer told to the broker's outage tracker, the stuck keys looked at
when due. It returns what a loop needs (``Step``): whether more may be waiting
at once, and when the wheel next fires. The step starts no thread (a
pipelined batch's outcomes aside, written on the batch runner's writer).

Two loops drive steps: ``Relay`` (one step; its loop, lease and backlog
threads, NOTIFY) and ``TenantRelay`` (a step per tenant, scheduled on a few
workers). Both hand their steps the outage trackers they report to
(``RelayOutages``): one database outage is logged once, whatever the number of
steps over that database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine

from transports import Transport
from transports._errors import RetriableTransportError
from transports._logsafe import safe_logger
from transports._weak import weakly

from ..core._alerts import Alert, AlertSink
from ..core._cloudevents import CloudEvents
from ..core._envelope import utcnow
from ..core._outage import RELAY_WORDING, OutageBackoff, OutageTracker, is_database_outage
from ..core._wheel import TimingWheel
from ..producer import Outbox
from ._admin import RetryingHead
from ._batch import BatchResult, BatchRunner
from ._exactly_once import ExactlyOnce
from ._leases import Leases, renew_interval
from ._metrics import RelayMetrics
from ._progress import check_progress_fits
from ._record_limit import check_record_limit
from ._session import relay_engine
from ._settings import RelaySettings
from ._sharing import Sharing
from ._sql import statements_for
from ._stuck import StuckKeys
from ._unsettled import UnsettledTopics
from ._writer import Writer

log = safe_logger("outbox.relay")


@dataclass(frozen=True)
class RelayOutages:
    """The trackers a relay's steps tell when the database or the broker stops or starts answering."""

    database: OutageTracker
    broker: OutageTracker

    @staticmethod
    def tracker(what: str, dependency: str, metrics: RelayMetrics,
                backoff: OutageBackoff | None = None) -> OutageTracker:
        """A tracker in the relay's wording, counted in ``outbox_relay_outages{dependency}``."""
        return OutageTracker(what, log=log, wording=RELAY_WORDING, backoff=backoff or OutageBackoff(),
                             count=metrics.outages.labels(dependency).inc)


@dataclass(frozen=True, slots=True)
class Step:
    """What one step did, and what the loop around it needs to know."""

    batch: BatchResult
    again: bool
    """A full batch that sent or failed something: more may be waiting, step again at once (a
    failed row is not fetched again). A full batch that all waits in the wheel is not: fetching it
    again at once would only spin; the loop waits for the wheel (``due``)."""
    due: float | None
    """When (``time.monotonic()``) the wheel next lets a key go again; None when nothing waits."""


class RelayStep:
    """One relay's leases, wheel, batch runner and stuck-key watch; ``run`` does one step.

    Construction reads the stored shard count, record limit and incarnation
    (so it needs the database) and refuses a transport that cannot send
    records as large as the stored limit. ``name`` is how its log lines call
    it (``relay <worker id>``, or with the tenant); ``watch_every`` is how
    often the stuck keys are looked at; ``writer`` is where pipelined batches'
    outcomes are written (default: a thread of its own, started on the first).
    One thread at a time runs its steps; ``maintain_leases`` may run on
    another (``Leases`` is safe for that). ``sharing``: in exactly-once mode,
    what a fleet's steps share (``_exactly_once.Sharing``): one pool, idle
    producers closed, a progress topic per outbox. ``stopping``: the run's stop,
    set; a batch cut into several transactions begins no more of them once it is.
    """

    def __init__(self, outbox: Outbox, transport: Transport, engine: Engine, settings: RelaySettings, *,
                 alert: AlertSink | Callable[[Alert], None], metrics: RelayMetrics, outages: RelayOutages,
                 cloudevents: CloudEvents | None = None, name: str | None = None,
                 watch_every: float | None = None, writer: Writer | None = None,
                 sharing: Sharing | None = None, stopping: threading.Event | None = None) -> None:
        self.settings = settings
        self.name = name or f"relay {settings.worker_id}"
        self._metrics = metrics
        self._outages = outages
        worker_id = settings.worker_id
        engine = relay_engine(engine)
        self.stuck_keys = StuckKeys(outbox, engine, settings.key_stuck_after, alert, metrics.stuck_keys,
                                    worker_id)
        stored = outbox.load_schema(engine)  # shard count, record limit, incarnation: with the tables
        check_record_limit(transport, stored.max_record_bytes)
        self.leases = Leases(engine, outbox.tables, stored.shard_count, worker_id, settings.lease_ttl)
        self.wheel: TimingWheel[tuple[str, str]] = TimingWheel(tick=settings.wheel_tick,
                                                               start=time.monotonic())
        self._engine = engine
        self._sql = statements_for(outbox.tables, engine.dialect.name)
        self._batch: BatchRunner = BatchRunner(
            engine, self._sql, transport, self.wheel,
            backoff=settings.backoff, alert=alert, metrics=metrics, worker_id=worker_id,
            batch_size=settings.batch_size, max_batch_bytes=settings.max_batch_bytes,
            database_outage=outages.database,
            incarnation=stored.incarnation, cloudevents=cloudevents, writer=writer,
            lease_ttl=settings.lease_ttl)
        if settings.exactly_once:
            topic = settings.progress_topic if sharing is None or not stored.incarnation else (
                sharing.topic_for(stored.incarnation))
            # It marks through the batch runner, held weakly (they would hold each other: transports._weak).
            self._batch.exactly_once = ExactlyOnce(
                transport, incarnation=stored.incarnation, worker_id=worker_id, shards=stored.shard_count,
                progress_topic=topic, mark=weakly(self._batch.mark_committed),
                messages=weakly(self._batch.message_tags),
                lease=UnsettledTopics(self.leases), sharing=sharing, name=self.name,
                stopping=stopping)
            check_progress_fits(transport, settings.batch_size, worker_id)
        self._leases_due = 0.0
        self._watch_every = watch_every if watch_every is not None else renew_interval(settings.lease_ttl)
        self._watch_due = 0.0
        self._fetched_at = utcnow()
        self._ahead: tuple[datetime | None] | None = None
        """What the last step's fetch, not full, read ahead for ``poll_within`` (the next delayed row's
        ``available_at``); None when it did not."""
        self._heads: list[RetryingHead] | None = None
        """The retrying heads this step's fetch, not full, read (``_look_ahead``), to be judged once its
        transaction ended; None when it read none."""

    def __repr__(self) -> str:
        return f"RelayStep({self.name!r})"

    # -- one step -----------------------------------------------------------------

    def run(self, *, wait: bool = True, leases: bool = True, look_ahead: bool = False,
            probe: bool = False, limit: int | None = None) -> Step:
        """One step: prepare, one batch, and what the loop needs; raises what the batch raised.

        ``wait=False`` pipelines: this batch's outcomes are written while the
        next step runs (PostgreSQL, MySQL). ``leases=False``: a lease thread
        renews them, so a batch that blocks on the broker cannot let them lapse.
        ``look_ahead``: a fetch that found every row due (it was not full) also
        reads, in its own transaction, what ``poll_within`` needs (the next
        delayed row) and the stuck keys when their check is due: a loop that
        polls its steps rarely while notifications wake them asks it
        (``TenantRelay``), and neither an idle poll nor the turn that sent a
        tenant's last rows needs another transaction to know when to poll next.
        ``limit``: fewer rows than the batch size this once (a fleet's share, ``tenants._shares``);
        ``Step.again`` then says whether that many were there.
        ``probe`` (with ``look_ahead``): the step is a poll, which for a tenant that notifications
        wake mostly finds nothing: its look-ahead goes first and also asks whether any row is due
        (``RelayStatements.probe``); none, and there is no fetch, one statement instead of two. Rows
        due: the batch runs as without it.
        """
        now = time.monotonic()
        self.prepare(leases=leases)
        self._fetched_at = utcnow()  # what its fetch counts as due now is due by this
        self._ahead = self._heads = None
        ahead: Callable[[Connection], object] | None = (
            (lambda conn: self._look_ahead(conn, now)) if look_ahead else None)
        limit = min(limit, self.settings.batch_size) if limit else self.settings.batch_size
        try:
            if probe and look_ahead and self._nothing_due(now):
                batch = BatchResult()
            else:
                batch = self.run_batch(wait=wait, idle=ahead, limit=limit)
        finally:  # read in the fetch's transaction, alerted on after it, though the send then raised
            heads, self._heads = self._heads, None
            if heads is not None:
                self.stuck_keys.judge(heads)
        # The database is marked up by the queries that reached it (the fetch, the lease
        # maintenance), never here: a step owning no shards ran none.
        if batch.published:
            self._outages.broker.answered()
        elif batch.broker_unreachable:
            self._outages.broker.failed(batch.error or "no delivery report")
        elif self._batch.exactly_once is not None and (since := self._batch.exactly_once.answered_held()):
            # Only take-overs held by an open transaction (no row sent): the broker answered each.
            self._outages.broker.answered(since)
        self._watch(now)
        return Step(batch, again=batch.full and (batch.sent > 0 or batch.failed > 0),
                    due=self.wheel.next_due())

    def run_once(self) -> BatchResult:
        """Fetch, send and mark one batch, its leases maintained when due; what the batch did."""
        return self.run(wait=True, leases=True).batch

    def prepare(self, *, leases: bool = True) -> None:
        """Before a batch: leases renewed when due (``leases``), surplus shards given back, wheel advanced."""
        if leases and time.monotonic() >= self._leases_due:
            self.maintain_leases()
        if self.leases.surplus:
            self._batch.finish()  # never give a shard back under a write in flight
            self.leases.release_surplus()
        self.wheel.advance(time.monotonic())

    def check_progress_topic(self) -> None:
        """Exactly-once mode: its progress topic made, or ``ConfigurationError`` if found not
        compacted; a broker that does not answer leaves the check to the first take-over's."""
        if self._batch.exactly_once is not None:
            with suppress(RetriableTransportError):
                self._batch.exactly_once.check_topic()

    def run_batch(self, *, wait: bool, idle: Callable[[Connection], object] | None = None,
                  limit: int | None = None) -> BatchResult:
        """One batch over the shards held now (none held: the last write finished, nothing fetched).

        ``idle``: called on the fetch's connection when it was not full (``BatchRunner.run``).
        """
        owned = self.leases.owned()
        if not owned:
            self._batch.finish()
            return BatchResult()
        return self._batch.run(owned, wait=wait, idle=idle, limit=limit)

    def _nothing_due(self, now: float) -> bool:
        """A poll's look-ahead on a connection of its own, which found no row due: nothing to fetch.

        Asked only with nothing in flight: no write of an earlier batch (its rows
        are pending until it commits, and the batch collects its outcome) and no
        exactly-once mode (a take-over waiting is tried at the next batch). A
        look-ahead that failed (reported) says nothing: the batch runs.
        """
        if not self.leases.owned() or self._batch.writing or self._batch.exactly_once is not None:
            return False
        started = time.monotonic()
        with self._engine.connect() as conn:
            conn = self._sql.prepare_fetch(conn)
            due = self._look_ahead(conn, now, probe=True)
            conn.commit()  # read only; in autocommit (PostgreSQL) a no-op
        if due is None:
            return False
        self._outages.database.answered(started)
        return not due

    def _look_ahead(self, conn: Connection, now: float, *, probe: bool = False) -> bool | None:
        """On the connection of a fetch that was not full: the next delayed row (for ``poll_within``),
        the stuck keys if due.

        One query answers both when and whether: the next delayed row, and
        whether any row is being retried; none retried, the stuck-key check has
        nothing to read and finds no key stuck (its gauge and memory of alerts
        cleared as a check that found none clears them). The heads read are
        judged, and alerted on, by ``run`` once the transaction ended
        (``StuckKeys.judge``). A database outage is raised (the fetch's, as it
        were); any other failure of the look-ahead is left to the statement after it (logged there),
        a stuck-key read that fails otherwise is reported, as ``_watch`` does.
        Returns, with ``probe`` (``RelayStatements.probe``), whether any row is due; None without
        it, or when the read failed.
        """
        shards = sorted(self.leases.owned())
        params: dict[str, object] = {"since": self._fetched_at, "shards": shards}
        try:  # it runs before the fetched rows are sent: its failure must not keep them
            if probe:
                params["now"] = self._fetched_at
                at, retried, found = conn.execute(self._sql.probe(), params).one()
                due: bool | None = bool(found)
            else:
                (at, retried), due = conn.execute(self._sql.look_ahead(), params).one(), None
        except Exception as exc:
            if is_database_outage(exc):
                raise
            # Not logged here: what failed it fails the next statement on the same tables, which is
            # logged once by the loop (with ``probe`` the batch it lets run; without, ``poll_within``,
            # which asks on its own, or the next turn's fetch). Reported here too, a table dropped
            # between the fetch and this read (the fetch's autocommit on PostgreSQL holds no lock on
            # it) made two error lines of one failure (tests/test_tenant_attacks.py, CI of d8aaabb).
            log.debug("%s: its look-ahead failed", self.name, exc_info=True)
            return None
        self._ahead = (at,)
        if now < self._watch_due:
            return due
        self._watch_due = now + self._watch_every
        try:  # the transaction's last statement: a failure leaves only its rollback to do
            self._heads = self.stuck_keys.read(shards if retried else [], conn)
        except Exception as exc:
            if is_database_outage(exc):
                raise
            self.report(exc, "could not watch its keys")
        return due

    @property
    def needs_leases(self) -> bool:
        """It has never maintained its leases (its first step takes them)."""
        return self._leases_due == 0.0

    def maintain_leases(self) -> dict[int, int]:
        """Renew, take and count this relay's shard leases; the database answered."""
        started = time.monotonic()
        return self.leases_maintained(self.leases.maintain(), started)

    def leases_maintained(self, owned: dict[int, int], started: float | None = None) -> dict[int, int]:
        """Its leases were maintained, holding ``owned`` now (by ``maintain_leases``, or by a renewal of
        many relays' leases at once, ``_leases_shared``): the database answered, the next renewal due.

        ``started``: when that renewal began. One that began before an outage was told says nothing of
        now: it ended the outage of a server that was going down (a restart told twice each way)."""
        self._outages.database.answered(started)
        self._leases_due = time.monotonic() + renew_interval(self.leases.ttl)
        self._metrics.shards_owned.labels(self.settings.worker_id).set(len(owned))
        return owned

    def poll_within(self) -> float:
        """Seconds by which this step must run again, though nothing wakes it.

        A loop that polls rarely while notifications wake its steps
        (``TenantRelay``'s idle tenants) polls by then: no notification comes
        when a delayed row comes due (``publish(delay=...)``, or a retry another
        relay wrote before this one took the shard; the wheel knows only its own
        retries), nor when the stuck-key check is due, nor for an exactly-once
        take-over to be tried again (``ExactlyOnce.waiting``). One query on the small
        index of delayed rows (those not yet due at its last fetch), unless its
        last step read it ahead (``run(look_ahead=True)``); a database outage is raised.
        """
        within = max(0.0, self._watch_due - time.monotonic())
        exactly_once = self._batch.exactly_once
        if exactly_once is not None and exactly_once.waiting:  # a take-over is tried again at the next batch
            within = min(within, self.settings.poll_interval)
        owned = self.leases.owned()
        if self._ahead is not None:  # read by this step's fetch, not full (``look_ahead``)
            at = self._ahead[0]
        elif owned:
            params = {"since": self._fetched_at, "shards": sorted(owned)}
            with self._engine.connect() as conn:
                at = conn.scalar(self._sql.next_delayed(), params)
        else:
            at = None
        if at is not None:  # compared with this host's clock, as the fetch's "due" is
            within = min(within, max(0.0, (at - utcnow()).total_seconds()))
        return within

    def _watch(self, now: float) -> None:
        """Keys stuck behind a retrying head (``_stuck``), every ``watch_every`` seconds."""
        if now < self._watch_due:
            return
        self._watch_due = now + self._watch_every
        try:
            self.stuck_keys.check(sorted(self.leases.owned()))
        except Exception as exc:
            self.report(exc, "could not watch its keys")

    def report(self, error: Exception, what: str) -> None:
        """A database outage is told to its tracker (logged once per change); anything else: a traceback."""
        if is_database_outage(error):
            self._outages.database.failed(error)
        else:
            log.exception("%s %s", self.name, what)

    # -- the end --------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the last batch's marks, then give the leases back; raises what the database raised."""
        self._batch.close()
        self.leases.release_all()

    def release(self, *, quiet: bool = False) -> bool:
        """``close`` that no outage fails; True when the leases were given back.

        A database that does not answer leaves the leases to expire within
        their TTL (a warning, unless its outage was logged already); anything
        else is logged with its traceback. ``quiet``: the failure behind the
        release was logged already.
        """
        try:
            self._batch.close()  # the last batch's marks, before its leases go
        except Exception:
            if not quiet:
                log.exception("%s could not record its last batch", self.name)
        try:
            self.leases.release_all()
        except Exception as exc:
            if quiet:
                return False
            if is_database_outage(exc):
                if self._outages.database.down:
                    return False
                log.warning("%s could not release its leases (%s): they expire within the lease TTL",
                            self.name, type(exc).__name__)
            else:
                log.exception("%s could not release its leases", self.name)
            return False
        return True
