"""``TenantRelay``: one relay process for many tenants' outboxes, instead of a relay per tenant.

Each tenant keeps everything a ``Relay`` has: its tables, its shard leases
(so several processes split every tenant's shards, and a dead one's shards
pass to the others as with one tenant), its timing wheel and its per-key
order. What the tenants share is what made a relay per tenant expensive:

- **connections**: one pool per database, bounded (``pool_size``), whatever
  the number of schemas in it, plus one LISTEN connection per database that
  wakes the tenant a notification names (its payload is ``shard:schema``);
- **workers**: ``workers`` threads, each with its own transport (a producer
  is used by one thread), take the tenants with work from one queue. A tenant
  is run by at most one worker at a time, one batch per turn, and goes to the
  back of the queue when it has more: a tenant draining a million rows holds
  one worker, and a quiet tenant's message waits at most for the batches of
  the tenants queued before it, never for that backlog;
- **failures stay with their tenant**: a tenant whose tables are missing or
  broken is logged once and retried with backoff; a database that is down
  is logged once (all its tenants share one outage tracker), probed by one
  batch at a time, and its tenants are woken when it answers. The other
  tenants go on meanwhile.

Tenants come from a ``TenantSource`` called again every ``refresh_every``
seconds: new ones start being served, removed ones finish their batch,
release their leases and are dropped. Each record gets the tenant's name in
the header ``tenant_header`` (when given), replacing any header of that name
(in any case) the producer set, so no tenant can send under another's name.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import tenacity
from sqlalchemy import Engine, make_url
from sqlalchemy.exc import ArgumentError

from transports import Record, SendResult, Transport
from transports._logsafe import safe_logger

from .._alerts import Alert, AlertSink, LoggingAlertSink, alerts_for_tenant
from .._cloudevents import CloudEvents
from .._engine import create_engine
from .._errors import ConfigurationError, SchemaError
from .._notify import parse_notify_payload
from .._outage import RELAY_WORDING, OutageBackoff, OutageTracker, first_line, is_database_outage
from .._outbox import Outbox
from .._secrets import database_url
from .._stopping import STOP_TIMEOUT, RunOnce, run_with_stop_bound
from .._tables import OutboxTables
from .._tenant import Tenant, TenantsLike, TenantSource, tenant_source
from .._tenant_labels import TenantLabels
from .._wire import header_size
from ..relay import (
    BatchResult,
    Relay,
    RelaySettings,
    TenantRelayMetrics,
    relay_metrics,
    tenant_relay_metrics,
)
from ..relay._leases import renew_interval
from ..relay._settings import DEFAULT_BACKOFF, default_worker_id
from ..relay._wakeup import start_listening

log = safe_logger("outbox.relay")

_TENANT_BACKOFF = OutageBackoff(first=1.0, cap=60.0)
"""How a tenant that fails for a reason of its own (missing tables) is retried: 1 s doubling to 60 s."""

_POLL_SHARE = 4
"""One turn in this many serves a polled tenant when woken tenants wait too."""

_RELEASE_WITHIN = 3.0
"""Seconds a stop or ``close()`` waits for the tenants' leases to be given back, all databases at once."""


class TenantRelay:
    """Publishes many tenants' outbox rows from one process; see the module doc.

    ``tenants`` is a list (``Tenant``s, or schema names of ``database``), a
    callable returning one, or a ``TenantSource`` (``schemas_like``,
    ``from_query``, ``from_file``). ``transport`` makes a transport: it is
    called once per worker. ``database`` is the database (a URL or an
    ``Engine``) of tenants that do not name their own. The tuning keywords are
    ``Relay``'s, per tenant; ``poll_interval`` is how often each tenant is
    polled when no notification came (PostgreSQL notifies; elsewhere it is the
    latency), and ``lease_ttl`` is longer than a single relay's because one
    process renews every tenant's leases.
    """

    def __init__(
        self,
        tenants: TenantsLike | TenantSource,
        transport: Callable[[], Transport],
        *,
        database: str | Engine | None = None,
        workers: int = 2,
        tenant_header: str | None = None,
        refresh_every: float = 30.0,
        pool_size: int | None = None,
        prefix: str = "",
        notify_channel: str | None = "outbox",
        worker_id: str | None = None,
        alert: AlertSink | Callable[[Alert], None] | None = None,
        metrics: TenantRelayMetrics | None = None,
        batch_size: int = 1000,
        lease_ttl: float = 30.0,
        poll_interval: float = 2.0,
        backoff: tenacity.wait.wait_base = DEFAULT_BACKOFF,
        wheel_tick: float = 0.02,
        key_stuck_after: float = 300.0,
        cloudevents: CloudEvents | bool = False,
    ) -> None:
        if not callable(transport) or callable(getattr(transport, "publish", None)):
            raise ConfigurationError(
                "TenantRelay needs a callable that makes a transport (one per worker thread: a "
                "producer is used by one thread), e.g. lambda: KafkaTransport(...)")
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise ConfigurationError(f"workers must be an int from 1 to 64, got {workers!r}")
        if (isinstance(refresh_every, bool) or not isinstance(refresh_every, int | float)
                or not refresh_every > 0):
            raise ConfigurationError(f"refresh_every must be positive seconds, got {refresh_every!r}")
        if pool_size is not None and (isinstance(pool_size, bool) or not isinstance(pool_size, int)
                                      or pool_size < workers + 1):
            raise ConfigurationError(
                f"pool_size must be an int of at least workers + 1 = {workers + 1} (the workers and "
                f"the lease renewals), got {pool_size!r}")
        self.settings = RelaySettings(
            batch_size=batch_size, worker_id=worker_id or default_worker_id(), lease_ttl=lease_ttl,
            poll_interval=poll_interval, backoff=backoff, wheel_tick=wheel_tick,
            key_stuck_after=key_stuck_after)
        self.worker_id = self.settings.worker_id
        self.tenant_header = _checked_header(tenant_header)
        self.source = tenant_source(tenants)
        self.workers = workers
        self.refresh_every = float(refresh_every)
        self.pool_size = pool_size or workers + 2
        self.alert = alert if alert is not None else LoggingAlertSink()
        if not callable(self.alert):
            raise ConfigurationError(f"alert must be an AlertSink or callable, got {self.alert!r:.80}")
        # Per tenant, the label bounded by a policy (TenantLabels: the first 100 tenants by name);
        # what belongs to the process (the broker, a database's outages) in the plain families.
        self.metrics = metrics if metrics is not None else tenant_relay_metrics(TenantLabels())
        if not isinstance(self.metrics, TenantRelayMetrics):
            raise ConfigurationError(
                f"metrics must be a TenantRelayMetrics (tenant_relay_metrics(...)), got {metrics!r:.80}")
        self._process_metrics = relay_metrics(self.metrics.registry)
        self._relay_options: dict[str, Any] = dict(
            batch_size=batch_size, lease_ttl=lease_ttl, poll_interval=poll_interval, backoff=backoff,
            wheel_tick=wheel_tick, key_stuck_after=key_stuck_after, cloudevents=cloudevents,
            worker_id=self.worker_id)
        self._tables = OutboxTables(prefix=prefix)
        self.notify_channel = notify_channel
        self._default = database
        self._databases: dict[str, _Database] = {}
        self._units: dict[str, _Unit] = {}
        self._transports = [transport() for _ in range(workers)]
        for made in self._transports:
            if not callable(getattr(made, "publish", None)):
                raise ConfigurationError(f"transport() returned {made!r:.80}, which has no publish(records)")
        self._local = threading.local()
        self.broker_outage = OutageTracker(
            f"relay {self.worker_id}: broker", log=log, wording=RELAY_WORDING,
            count=self._process_metrics.outages.labels("broker").inc)
        self._lock = threading.Condition()
        self._ready: deque[_Unit] = deque()
        """Tenants woken by a notification, a wheel timer or a full batch: served first, in turn."""
        self._polls: deque[_Unit] = deque()
        """Tenants whose poll is due (or woken after an outage): every ``_POLL_SHARE``-th turn."""
        self._turn = 0
        self._timers: list[tuple[float, int, _Unit, int]] = []
        self._timed: set[_Unit] = set()
        self._order = itertools.count()
        self._stopping = threading.Event()
        self._runs = RunOnce(self._stopping, f"relay {self.worker_id}")
        self._refreshed = threading.Event()
        self._unfrozen: set[_Unit] = set()
        """Tenants built since the heap was last frozen (``_freeze_new_tenants``)."""

    def __repr__(self) -> str:
        return f"TenantRelay(worker_id={self.worker_id!r}, tenants={len(self._units)})"

    # -- what it serves --------------------------------------------------------

    @property
    def tenants(self) -> list[str]:
        """The names of the tenants being served now (those whose tables were read)."""
        with self._lock:
            return sorted(name for name, unit in self._units.items() if unit.relay is not None)

    def problem(self) -> str | None:
        """Why this process is not ready (``/readyz``), or None: its tenants read, a database of them up.

        One tenant failing on its own (missing tables), or one database of
        several being down, does not make the process unready: the other
        tenants are served, and the failure is logged. Every database down does.
        """
        if not self._refreshed.is_set():
            return "has not read its tenants yet"
        databases = list(self._databases.values())
        down = sum(1 for db in databases if db.down)
        if databases and down == len(databases):
            return f"all {down} of its databases are unreachable"
        return None

    def relay_of(self, name: str) -> Relay | None:
        """The ``Relay`` serving tenant ``name``, if it is served (for its leases, wheel and settings)."""
        unit = self._units.get(name)
        return unit.relay if unit is not None else None

    def refresh(self) -> None:
        """Read the tenants again: start serving new ones, drop removed ones. ``run`` calls it."""
        try:
            wanted = {tenant.name: tenant for tenant in self.source()}
        except Exception as exc:
            if is_database_outage(exc):
                log.warning("relay %s: cannot read its tenants (%s); keeps serving the ones it has",
                            self.worker_id, first_line(exc))
                return
            raise
        self._refuse_shared_places(wanted.values())
        with self._lock:
            gone = [unit for name, unit in self._units.items()
                    if name not in wanted or wanted[name].place != unit.tenant.place]
            for unit in gone:
                del self._units[unit.tenant.name]
                unit.removed = True
                if unit.state == "queued":  # out of the queue: no worker starts it while it is closed
                    (self._polls if unit.polled else self._ready).remove(unit)
                    unit.state = "idle"
            # Decided under the lock: a running one is closed by its worker, the others here.
            closing = [unit for unit in gone if unit.state != "running"]
            new = [tenant for name, tenant in wanted.items() if name not in self._units]
        for unit in gone:
            log.info("relay %s: tenant %s removed", self.worker_id, unit.tenant.name)
            self.metrics.forget(unit.tenant.name)
        for unit in closing:
            self._close_unit(unit)
        for tenant in new:
            unit = _Unit(tenant, self._database_of(tenant))
            with self._lock:
                self._units[tenant.name] = unit
                unit.db.units[tenant.schema] = unit
        self._start_pending()
        self._refreshed.set()

    def _refuse_shared_places(self, tenants: Iterable[Tenant]) -> None:
        """Two tenants in one schema of one database, one named by URL and one by the default: refused.

        The source's own check compares what the tenants say; this one what they
        resolve to. Served twice, a schema's rows would go out under two names,
        by two Relays of one worker id, which do not fence each other.
        """
        places: dict[tuple[str, str | None], str] = {}
        for tenant in tenants:
            database = tenant.database if tenant.database is not None else self._default
            if database is None:
                continue  # refused by name when it is served
            try:
                url = database.url if isinstance(database, Engine) else make_url(database)
            except ArgumentError:  # not the URL itself: it may hold a password
                raise ConfigurationError(f"tenant {tenant.name}: its database is not a URL") from None
            place = (url.render_as_string(hide_password=False), tenant.schema)
            if place in places:
                raise ConfigurationError(
                    f"tenants {places[place]!r} and {tenant.name!r} name the same schema of one database")
            places[place] = tenant.name

    def _start_pending(self) -> None:
        """Build the ``Relay`` of every tenant that has none yet: reads its stored settings."""
        for unit in list(self._units.values()):
            if unit.relay is not None or unit.removed or time.monotonic() < unit.retry_at:
                continue
            db = unit.db
            if db.down and time.monotonic() < db.retry_at:
                continue
            try:
                unit.relay = self._new_relay(unit)
            except Exception as exc:
                self._tenant_failed(unit, exc, "cannot be served")
                continue
            if db.down:
                self._database_back(db)
            self._tenant_ok(unit)
            log.info("relay %s: serving tenant %s", self.worker_id, unit.tenant.name)
            with self._lock:
                self._unfrozen.add(unit)
            self._wake(unit)

    def _new_relay(self, unit: _Unit) -> Relay:
        """The tenant's ``Relay``: the fleet's schema-less tables, put in its schema by a translate map.

        One set of tables, so one set of statements (``statements_for``) and one
        compiled form per database, whatever the number of tenants: with the
        schema in each tenant's tables, 500 tenants built and compiled 500 sets
        of statements (SQLAlchemy's compiled cache holds 500), about a megabyte
        and a compile of the fetch per tenant.
        """
        engine = unit.db.engine
        if unit.tenant.schema is not None:
            engine = engine.execution_options(schema_translate_map={None: unit.tenant.schema})
        outbox = Outbox(engine, tables=self._tables, notify_channel=self.notify_channel)
        name = unit.tenant.name
        return Relay(outbox, _TenantTransport(self, name), engine=engine,
                     alert=alerts_for_tenant(self.alert, name), metrics=self.metrics.for_tenant(name),
                     database_outage=unit.db.outage, **self._relay_options)

    def _database_of(self, tenant: Tenant) -> _Database:
        database = tenant.database if tenant.database is not None else self._default
        if database is None:
            raise ConfigurationError(
                f"tenant {tenant.name} names no database and the TenantRelay has no default database")
        key = database if isinstance(database, str) else f"engine:{id(database)}"
        db = self._databases.get(key)
        if db is None:
            engine = (database if isinstance(database, Engine)
                      else create_engine(database, pool_size=self.pool_size, max_overflow=0))
            shown = database_url(database if isinstance(database, str) else str(database.url))
            db = _Database(engine, owned=not isinstance(database, Engine), outage=OutageTracker(
                f"relay {self.worker_id}: database {shown}", log=log, wording=RELAY_WORDING,
                backoff=OutageBackoff(first=self.settings.poll_interval / 4, cap=5.0),
                count=self._process_metrics.outages.labels("database").inc))
            self._databases[key] = db
            if not self._stopping.is_set() and self._listening and self.notify_channel is not None:
                self._listen(db)
        return db

    # -- the loop ---------------------------------------------------------------

    _listening = False
    _runs_started = False

    def run(self, *, stop_timeout: float = STOP_TIMEOUT) -> None:
        """Publish until ``stop()`` or SIGTERM/SIGINT; then finish the batches in hand, release leases.

        Returns at most ``stop_timeout`` seconds after the stop, whatever is down.
        """
        self._runs_started = True

        def start() -> threading.Thread | None:
            return run_with_stop_bound(self._run, stop=self.stop, stopping=self._stopping.is_set,
                                       name="outbox-tenant-relay", what=f"relay {self.worker_id}", log=log,
                                       stop_timeout=stop_timeout)
        self._runs.run(start)

    def _run(self) -> None:
        workers = [threading.Thread(target=self._work, args=(i,), name=f"outbox-relay-worker-{i}",
                                    daemon=True) for i in range(self.workers)]
        refresher = threading.Thread(target=self._refresh_loop, name="outbox-relay-tenants", daemon=True)
        try:
            self._listening = True
            for db in list(self._databases.values()):
                self._listen(db)
            refresher.start()
            for worker in workers:
                worker.start()
            log.info("relay %s started for many tenants with %d workers", self.worker_id, self.workers)
            self._clock()
        finally:
            self._stopping.set()
            with self._lock:  # from here on no worker takes a tenant from the queue
                self._lock.notify_all()
                idle = [unit for unit in self._units.values() if unit.state != "running"]
            # The tenants no worker holds give their leases back at once, before the workers are
            # waited for: a worker stuck on a frozen database must not keep the others' leases.
            self._close_units(idle)
            for worker in workers:
                if worker.ident is not None:
                    worker.join()
            deadline = time.monotonic() + _RELEASE_WITHIN
            # A tenants source or listener that hangs (its database frozen) does not hold the stop.
            for thread in (refresher, *(db.listener for db in list(self._databases.values()))):
                if thread is not None and thread.ident is not None:
                    thread.join(max(0.0, deadline - time.monotonic()))
            self._close_units(list(self._units.values()))
            log.info("relay %s stopped; leases released", self.worker_id)

    def _refresh_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.refresh()
            except Exception as exc:
                log.error("relay %s: cannot read its tenants: %s; keeps serving the ones it has",
                          self.worker_id, first_line(exc))
            self._freeze_new_tenants()
            # Tenants that could not start (their database down, tables missing) are tried again sooner.
            deadline = time.monotonic() + self.refresh_every
            while not self._stopping.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    break
                self._start_pending()
                self._freeze_new_tenants()

    def _freeze_new_tenants(self) -> None:
        """Freeze the heap again once the tenants built since have served a batch, if it was frozen.

        ``outbox relay`` freezes what it loaded before ``run`` (``tune_gc_for_batches``),
        but the tenants' relays, and the statements of their first batch, are built
        inside ``run``: for 500 tenants some 2.8 million objects that every full
        collection walked, a 1.5 s pause of every worker, which a quiet tenant's
        message waited out next to a backlog (docs/benchmarks.md, "Many tenants").
        A process that never froze its heap is left as it is: a library does not
        change interpreter-wide settings on its own.
        """
        with self._lock:
            if not self._unfrozen or not gc.get_freeze_count():
                return
            if any(unit.relay is not None and not unit.removed and not unit.served
                   for unit in self._unfrozen):
                return
            self._unfrozen.clear()
        gc.collect()
        gc.freeze()

    def _clock(self) -> None:
        """Wake tenants whose poll, retry or wheel timer is due, until the stop."""
        tick = self.settings.wheel_tick
        while not self._stopping.is_set():
            now = time.monotonic()
            with self._lock:
                while self._timers and self._timers[0][0] <= now:
                    _, _, unit, generation = heapq.heappop(self._timers)
                    if generation == unit.generation:
                        self._wake_locked(unit, poll=True)
                for unit in list(self._timed):  # the tenants with keys waiting for a retry
                    relay = unit.relay
                    if relay is None or not len(relay.wheel) or unit.removed:
                        self._timed.discard(unit)
                    elif unit.state == "idle" and relay.wheel.advance(now):
                        self._wake_locked(unit)
                timed = bool(self._timed)
                nxt = self._timers[0][0] if self._timers else now + 0.1
            self._stopping.wait(min(0.1, tick if timed else 0.1, max(0.0, nxt - time.monotonic())))

    def _work(self, index: int) -> None:
        self._local.transport = self._transports[index]
        while True:
            with self._lock:
                while not self._ready and not self._polls and not self._stopping.is_set():
                    self._lock.wait(0.5)
                if self._stopping.is_set():
                    return
                unit = self._next_locked()
                unit.state = "running"
                unit.again = False
            again, delay = self._serve(unit)
            with self._lock:
                unit.state = "idle"
                # Removed, or the fleet stops: its leases go back now, as soon as its batch is done,
                # not once every worker is (one may be stuck on a frozen database).
                if unit.removed or self._stopping.is_set():
                    closing = True
                else:
                    closing = False
                    if again or unit.again:
                        self._wake_locked(unit)
                    else:
                        # Polled at least every lease renewal interval: an idle tenant's leases are
                        # renewed by its polls, and must not lapse between them.
                        poll = min(self.settings.poll_interval, renew_interval(self.settings.lease_ttl))
                        self._schedule_locked(unit, delay if delay is not None else poll)
            if closing:
                self._close_unit(unit)

    def run_once(self) -> dict[str, BatchResult]:
        """One batch for every tenant served, one after the other, on this thread (tests, embedding)."""
        if not self._refreshed.is_set():
            self.refresh()
        self._local.transport = self._transports[0]
        results = {}
        for unit in list(self._units.values()):
            if unit.relay is not None:
                self._serve(unit)
                results[unit.tenant.name] = unit.last
        return results

    def _serve(self, unit: _Unit) -> tuple[bool, float | None]:
        """One batch of ``unit``'s tenant; (more may be waiting, seconds until it should be tried again)."""
        relay, db = unit.relay, unit.db
        unit.last = BatchResult()
        if relay is None:
            return False, None
        with self._lock:  # a database that is down is probed by one batch at a time
            now = time.monotonic()
            if db.down and (db.probing or now < db.retry_at):
                return False, max(0.2, db.retry_at - now)
            probe = db.probing = db.down
        try:
            batch = relay.run_once()
            unit.served = True
            if now >= unit.watch_at:
                # A key is stuck after minutes (key_stuck_after): a check per tenant every fifth of
                # that is on time, and 500 tenants do not query every lease renewal interval.
                unit.watch_at = now + max(relay.leases.ttl / 3, relay.settings.key_stuck_after / 5)
                relay.stuck_keys.check(sorted(relay.leases.owned()))
        except SchemaError as exc:  # resharded under it: served anew from the stored count
            self._tenant_failed(unit, exc, "stops")
            self._drop_relay(unit)
            return False, None
        except Exception as exc:
            if is_database_outage(exc):
                return False, self._database_down(db, exc)
            delay = self._tenant_failed(unit, exc, "failed")
            # Built anew from its stored settings when tried again: tables dropped and made again
            # have another incarnation and leases of their own, which this Relay would never see
            # (it would send their rows under the old incarnation, or be fenced for ever).
            self._drop_relay(unit, quiet=True)
            return False, delay
        finally:
            if probe:
                db.probing = False
        unit.last = batch
        if db.down:
            self._database_back(db)
        self._tenant_ok(unit)
        if batch.published:
            self.broker_outage.answered()
        elif batch.broker_unreachable:
            self.broker_outage.failed(batch.error or "no delivery report")
        if len(relay.wheel):
            with self._lock:
                self._timed.add(unit)
        return batch.fetched == relay.batch_size and batch.sent > 0, None

    def _database_down(self, db: _Database, exc: Exception) -> float:
        """Its tenants wait (logged once for all of them); the seconds until one batch probes it."""
        delay = db.outage.failed(exc)
        with self._lock:
            db.down = True
            db.retry_at = max(db.retry_at, time.monotonic() + delay)
            return max(0.0, db.retry_at - time.monotonic())

    def _database_back(self, db: _Database) -> None:
        db.outage.answered()
        with self._lock:
            db.down, db.retry_at = False, 0.0
            for unit in db.units.values():
                self._wake_locked(unit, poll=True)

    # -- scheduling --------------------------------------------------------------

    def _wake(self, unit: _Unit) -> None:
        with self._lock:
            self._wake_locked(unit)

    def _wake_locked(self, unit: _Unit, *, poll: bool = False) -> None:
        """Queue ``unit``: a poll behind the woken tenants, anything else among them.

        A tenant queued for a poll and then notified moves up to the woken ones.
        """
        if unit.relay is None or unit.removed:
            return
        if unit.state == "queued" and unit.polled and not poll:
            self._polls.remove(unit)
            unit.state = "idle"
        if unit.state == "idle":
            unit.state = "queued"
            unit.polled = poll
            unit.generation += 1  # its pending poll timer is moot
            (self._polls if poll else self._ready).append(unit)
            self._lock.notify()
        elif unit.state == "running":
            unit.again = True

    def _next_locked(self) -> _Unit:
        """The next tenant to serve: the woken ones in turn, with every ``_POLL_SHARE``-th turn a poll.

        Polls of idle tenants never delay a notified tenant by more than a turn
        in ``_POLL_SHARE``, and a busy fleet still polls (and renews the leases
        of) its idle tenants.
        """
        self._turn += 1
        if self._polls and (not self._ready or self._turn % _POLL_SHARE == 0):
            return self._polls.popleft()
        return self._ready.popleft()

    def _schedule_locked(self, unit: _Unit, delay: float) -> None:
        unit.generation += 1
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._order), unit, unit.generation))

    def _listen(self, db: _Database) -> None:
        if db.listener is not None or self.notify_channel is None:
            return
        db.listener = start_listening(db.engine, [self.notify_channel],
                                      on_notify=lambda payload: self._notified(db, payload),
                                      on_connect=lambda: self._wake_all(db), stop=self._stopping)

    def _notified(self, db: _Database, payload: str) -> None:
        """A commit in ``db``: wake the tenant of the schema the payload names (``outbox._notify``).

        Another process may NOTIFY on the channel: a payload that is not ours wakes nobody.
        """
        try:
            _, schema = parse_notify_payload(payload)
        except ValueError:
            return
        unit = db.units.get(schema)
        if unit is not None:
            self._wake(unit)

    def _wake_all(self, db: _Database) -> None:
        with self._lock:
            for unit in db.units.values():
                self._wake_locked(unit, poll=True)

    # -- failures and the end -------------------------------------------------------

    def _tenant_failed(self, unit: _Unit, exc: Exception, what: str) -> float:
        """Log a tenant's own failure once per distinct error; the seconds before it is tried again."""
        if is_database_outage(exc):
            delay = self._database_down(unit.db, exc)
            unit.retry_at = unit.db.retry_at
            return delay
        unit.failures += 1
        text = first_line(exc)
        if unit.reported != text:
            unit.reported = text
            known = isinstance(exc, SchemaError | ConfigurationError)
            log.error("relay %s: tenant %s %s: %s; the other tenants go on, it is tried again with backoff",
                      self.worker_id, unit.tenant.name, what, text, exc_info=None if known else exc)
        delay = _TENANT_BACKOFF.delay(unit.failures)
        unit.retry_at = time.monotonic() + delay
        return delay

    def _tenant_ok(self, unit: _Unit) -> None:
        if unit.reported is not None:
            log.warning("relay %s: tenant %s served again", self.worker_id, unit.tenant.name)
        unit.reported, unit.failures = None, 0

    def _drop_relay(self, unit: _Unit, *, quiet: bool = False) -> None:
        """Close the tenant's ``Relay`` (its leases given back); ``quiet``: its failure was logged."""
        relay, unit.relay = unit.relay, None
        if relay is not None:
            _close_quietly(relay, unit, self.worker_id, quiet=quiet)

    def _close_unit(self, unit: _Unit) -> None:
        with self._lock:
            if unit.db.units.get(unit.tenant.schema) is unit and unit.removed:
                del unit.db.units[unit.tenant.schema]
        if not unit.db.down:
            self._drop_relay(unit)
        else:
            unit.relay = None  # its database is down: its leases expire by their TTL

    def _close_units(self, units: list[_Unit]) -> None:
        """Close ``units`` (release their leases), each database's on a thread of its own.

        Waits at most ``_RELEASE_WITHIN`` seconds: a frozen database's tenants
        are left to their lease TTL, and never delay the others' release.
        """
        by_database: dict[int, list[_Unit]] = {}
        for unit in units:
            if unit.relay is not None:
                by_database.setdefault(id(unit.db), []).append(unit)
            else:
                self._close_unit(unit)  # nothing to release: no database call
        def close_all(group: list[_Unit]) -> None:
            for unit in group:
                self._close_unit(unit)
        closers = [threading.Thread(target=close_all, args=(group,), name="outbox-relay-release", daemon=True)
                   for group in by_database.values()]
        for closer in closers:
            closer.start()
        deadline = time.monotonic() + _RELEASE_WITHIN
        for closer, group in zip(closers, by_database.values(), strict=True):
            closer.join(max(0.0, deadline - time.monotonic()))
            if closer.is_alive():
                log.warning("relay %s: tenants %s did not give their leases back within %gs (their "
                            "database does not answer); they expire within the lease TTL", self.worker_id,
                            ", ".join(unit.tenant.name for unit in group), _RELEASE_WITHIN)

    def stop(self) -> None:
        """Ask ``run`` to finish the batches in hand and return; safe from any thread or signal."""
        self._stopping.set()

    def close(self) -> None:
        """Close the transports and the engines it made; after ``run_once`` calls, release their leases.

        After ``run`` the leases were released by ``run`` itself, or left to
        expire when a database did not answer within the stop bound: ``close``
        then touches no database, so a process stopping with one frozen exits.
        After ``run_once`` calls it waits seconds at most for a database that
        does not answer (its tenants' leases expire by their TTL).
        """
        if not self._runs_started:
            self._close_units(list(self._units.values()))
        for made in self._transports:
            close = getattr(made, "close", None)
            if callable(close):
                close(1.0)  # nothing is outstanding after a batch, unless one was left behind
        for db in self._databases.values():
            if db.owned:
                db.engine.dispose()


@dataclass(eq=False)
class _Database:
    """One database of the fleet: its engine (one pool for all its schemas), outage and listener."""

    engine: Engine
    owned: bool
    outage: OutageTracker
    units: dict[str | None, _Unit] = field(default_factory=dict)
    """Its tenants by schema, for the notifications."""
    listener: threading.Thread | None = None
    down: bool = False
    """From a batch that found it down until one that found it up (its tenants wait meanwhile)."""
    probing: bool = False
    retry_at: float = 0.0


@dataclass(eq=False)
class _Unit:
    """One tenant as the fleet serves it: its ``Relay`` and its place in the schedule."""

    tenant: Tenant
    db: _Database
    relay: Relay | None = None
    state: str = "idle"
    """idle, queued (in the ready queue) or running (on a worker): never two workers at once."""
    polled: bool = False
    """Queued for a poll (``_polls``) rather than woken (``_ready``)."""
    again: bool = False
    generation: int = 0
    removed: bool = False
    failures: int = 0
    reported: str | None = None
    retry_at: float = 0.0
    watch_at: float = 0.0
    last: BatchResult = field(default_factory=BatchResult)
    served: bool = False
    """It has run a batch: its statements are built (``_freeze_new_tenants``)."""


class _TenantTransport:
    """What a tenant's ``Relay`` publishes through: the worker's transport, with the tenant header.

    ``max_record_bytes`` is the producers' limit less the header's size, so a
    tenant whose stored record limit leaves no room for it is refused at start.
    """

    def __init__(self, fleet: TenantRelay, name: str) -> None:
        self._fleet = fleet
        self._header = fleet.tenant_header
        self._value = name.encode("ascii")
        limits = [getattr(t, "max_record_bytes", None) for t in fleet._transports]
        known = [limit for limit in limits if isinstance(limit, int)]
        if known and len(known) == len(limits):
            room = header_size(len(self._header), len(self._value)) if self._header else 0
            self.max_record_bytes = min(known) - room
            self.max_record_setting = getattr(fleet._transports[0], "max_record_setting",
                                              "its maximum record size") + (
                f", less {room} bytes for the tenant header" if room else "")

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        transport: Transport | None = getattr(self._fleet._local, "transport", None)
        if transport is None:
            raise ConfigurationError(
                "a tenant's Relay sends on the TenantRelay's worker threads: call the fleet's run() or "
                "run_once(), not the tenant's")
        header = self._header
        if header is not None:
            value = self._value
            # In any case: a consumer that looks headers up without case must not find another tenant.
            folded = header.lower()
            records = [replace(r, headers=[(n, v) for n, v in r.headers if n.lower() != folded]
                               + [(header, value)]) for r in records]
        return transport.publish(records)

    def close(self, timeout: float = 10.0) -> None:
        """Nothing: the fleet closes its workers' transports."""


def _close_quietly(relay: Relay, unit: _Unit, worker_id: str, *, quiet: bool = False) -> None:
    try:
        relay.close()
    except Exception as exc:
        if not quiet and not is_database_outage(exc):
            log.warning("relay %s: tenant %s: could not release its leases (%s); they expire within "
                        "the lease TTL", worker_id, unit.tenant.name, first_line(exc))


_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _checked_header(name: str | None) -> str | None:
    """A tenant header name: 1 to 64 of ``A-Z a-z 0-9 - _ .``, not one the envelope uses."""
    if name is None:
        return None
    if (not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= _HEADER_CHARS
            or name.lower().startswith(("outbox-", "ce_", "traceparent", "tracestate"))):
        raise ConfigurationError(
            f"invalid tenant header {name!r:.80}: use 1 to 64 of letters, digits, '-', '_' or '.', "
            "not an outbox-*, ce_* or trace header")
    return name

