"""``Relay``: moves committed outbox rows to the broker, per key in seq order.

A relay is one ``RelayStep`` (``_step``: its leases, wheel, batch runner and
stuck-key watch, one step at a time) and this loop around it: configuration
checked at construction, a step whenever NOTIFY, the wheel's next timer or the
poll interval says so (again at once after a full batch), the lease thread,
and a graceful stop. What happens inside one batch, and why it keeps per-key
order, is in ``_batch``.

A database or broker outage is not a failure: the loop waits it out with
capped backoff and ``outbox.core._outage`` logs it once when it starts and once when it
ends. The backlog gauges have a thread of their own, so their GROUP BY never
delays lease renewal.

``run`` loops until ``stop`` (or SIGTERM/SIGINT): it finishes the batch in hand
(the transport bounds the wait for delivery reports), marks it, releases its
leases and returns, so a process running it exits 0. The release runs on a
closer of its own, waited for ``RELEASE_WITHIN`` seconds at most (``_closers``,
as a fleet's): a database that holds it (frozen, the lease table locked) leaves
the leases to their TTL, and the stop's last line names them. The loop runs on
a thread of its own (``outbox.core._stopping``), so ``run`` returns at most
``stop_timeout`` seconds after the stop even when the broker and the database
are both gone: what the loop has not finished by then is left behind (rows sent
but not marked are sent again, leases expire within their TTL).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable

import tenacity
from sqlalchemy import Engine

from transports import Transport
from transports._logsafe import safe_logger

from ..core._alerts import Alert, AlertSink, LoggingAlertSink
from ..core._cloudevents import CloudEvents
from ..core._envelope import utcnow
from ..core._errors import ConfigurationError, SchemaError
from ..core._outage import OutageBackoff, is_database_outage
from ..core._stopping import STOP_TIMEOUT, BoundRun, Fatal
from ..core._wheel import TimingWheel
from ..producer import Outbox
from ._admin import backlog
from ._batch import BatchResult
from ._closers import RELEASE_WITHIN, Closers
from ._exactly_once import DEFAULT_PROGRESS_TOPIC
from ._leases import Leases, renew_interval, renewal_watched
from ._metrics import RelayMetrics, relay_metrics
from ._session import relay_engine
from ._settings import (
    DEFAULT_BACKOFF,
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BATCH_BYTES,
    RelaySettings,
    cloudevents_mode,
    default_worker_id,
)
from ._step import RelayOutages, RelayStep
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
    and counts in ``outbox_relay_stuck_keys`` (``_stuck``; checked every lease
    renewal interval). ``run`` and ``run_once`` must be called from one thread;
    ``stop`` from any. The tuning keywords (``batch_size`` … ``key_stuck_after``)
    build a ``RelaySettings``, kept as ``relay.settings``, which checks each of
    them and names a bad one. ``cloudevents=True`` (or a ``CloudEvents`` naming
    the source) adds the CloudEvents binary-mode ``ce_*`` headers to every record
    (docs/cloudevents.md); the ``outbox-*`` envelope is sent either way.
    ``exactly_once=True`` makes each shard's batch one Kafka transaction with a
    progress record on ``progress_topic`` (``_exactly_once``; docs/relay.md,
    "Exactly once on the wire"): it needs a transport with transactions
    (``KafkaTransport``), and read_committed consumers.

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
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
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
        exactly_once: bool = False,
        progress_topic: str = DEFAULT_PROGRESS_TOPIC,
    ) -> None:
        if not isinstance(outbox, Outbox):
            raise ConfigurationError(f"Relay needs an Outbox, got {type(outbox).__name__}")
        if not callable(getattr(transport, "publish", None)):
            raise ConfigurationError(f"transport {transport!r} has no publish(records) method")
        bound = engine if engine is not None else outbox.engine
        if not isinstance(bound, Engine):
            raise ConfigurationError("Relay needs a sync Engine: pass engine=create_engine(url)")
        self.settings = settings = RelaySettings(
            batch_size=batch_size, max_batch_bytes=max_batch_bytes,
            worker_id=worker_id or default_worker_id(), lease_ttl=lease_ttl,
            poll_interval=poll_interval, backoff=backoff, backlog_metrics=backlog_metrics,
            wheel_tick=wheel_tick, key_stuck_after=key_stuck_after, exactly_once=exactly_once,
            progress_topic=progress_topic)
        self.worker_id = settings.worker_id
        self.alert = alert if alert is not None else LoggingAlertSink()
        if not callable(self.alert):
            raise ConfigurationError(f"alert must be an AlertSink or callable, got {self.alert!r}")
        self.outbox = outbox
        self.transport = transport
        self.engine = relay_engine(bound)
        self.metrics = metrics or relay_metrics()
        # The loop's pause after a failed step (an outage or not) grows from the poll interval.
        self._failure_backoff = OutageBackoff(first=settings.poll_interval)
        self.outages = RelayOutages(
            database=RelayOutages.tracker(f"relay {self.worker_id}: database", "database", self.metrics,
                                          self._failure_backoff),
            broker=RelayOutages.tracker(f"relay {self.worker_id}: broker", "broker", self.metrics))
        self._wakeup = Wakeup()
        self._runs = BoundRun(f"relay {self.worker_id}", thread="outbox-relay-loop", log=log,
                              wake=self._wakeup.set)
        self._stopping = self._runs.stopping
        self._step = RelayStep(outbox, transport, self.engine, settings, alert=self.alert,
                               metrics=self.metrics, outages=self.outages,
                               cloudevents=cloudevents_mode(cloudevents), stopping=self._stopping)
        self._backlog_topics: set[str] = set()
        self._fatal = Fatal()
        # Through a weak reference: the relay holding closers that hold it was a cycle, and a relay
        # dropped after its run kept its transport's clients until the cycle collector ran.
        me = weakref.ref(self)

        def give_back(step: RelayStep) -> bool:
            relay = me()
            return relay is not None and relay._give_back(step)

        def given_back_late(steps: list[RelayStep], seconds: float) -> None:
            if (relay := me()) is not None:
                relay._given_back_late(steps, seconds)

        self._closers: Closers[RelayStep] = Closers(give_back, late=given_back_late)
        self._threads: list[threading.Thread] = []
        """The lease and backlog threads of the last ``run``: its closer waits for them to end."""
        self._released = False
        """The last ``run``'s closer gave the leases back."""

    def __repr__(self) -> str:
        return f"Relay(worker_id={self.worker_id!r}, transport={self.transport!r})"

    @property
    def leases(self) -> Leases:
        """Its shard leases (``Leases``): which shards it holds now, its fair share."""
        return self._step.leases

    @property
    def wheel(self) -> TimingWheel[tuple[str, str]]:
        """The keys waiting for their next attempt; read it from the thread that runs it."""
        return self._step.wheel

    @property
    def stuck_keys(self) -> StuckKeys:
        return self._step.stuck_keys

    # -- one batch ------------------------------------------------------------

    def run_once(self) -> BatchResult:
        """Fetch, send and mark one batch; returns what happened.

        Without ``run`` (tests, embedding) the leases are maintained here, at
        most every TTL/3.
        """
        return self._step.run_once()

    # -- the loop ---------------------------------------------------------------

    def run(self, *, stop_timeout: float = STOP_TIMEOUT) -> None:
        """Publish until ``stop()`` or SIGTERM/SIGINT; then drain, release leases, return.

        Returns at most ``stop_timeout`` seconds after the stop, whatever is down.
        """
        self._fatal.clear()
        self._runs.run(self._run, stop_timeout=stop_timeout)

    def _run(self) -> None:
        # The release of a run before that outlived its stop goes on: leases taken before it
        # ends would be given back by it. Said once: until it ends, the relay does nothing.
        if self._closers.going():
            log.warning("relay %s waits for the release of its previous run's leases (its database "
                        "is slow or does not answer) before it takes any", self.worker_id)
        while self._closers.going() and not self._stopping.wait(0.1):
            pass
        # Its threads' own end, set with the stop and never cleared: a thread still in a call when
        # ``run`` returns (and the stop is cleared for the next run) ends once the call does.
        ended = threading.Event()
        threads = self._threads = []
        try:
            if not self._first_leases():
                return  # stopped while waiting for the database
            threads.append(threading.Thread(target=self._lease_loop, args=(ended,),
                                            name="outbox-relay-leases", daemon=True))
            if self.settings.backlog_metrics:
                # Its own thread: a GROUP BY over a large backlog must never delay lease renewal.
                threads.append(threading.Thread(target=self._backlog_loop, args=(ended,),
                                                name="outbox-relay-watch", daemon=True))
            for thread in threads:
                thread.start()
            # After the lease thread starts: the check waits up to the transaction timeout (30 s) for a
            # broker that does not answer, three lease TTLs by default; leases it let lapse were taken
            # by another relay, and this one's first batch found them gone.
            self._step.check_progress_topic()  # a progress topic not compacted refused before any send
            # Stopped in that check (a broker wait a stop ends): the run never started, but a stop
            # of the lease thread's fatal error (a reshard behind its back) is raised all the same.
            if not self._stopping.is_set():
                if self.outbox.notify_channel:
                    self._wakeup.listen(self.engine, self.outbox.notify_channel)
                log.info("relay %s started with shards %s", self.worker_id, sorted(self.leases.owned()))
                self._loop()
        finally:
            self._stopping.set()
            ended.set()
            self._wakeup.close()
            self._released = False
            if self._closers.close_within([self._step], group=id):  # on a closer (one group: its database)
                log.warning("relay %s stopped; its leases of shards %s were not given back within %gs "
                            "(its database is slow or does not answer): the release goes on, and "
                            "leases it cannot give back expire within the lease TTL", self.worker_id,
                            sorted(self.leases.owned()), RELEASE_WITHIN)
            elif self._released:
                log.info("relay %s stopped; leases released", self.worker_id)
        # After the wind-down, which waited for the lease thread: a renewal under way when a stop
        # came from outside can still find the count changed, and that error was lost when it came
        # after this check (the run returned, the command exited 0). A release that outlived its
        # bound still holds that thread; what it finds then is only logged.
        self._fatal.raise_if_set()

    def _give_back(self, step: RelayStep) -> bool:
        """On the closer: once the lease and backlog threads ended (a renewal in hand holds the
        leases' lock), the last batch marked and the leases given back; whether they were."""
        for thread in self._threads:
            thread.join()
        self._released = step.release()
        return self._released

    def _given_back_late(self, _steps: list[RelayStep], seconds: float) -> None:
        """The release a stop said goes on gave the leases back in the end."""
        log.info("relay %s gave its leases back %.1fs after its release began", self.worker_id, seconds)

    def _first_leases(self) -> bool:
        """Take the first leases, waiting out a database outage; False if stopped meanwhile.

        A relay started while the database is down waits for it (one log line each
        way, like any outage) instead of exiting; any other error is raised.
        """
        while not self._stopping.is_set():
            try:
                with self._told_if_unanswered():
                    self._step.maintain_leases()
                return True
            except Exception as exc:
                if not is_database_outage(exc):
                    raise
                self._stopping.wait(self.outages.database.failed(exc))
        return False

    def _loop(self) -> None:
        poll_due = 0.0
        due: float | None = None
        again = True
        failures = 0
        while not self._stopping.is_set():
            mono = time.monotonic()
            if again or mono >= poll_due or (due is not None and mono >= due):
                poll_due = mono + self.settings.poll_interval
                try:
                    # Pipelined: this batch's outcomes are written while the next one runs.
                    step = self._step.run(wait=False, leases=False)
                except ConfigurationError as exc:  # a progress topic found not compacted: not an outage
                    self._fatal.set(exc)
                    return
                except Exception as exc:
                    self._step.report(exc, "batch failed")
                    failures += 1
                    self._stopping.wait(self._failure_backoff.delay(failures))
                    again = True
                    continue
                failures = 0
                due, again = step.due, step.again
                if again:
                    continue
            wake_at = poll_due if due is None else min(poll_due, due)
            again = self._wakeup.wait(max(0.0, wake_at - time.monotonic()))

    def _lease_loop(self, ended: threading.Event) -> None:
        interval = renew_interval(self.leases.ttl)
        while not ended.wait(interval):
            try:
                before = set(self.leases.owned())
                with self._told_if_unanswered():
                    after = self._step.maintain_leases()
                if set(after) - before or self.leases.surplus:
                    self._wakeup.set()  # new shards to serve, or surplus to give back
            except SchemaError as exc:
                log.error("relay %s: %s", self.worker_id, exc)
                self._fatal.set(exc)
                self.stop()
                return
            except Exception as exc:
                self._step.report(exc, "could not maintain its leases")

    def _told_if_unanswered(self) -> contextlib.AbstractContextManager[None]:
        """A lease renewal unanswered for the lease TTL is a database outage (``renewal_watched``),
        unless the run it began in is stopping or has returned meanwhile (its loop left behind or
        not): its last line says it stopped."""
        return renewal_watched(self.outages.database.failed, self.leases.ttl,
                               unless=self._runs.run_end.over(self._stopping))

    def _backlog_loop(self, ended: threading.Event) -> None:
        """Every lease renewal interval: the backlog gauges."""
        interval = renew_interval(self.leases.ttl)
        while not ended.wait(interval):
            try:
                self.refresh_backlog_metrics()
            except Exception as exc:
                self._step.report(exc, "could not watch its backlog")

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
        self._runs.stop()

    def close(self) -> None:
        """Release leases held from ``run_once`` calls (``run`` does this itself); raises what the
        database raised.

        After a ``run`` whose release outlived its stop, it waits for that release
        (``RELEASE_WITHIN`` seconds at most) instead of starting another beside it.
        While a loop of ``run`` still runs (left behind at its stop, in a broker or
        database call), it touches nothing: that loop's batch still sends with
        these leases and producers, and closing them under it released the leases
        before the batch marked its rows (fenced: sent again) and closed an
        exactly-once producer mid-transaction. The loop gives them back itself
        when its call returns; until then its lease thread renews them (its batch's
        marks must hold), so a call that never returns holds them, and the relay's
        heartbeat, for as long as the process lives.
        """
        if self._runs.loop_running:  # its own end gives them back (``_run``)
            log.warning("relay %s: close() leaves its leases to the loop of run(), which still runs "
                        "(left behind at its stop in a broker or database call, or not stopped): it "
                        "gives them back when it ends, and renews them until then", self.worker_id)
            return
        self._closers.close_within([self._step], group=lambda _: None, at_once=lambda step: step.close())
