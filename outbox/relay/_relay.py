"""``Relay``: moves committed outbox rows to the broker, per key in seq order.

This module is the relay's life cycle: configuration checked at construction,
the loop (wake on NOTIFY, wheel timers or the poll interval; go again at once
after a full batch), the lease thread, and a graceful stop. What happens inside
one batch, and why it keeps per-key order, is in ``_batch``.

A database or broker outage is not a failure: the loop waits it out with
capped backoff and ``outbox._outage`` logs it once when it starts and once when it
ends. The backlog gauges have a thread of their own, so their GROUP BY never
delays lease renewal.

``run`` loops until ``stop`` (or SIGTERM/SIGINT): it finishes the batch in hand
(the transport bounds the wait for delivery reports), marks it, releases its
leases and returns, so a process running it exits 0. The loop runs on a thread
of its own (``outbox._stopping``), so ``run`` returns at most ``stop_timeout``
seconds after the stop even when the broker and the database are both gone:
what the loop has not finished by then is left behind (rows sent but not
marked are sent again, leases expire within their TTL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import tenacity
from sqlalchemy import Engine

from transports import Transport
from transports._logsafe import safe_logger

from .._alerts import Alert, AlertSink, LoggingAlertSink
from .._cloudevents import CloudEvents
from .._engine import worker_engine
from .._envelope import utcnow
from .._errors import ConfigurationError, SchemaError
from .._outage import RELAY_WORDING, OutageBackoff, OutageTracker, is_database_outage
from .._outbox import Outbox
from .._stopping import STOP_TIMEOUT, RunOnce, run_with_stop_bound
from .._wheel import TimingWheel
from ._admin import backlog
from ._batch import BatchResult, BatchRunner
from ._leases import Leases, renew_interval
from ._metrics import RelayMetrics, relay_metrics
from ._record_limit import check_record_limit
from ._settings import DEFAULT_BACKOFF, RelaySettings, default_worker_id
from ._sql import statements_for
from ._stuck import StuckKeys
from ._wakeup import Wakeup

log = safe_logger("outbox.relay")

class Relay:
    """Publishes an ``Outbox``'s rows through a ``Transport``; see the module doc.

    ``engine`` (a sync ``Engine``) defaults to the outbox's; ``worker_id`` must
    be unique among relays of one database (default: host, pid and a random
    suffix). ``backoff`` is a tenacity wait strategy giving the delay before
    attempt n+1; retriable errors are retried without limit, so a head still
    retrying after ``key_stuck_after`` seconds raises one ``key_stuck`` alert
    and counts in ``outbox_relay_stuck_keys`` (``_stuck``; checked by ``run``).
    ``run`` and ``run_once`` must be called from one thread; ``stop`` from any.
    The tuning keywords (``batch_size`` … ``key_stuck_after``) build a
    ``RelaySettings``, kept as ``relay.settings``, which checks each of them
    and names a bad one. ``cloudevents=True`` (or a ``CloudEvents`` naming the
    source) adds the CloudEvents binary-mode ``ce_*`` headers to every record
    (docs/cloudevents.md); the ``outbox-*`` envelope is sent either way.
    ``database_outage`` is the tracker its database's outages are told to; the
    relays of one database in a ``TenantRelay`` share one, so an outage is logged
    once, not once per tenant.

    Construction reads the stored shard count and record limit, so it needs the
    database and raises if it is unreachable, and raises ``ConfigurationError``
    when the transport cannot send records as large as the stored limit;
    ``run`` then waits out any database outage, from its first lease onwards.
    ``outbox relay`` waits for the database before it constructs one, so the
    process waits from start-up on.
    """

    def __init__(
        self,
        outbox: Outbox,
        transport: Transport,
        *,
        engine: Engine | None = None,
        batch_size: int = 1000,
        worker_id: str | None = None,
        alert: AlertSink | Callable[[Alert], None] | None = None,
        lease_ttl: float = 10.0,
        poll_interval: float = 0.5,
        backoff: tenacity.wait.wait_base = DEFAULT_BACKOFF,
        metrics: RelayMetrics | None = None,
        backlog_metrics: bool = False,
        wheel_tick: float = 0.02,
        key_stuck_after: float = 300.0,
        cloudevents: CloudEvents | bool = False,
        database_outage: OutageTracker | None = None,
    ) -> None:
        if not isinstance(outbox, Outbox):
            raise ConfigurationError(f"Relay needs an Outbox, got {type(outbox).__name__}")
        if not callable(getattr(transport, "publish", None)):
            raise ConfigurationError(f"transport {transport!r} has no publish(records) method")
        bound = engine if engine is not None else outbox.engine
        if not isinstance(bound, Engine):
            raise ConfigurationError("Relay needs a sync Engine: pass engine=create_engine(url)")
        engine = worker_engine(bound)
        settings = RelaySettings(
            batch_size=batch_size, worker_id=worker_id or default_worker_id(), lease_ttl=lease_ttl,
            poll_interval=poll_interval, backoff=backoff, backlog_metrics=backlog_metrics,
            wheel_tick=wheel_tick, key_stuck_after=key_stuck_after)
        worker_id = settings.worker_id
        alert = alert if alert is not None else LoggingAlertSink()
        if not callable(alert):
            raise ConfigurationError(f"alert must be an AlertSink or callable, got {alert!r}")

        self.settings = settings
        self.outbox = outbox
        self.transport = transport
        self.engine = engine
        self.batch_size = settings.batch_size
        self.worker_id = worker_id
        self.alert = alert
        self.poll_interval = settings.poll_interval
        self.backoff = settings.backoff
        self.metrics = metrics or relay_metrics()
        self.backlog_metrics = settings.backlog_metrics
        self._backlog_topics: set[str] = set()
        self.stuck_keys = StuckKeys(outbox, engine, settings.key_stuck_after, alert,
                                    self.metrics.stuck_keys, worker_id)
        stored = outbox.load_schema(engine)  # shard count, record limit, incarnation: with the tables
        check_record_limit(transport, stored.max_record_bytes)
        self.leases = Leases(engine, outbox.tables, stored.shard_count, worker_id, settings.lease_ttl)
        self.wheel: TimingWheel[tuple[str, str]] = TimingWheel(tick=settings.wheel_tick,
                                                               start=time.monotonic())
        # The loop's pause after a failed batch (an outage or not) grows from the poll interval.
        self._failure_backoff = OutageBackoff(first=settings.poll_interval)
        self.database_outage = database_outage or OutageTracker(
            f"relay {worker_id}: database", log=log, wording=RELAY_WORDING, backoff=self._failure_backoff,
            count=self.metrics.outages.labels("database").inc)
        self.broker_outage = OutageTracker(
            f"relay {worker_id}: broker", log=log, wording=RELAY_WORDING,
            count=self.metrics.outages.labels("broker").inc)
        self._batch = BatchRunner(
            engine, statements_for(outbox.tables, engine.dialect.name), transport, self.wheel,
            backoff=settings.backoff, alert=alert, metrics=self.metrics, worker_id=worker_id,
            batch_size=settings.batch_size, database_outage=self.database_outage,
            incarnation=stored.incarnation,
            cloudevents=_cloudevents_mode(cloudevents),
        )
        self._wakeup = Wakeup()
        self._stopping = threading.Event()
        self._runs = RunOnce(self._stopping, f"relay {self.worker_id}")
        self._lease_thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None
        self._next_lease_check = 0.0
        self._fatal: Exception | None = None

    def __repr__(self) -> str:
        return f"Relay(worker_id={self.worker_id!r}, transport={self.transport!r})"

    # -- one batch ------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Fetch, send and mark one batch; returns what happened.

        Without ``run`` (tests, embedding) the leases are maintained here, at
        most every TTL/3.
        """
        self._prepare_batch()
        return self._run_batch(wait=True)

    def _prepare_batch(self) -> None:
        if self._lease_thread is None and time.monotonic() >= self._next_lease_check:
            self._maintain_leases()
        if self.leases.surplus:
            self._batch.finish()  # never give a shard back under a write in flight
            self.leases.release_surplus()
        self.wheel.advance(time.monotonic())

    def _run_batch(self, *, wait: bool) -> BatchResult:
        owned = self.leases.owned()
        if not owned:
            self._batch.finish()
            return BatchResult()
        return self._batch.run(owned, wait=wait)

    # -- the loop ---------------------------------------------------------------

    def run(self, *, stop_timeout: float = STOP_TIMEOUT) -> None:
        """Publish until ``stop()`` or SIGTERM/SIGINT; then drain, release leases, return.

        Returns at most ``stop_timeout`` seconds after the stop, whatever is down.
        """
        def start() -> threading.Thread | None:
            self._fatal = None
            return run_with_stop_bound(self._run, stop=self.stop, stopping=self._stopping.is_set,
                                       name="outbox-relay-loop", what=f"relay {self.worker_id}", log=log,
                                       stop_timeout=stop_timeout)
        self._runs.run(start)

    def _run(self) -> None:
        try:
            if not self._first_leases():
                return  # stopped while waiting for the database
            self._lease_thread = threading.Thread(target=self._lease_loop,
                                                  name="outbox-relay-leases", daemon=True)
            self._lease_thread.start()
            # Its own thread: a GROUP BY over a large backlog must never delay lease renewal.
            self._watch_thread = threading.Thread(target=self._watch_loop,
                                                  name="outbox-relay-watch", daemon=True)
            self._watch_thread.start()
            if self.outbox.notify_channel:
                self._wakeup.listen(self.engine, self.outbox.notify_channel)
            log.info("relay %s started with shards %s", self.worker_id, sorted(self.leases.owned()))
            self._loop()
            if self._fatal is not None:
                raise self._fatal
        finally:
            self._stopping.set()
            self._wakeup.close()
            for thread in (self._lease_thread, self._watch_thread):
                if thread is not None:
                    thread.join(10)
            self._lease_thread = self._watch_thread = None
            try:
                self._batch.close()  # the last batch's marks, before its leases go
            except Exception:
                log.exception("relay %s could not record its last batch", self.worker_id)
            try:
                self.leases.release_all()
                log.info("relay %s stopped; leases released", self.worker_id)
            except Exception as exc:
                # The database is unreachable: the leases expire by themselves within the TTL.
                if not is_database_outage(exc):
                    log.exception("relay %s stopped; could not release its leases", self.worker_id)
                    return
                log.warning("relay %s stopped; could not release its leases (%s): they expire "
                            "within the lease TTL", self.worker_id, type(exc).__name__)

    def _first_leases(self) -> bool:
        """Take the first leases, waiting out a database outage; False if stopped meanwhile.

        A relay started while the database is down waits for it (one log line each
        way, like any outage) instead of exiting; any other error is raised.
        """
        while not self._stopping.is_set():
            try:
                self._maintain_leases()
                return True
            except Exception as exc:
                if not is_database_outage(exc):
                    raise
                self._stopping.wait(self.database_outage.failed(exc))
        return False

    def _loop(self) -> None:
        poll_due = 0.0
        again = True
        failures = 0
        while not self._stopping.is_set():
            mono = time.monotonic()
            if again or mono >= poll_due or self.wheel.advance(mono):
                poll_due = mono + self.poll_interval
                try:
                    # Pipelined: this batch's outcomes are written while the next one runs.
                    self._prepare_batch()
                    batch = self._run_batch(wait=False)
                except Exception as exc:
                    self._report(exc, "batch failed")
                    failures += 1
                    self._stopping.wait(self._failure_backoff.delay(failures))
                    again = True
                    continue
                failures = 0
                # The database is marked up by the queries that reached it (the fetch, the
                # lease maintenance), never here: a relay owning no shards ran none.
                if batch.published:
                    self.broker_outage.answered()
                elif batch.broker_unreachable:
                    self.broker_outage.failed(batch.error or "no delivery report")
                # A full batch means more may be waiting, unless all of it waits in the
                # wheel: then fetching again at once would only spin.
                again = batch.fetched == self.batch_size and batch.sent > 0
                if again:
                    continue
            wait = self.wheel.tick if len(self.wheel) else max(0.0, poll_due - time.monotonic())
            again = self._wakeup.wait(wait)

    def _lease_loop(self) -> None:
        interval = renew_interval(self.leases.ttl)
        while not self._stopping.wait(interval):
            try:
                before = set(self.leases.owned())
                after = self._maintain_leases()
                if set(after) - before or self.leases.surplus:
                    self._wakeup.set()  # new shards to serve, or surplus to give back
            except SchemaError as exc:
                log.error("relay %s: %s", self.worker_id, exc)
                self._fatal = exc
                self.stop()
                return
            except Exception as exc:
                self._report(exc, "could not maintain its leases")

    def _watch_loop(self) -> None:
        """Every lease renewal interval: keys stuck behind a retrying head; the backlog gauges if asked."""
        interval = renew_interval(self.leases.ttl)
        while not self._stopping.wait(interval):
            try:
                self.stuck_keys.check(sorted(self.leases.owned()))
                if self.backlog_metrics:
                    self.refresh_backlog_metrics()
            except Exception as exc:
                self._report(exc, "could not watch its keys and backlog")

    def _report(self, error: Exception, what: str) -> None:
        """A database outage is logged once per state change; anything else is a bug: traceback."""
        if is_database_outage(error):
            self.database_outage.failed(error)
        else:
            log.exception("relay %s %s", self.worker_id, what)

    def _maintain_leases(self) -> dict[int, int]:
        owned = self.leases.maintain()
        self.database_outage.answered()
        self._next_lease_check = time.monotonic() + renew_interval(self.leases.ttl)
        self.metrics.shards_owned.labels(self.worker_id).set(len(owned))
        return owned

    def refresh_backlog_metrics(self) -> None:
        """Set the pending-by-topic and oldest-pending-age gauges (one GROUP BY query)."""
        rows = backlog(self.outbox)
        # Topics seen before and now drained must drop to 0, not keep their last value.
        pending = dict.fromkeys(self._backlog_topics, 0)
        for row in rows:
            pending[row.topic] = pending.get(row.topic, 0) + row.pending
        for topic, count in pending.items():
            self.metrics.pending.labels(topic).set(count)
        self._backlog_topics = set(pending)
        oldest = [row.oldest_pending for row in rows if row.oldest_pending is not None]
        self.metrics.oldest_pending_age.set(
            (utcnow() - min(oldest)).total_seconds() if oldest else 0.0)

    def stop(self) -> None:
        """Ask ``run`` to finish the batch in hand and return; safe from any thread or signal.

        Asked before ``run`` (a thread that starts it while the application already stops), ``run``
        returns at once.
        """
        self._stopping.set()
        self._wakeup.set()

    def close(self) -> None:
        """Release leases held from ``run_once`` calls (``run`` does this itself)."""
        self._batch.close()
        self.leases.release_all()


def _cloudevents_mode(setting: CloudEvents | bool) -> CloudEvents | None:
    """``Relay(cloudevents=...)``: True for the default source, a ``CloudEvents`` for a chosen one."""
    if setting is True:
        return CloudEvents()
    if setting is False or setting is None:
        return None
    if isinstance(setting, CloudEvents):
        return setting
    raise ConfigurationError(f"cloudevents must be True, False or a CloudEvents, got {setting!r:.80}")
