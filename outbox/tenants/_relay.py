"""``TenantRelay``: one relay process for many tenants' outboxes, instead of a relay per tenant.

Each tenant keeps everything a ``Relay`` has, in a ``RelayStep`` of its own:
its tables, its shard leases (so several processes split every tenant's
shards, and a dead one's shards pass to the others as with one tenant), its
timing wheel and its per-key order. The fleet is a scheduler over those steps;
what the tenants share is what made a relay per tenant expensive:

- **connections**: one pool per database, bounded (``pool_size``), whatever
  the number of schemas in it, plus one LISTEN connection per database that
  wakes the tenant a notification names (its payload is ``shard:schema``)
  (``_databases``);
- **workers**: ``workers`` threads, lent ``producers`` transports a publish
  at a time (``_transport.Workers``), take the tenants with work from one queue. A tenant
  is run by at most one worker at a time, one step per turn, and goes to the
  back of the queue when it has more: a tenant draining a million rows holds
  one worker, and a quiet tenant's message waits at most for the batches of
  the tenants queued before it, never for that backlog (``_schedule``);
- **failures stay with their tenant**: a tenant whose tables are missing or
  broken is logged once and retried with backoff; a database that is down
  is logged once (all its tenants share one outage gate), probed by one
  step at a time, and its tenants are woken when it answers. The other
  tenants go on meanwhile;
- **a server that hangs holds half the threads at most**: it fails nothing,
  so no gate closes; when the tenants are on several servers, one server's
  steps take at most half the workers, and its pipelined writes half the
  writers (``_slots``). A tenant whose server has no slot free waits in its
  tables, and the worker serves another.

What a step does (leases, the broker's outage, the "again" rule, the
stuck-key watch, an outage-tolerant release) is the step's, as in a single
``Relay``; the fleet adds only the turns. Tenants come from a ``TenantSource``
called again every ``refresh_every`` seconds: new ones start being served,
removed ones finish their step, release their leases and are dropped. Each
record gets the tenant's name in the header ``tenant_header`` (when given),
replacing any header of that name (in any case) the producer set, so no
tenant can send under another's name (``_transport``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import tenacity
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from transports import Transport
from transports._logsafe import safe_logger
from transports._weak import weakly

from ..core import _schema
from ..core._alerts import Alert, AlertSink, LoggingAlertSink, alerts_for_tenant
from ..core._cloudevents import CloudEvents
from ..core._errors import ConfigurationError, SchemaError, UnsupportedBrokerError
from ..core._outage import first_line, is_database_outage
from ..core._stopping import STOP_TIMEOUT, BoundRun, Fatal
from ..core._tables import OutboxTables
from ..core._tenant import TenantShare, TenantsLike, TenantSource, tenant_source
from ..core._tenant_labels import TenantLabels
from ..producer import Outbox
from ..relay import (
    BatchResult,
    RelayOutages,
    RelaySettings,
    RelayStep,
    TenantRelayMetrics,
    relay_metrics,
    tenant_relay_metrics,
)
from ..relay._closers import RELEASE_WITHIN
from ..relay._exactly_once import DEFAULT_PROGRESS_TOPIC
from ..relay._leases import renew_interval
from ..relay._session import relay_engine
from ..relay._settings import DEFAULT_BACKOFF, DEFAULT_MAX_BATCH_BYTES, cloudevents_mode, default_worker_id
from ..relay._sharing import DEFAULT_MAX_SHARD_PRODUCERS, ProducerSlots
from ._databases import FleetDatabases
from ._fleet_tenants import FleetTenants, some_names
from ._idle_polls import IdlePolls
from ._schedule import Schedule, Turn
from ._shares import BacklogShares
from ._slots import SLOT_RETRY, ServerSlots
from ._transport import TenantTransport, Workers, checked_header, made_by
from ._turn_state import TurnState
from ._units import Unit

log = safe_logger("outbox.relay")

IDLE_PRODUCERS_AFTER = 30.0
"""Exactly-once mode: seconds a tenant's shard producer may send nothing before it is closed."""

class TenantRelay:
    """Publishes many tenants' outbox rows from one process; see the module doc.

    ``tenants`` is a list (``Tenant``s, or schema names of ``database``), a
    callable returning one, or a ``TenantSource`` (``schemas_like``,
    ``from_query``, ``from_file``). ``transport`` makes a transport: it is
    called ``producers`` times, and again, up to once per worker, when every one
    is held by a publish the broker keeps waiting. ``database`` is the database (a URL or an
    ``Engine``) of tenants that do not name their own. The tuning keywords are
    ``Relay``'s, per tenant, kept as one ``RelaySettings`` (``settings``);
    ``poll_interval`` is how often each tenant is polled when no notification
    can come (PostgreSQL notifies; elsewhere it is the latency; where it
    notifies, an idle tenant's polls back off to one a minute, ``_idle_polls``), and ``lease_ttl``
    is longer than a single relay's because one process renews every tenant's
    leases. ``exactly_once``: as ``Relay``'s, per tenant (docs/tenants.md); then
    ``idle_producers_after`` closes a shard producer that sent nothing for that
    long, and at most ``max_shard_producers`` are open at once (``relay._sharing``).
    ``transaction_pooled``: the databases named by URL are reached through a pooler
    in transaction mode (PgBouncer's), so the relay sets its fetch's settings per
    transaction, never on a session, and psycopg prepares no statement
    (``relay.transaction_pooled_options``, docs/operations.md); an ``Engine`` given is
    made so by whoever made it. ``share``: serve only the tenants of that
    ``TenantShare`` of the source, the others being other processes' (every
    process still reads the whole source, and refuses two tenants in one
    schema among all of them: ``FleetTenants``).
    """

    def __init__(
        self,
        tenants: TenantsLike | TenantSource,
        transport: Callable[[], Transport],
        *,
        database: str | Engine | None = None,
        workers: int = 2,
        producers: int = 2,
        tenant_header: str | None = None,
        refresh_every: float = 30.0,
        pool_size: int | None = None,
        prefix: str = "",
        notify_channel: str | None = "outbox",
        worker_id: str | None = None,
        alert: AlertSink | Callable[[Alert], None] | None = None,
        metrics: TenantRelayMetrics | None = None,
        batch_size: int = 1000,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        lease_ttl: float = 30.0,
        poll_interval: float = 2.0,
        backoff: tenacity.wait.wait_base = DEFAULT_BACKOFF,
        wheel_tick: float = 0.02,
        key_stuck_after: float = 300.0,
        cloudevents: CloudEvents | bool = False,
        exactly_once: bool = False,
        progress_topic: str = DEFAULT_PROGRESS_TOPIC,
        idle_producers_after: float = IDLE_PRODUCERS_AFTER,
        max_shard_producers: int = DEFAULT_MAX_SHARD_PRODUCERS,
        transaction_pooled: bool = False,
        share: TenantShare | None = None,
    ) -> None:
        if not callable(transport) or callable(getattr(transport, "publish", None)):
            raise ConfigurationError(
                "TenantRelay needs a callable that makes a transport (the workers share a few: a "
                "producer is lent to one worker at a time), e.g. lambda: KafkaTransport(...)")
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise ConfigurationError(f"workers must be an int from 1 to 64, got {workers!r}")
        if isinstance(producers, bool) or not isinstance(producers, int) or not 1 <= producers <= 64:
            raise ConfigurationError(f"producers must be an int from 1 to 64, got {producers!r}")
        if (isinstance(refresh_every, bool) or not isinstance(refresh_every, int | float)
                or not refresh_every > 0):
            raise ConfigurationError(f"refresh_every must be positive seconds, got {refresh_every!r}")
        if pool_size is not None and (isinstance(pool_size, bool) or not isinstance(pool_size, int)
                                      or pool_size < workers + 1):
            raise ConfigurationError(
                f"pool_size must be an int of at least workers + 1 = {workers + 1} (the workers and "
                f"the lease renewals), got {pool_size!r}")
        if share is not None and not isinstance(share, TenantShare):
            raise ConfigurationError(f"share must be a TenantShare, got {type(share).__name__}")
        self.share = share
        self.settings = settings = RelaySettings(
            batch_size=batch_size, max_batch_bytes=max_batch_bytes,
            worker_id=worker_id or default_worker_id(), lease_ttl=lease_ttl,
            poll_interval=poll_interval, backoff=backoff, wheel_tick=wheel_tick,
            key_stuck_after=key_stuck_after, exactly_once=exactly_once, progress_topic=progress_topic)
        self.worker_id = settings.worker_id
        self.tenant_header = checked_header(tenant_header)
        self.source = tenant_source(tenants)
        self.workers = workers
        self.refresh_every = float(refresh_every)
        # A worker's fetch and its writer's write of the tenant before may each hold a connection.
        self.pool_size = pool_size or 2 * workers + 2
        self.alert = alert if alert is not None else LoggingAlertSink()
        if not callable(self.alert):
            raise ConfigurationError(f"alert must be an AlertSink or callable, got {self.alert!r:.80}")
        # Per tenant, the label bounded by a policy (TenantLabels: the first 100 tenants by name);
        # what belongs to the process (the broker, a database's outages) in the plain families.
        self.metrics = metrics if metrics is not None else tenant_relay_metrics(TenantLabels())
        if not isinstance(self.metrics, TenantRelayMetrics):
            raise ConfigurationError(
                f"metrics must be a TenantRelayMetrics (tenant_relay_metrics(...)), got {metrics!r:.80}")
        process_metrics = relay_metrics(self.metrics.registry)
        self._cloudevents = cloudevents_mode(cloudevents)
        self._tables = OutboxTables(prefix=prefix)
        self.notify_channel = notify_channel
        self._default = database
        self.broker_outage = RelayOutages.tracker(f"relay {self.worker_id}: broker", "broker",
                                                  process_metrics)
        self._schedule = Schedule()
        self._slots = ServerSlots(workers, self._schedule)
        self._runs = BoundRun(f"relay {self.worker_id}", thread="outbox-tenant-relay", log=log,
                              wake=self._schedule.timer_added.set)
        self._stopping = self._runs.stopping
        # What a tenant's step met that no retry changes for any tenant (``UnsupportedBrokerError``):
        # the fleet stops and ``run`` raises it.
        self._fatal = Fatal()
        self._databases = FleetDatabases(
            database, pool_size=self.pool_size, worker_id=self.worker_id, metrics=process_metrics,
            poll_interval=settings.poll_interval, lease_ttl=settings.lease_ttl,
            notify_channel=notify_channel, schedule=self._schedule, stopping=self._stopping,
            slots=self._slots, run_end=self._runs.run_end, transaction_pooled=transaction_pooled)
        # Weakly: the registry is the fleet's, and the fleet holds the transports; a cycle would leave
        # them, librdkafka clients and all, to the cycle collector (``transports._weak``). Only the
        # fleet's own calls (refresh, its threads) reach the registry, so it is alive whenever used.
        self._tenants = FleetTenants(self.source, databases=self._databases, schedule=self._schedule,
                                     make_step=weakly(self._new_step), metrics=self.metrics,
                                     worker_id=self.worker_id, default=database, share=share)
        # A key is stuck after minutes (key_stuck_after): a check per tenant every fifth of that is
        # on time, and 500 tenants do not query every lease renewal interval.
        self._watch_every = max(renew_interval(settings.lease_ttl), settings.key_stuck_after / 5)
        # The leases are renewed per database (``_renewal``), not by the polls: idle tenants' polls
        # back off while notifications can wake them (``_idle_polls``).
        self._polls = IdlePolls(settings.poll_interval)
        # A backlog's batches shrink while another tenant has live traffic (``_shares``).
        self._shares = BacklogShares()
        self._refreshed = threading.Event()
        # The tenants a worker closed during the stop without giving their leases back: the stop's
        # last line names them with those closed by ``run`` itself.
        self._kept_at_stop: list[str] = []
        # Last: nothing after it raises, so a refused setting leaves no producer open.
        slots = ProducerSlots(max_shard_producers)  # refused before a producer is made
        self._workers = Workers(made_by(transport, min(producers, workers)),
                                exactly_once and idle_producers_after, progress_topic,
                                workers=workers, more=transport, slots=slots)

    def __repr__(self) -> str:
        return f"TenantRelay(worker_id={self.worker_id!r}, tenants={len(self._tenants.units)})"

    # -- what it serves --------------------------------------------------------

    @property
    def tenants(self) -> list[str]:
        """The names of the tenants being served now (those whose tables were read)."""
        return self._tenants.served()

    def problem(self) -> str | None:
        """Why this process is not ready (``/readyz``), or None: its tenants read, a database of them up.

        One tenant failing on its own (missing tables), or one database of
        several being down, does not make the process unready: the other
        tenants are served, and the failure is logged. Every database down does.
        """
        if not self._refreshed.is_set():
            return "has not read its tenants yet"
        return self._databases.problem()

    def relay_of(self, name: str) -> RelayStep | None:
        """The ``RelayStep`` serving tenant ``name``, if it is served (its leases, wheel and settings)."""
        unit = self._tenants.units.get(name)
        return unit.step if unit is not None else None

    def refresh(self) -> None:
        """Read the tenants again: start serving new ones, drop removed ones. ``run`` calls it."""
        self._tenants.refresh()
        self._refreshed.set()

    def _new_step(self, unit: Unit) -> RelayStep:
        """The tenant's ``RelayStep``: the fleet's schema-less tables, put in its schema by a translate map.

        One set of tables, so one set of statements (``statements_for``) and one
        compiled form per database, whatever the number of tenants: with the
        schema in each tenant's tables, 500 tenants built and compiled 500 sets
        of statements (SQLAlchemy's compiled cache holds 500), about a megabyte
        and a compile of the fetch per tenant.
        """
        engine = self._engine_of(unit)
        outbox = Outbox(engine, tables=self._tables, notify_channel=self.notify_channel)
        name = unit.tenant.name
        return RelayStep(
            outbox, TenantTransport(self._workers, self.tenant_header, name), engine,
            self.settings, alert=alerts_for_tenant(self.alert, name), metrics=self.metrics.for_tenant(name),
            outages=RelayOutages(database=unit.db.outage, broker=self.broker_outage),
            cloudevents=self._cloudevents, name=f"relay {self.worker_id}: tenant {name}",
            watch_every=self._watch_every,
            writer=self._slots.writer(unit.db, self._workers, failed=lambda: self._schedule.wake(unit),
                                      every=self.settings.poll_interval),
            sharing=self._workers.sharing, stopping=self._stopping)

    def _engine_of(self, unit: Unit) -> Engine:
        """The relay's engine on the tenant's database, its schema put in by a translate map."""
        engine = relay_engine(unit.db.engine)
        if unit.tenant.schema is not None:
            engine = engine.execution_options(schema_translate_map={None: unit.tenant.schema})
        return engine

    def _diagnosed(self, unit: Unit, exc: Exception) -> Exception:
        """A turn's failure as what it is: a statement refused for want of a table (its schema
        dropped under it) is the ``SchemaError`` the tenant's rebuild then meets, so the failure is
        logged once, not once as the driver's text and again as the rebuild's."""
        if not isinstance(exc, DBAPIError) or is_database_outage(exc):
            return exc
        try:
            with self._engine_of(unit).connect() as conn:
                _schema.read(conn, self._tables)
        except SchemaError as found:
            return found
        except Exception:  # the check failed too: the turn's own error says more
            return exc
        return exc

    # -- the loop ---------------------------------------------------------------

    _runs_started = False

    def run(self, *, stop_timeout: float = STOP_TIMEOUT) -> None:
        """Publish until ``stop()`` or SIGTERM/SIGINT; then finish the steps in hand, release leases.

        Returns at most ``stop_timeout`` seconds after the stop, whatever is down.
        """
        self._runs_started = True
        self._runs.run(self._run, stop_timeout=stop_timeout)

    def _run(self) -> None:
        workers = [threading.Thread(target=self._work, args=(i,), name=f"outbox-relay-worker-{i}",
                                    daemon=True) for i in range(self.workers)]
        refresher = threading.Thread(target=self._refresh_loop, name="outbox-relay-tenants", daemon=True)
        try:
            self._databases.start()
            refresher.start()
            for worker in workers:
                worker.start()
            log.info("relay %s started for many tenants with %d workers", self.worker_id, self.workers)
            self._clock()
        finally:
            self._stopping.set()
            with self._schedule.lock:  # from here on no worker takes a tenant from the queue
                self._schedule.lock.notify_all()
                idle = [unit for unit in self._tenants.units.values()
                        if unit.state is not TurnState.RUNNING]
            # The tenants no worker holds give their leases back at once, before the workers are
            # waited for: a worker stuck on a frozen database must not keep the others' leases.
            self._tenants.close_all(idle)
            for worker in workers:
                if worker.ident is not None:
                    worker.join()
            deadline = time.monotonic() + RELEASE_WITHIN
            # A tenants source or listener that hangs (its database frozen) does not hold the stop.
            for thread in (refresher, *self._databases.threads()):
                if thread.ident is not None:
                    thread.join(max(0.0, deadline - time.monotonic()))
            # Every tenant, the idle ones again, and those a refresh removed whose release goes on:
            # what is not given back by now (a release that failed, or one still going on), not
            # what was not given back within the first wait.
            kept = self._tenants.close_all(list(dict.fromkeys(
                [*idle, *self._tenants.units.values(), *self._tenants.releasing()])))
            kept = list(dict.fromkeys(kept + self._kept_at_stop))
            if kept:
                log.warning("relay %s stopped; %d tenants did not give their leases back (%s): they "
                            "expire within the lease TTL", self.worker_id, len(kept), some_names(kept))
            else:
                log.info("relay %s stopped; leases released", self.worker_id)
        self._fatal.raise_if_set()

    def _refresh_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.refresh()
            except Exception as exc:
                log.error("relay %s: cannot read its tenants: %s; keeps serving the ones it has",
                          self.worker_id, first_line(exc))
            self._tenants.freeze_new()
            # Tenants that could not start (their database down, tables missing) are tried again sooner.
            deadline = time.monotonic() + self.refresh_every
            while not self._stopping.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    break
                self._tenants.start_pending()
                self._tenants.freeze_new()

    def _clock(self) -> None:
        """Queue the tenants whose poll, retry or wheel timer is due, until the stop.

        One round a wheel tick at most: 500 tenants' polls come due one by one,
        and are queued a tick's worth at a time, not each on a wake-up of its own.
        """
        added, tick = self._schedule.timer_added, self.settings.wheel_tick
        while not self._stopping.is_set():
            added.clear()  # before looking: a timer added from here on ends the wait below
            due = self._schedule.fire_due()
            self._stopping.wait(tick)
            if due is not None:
                added.wait(min(1.0, max(0.0, due - time.monotonic())))
            else:
                added.wait(1.0)

    def _work(self, index: int) -> None:
        self._workers.bind(index)
        while (unit := self._schedule.take(self._stopping)) is not None:
            turn = self._serve(unit)
            with self._schedule.lock:
                unit.state = TurnState.IDLE
                # Removed, or the fleet stops: its leases go back now, as soon as its step is done,
                # not once every worker is (one may be stuck on a frozen database).
                closing = unit.removed or self._stopping.is_set()
                if not closing:
                    self._schedule.next_turn_locked(unit, turn, self._polls.every)
            if closing and self._stopping.is_set():
                # Within ``RELEASE_WITHIN`` (``close_all``): a release its database holds (frozen, its
                # lease table locked by another transaction) goes on on a closer of its own, which
                # the stop's last wait joins within the same bound. Given back here without bound,
                # it held the worker, and the stop until its own bound, whose last line never came.
                self._tenants.close_all([unit])
                if unit.kept:
                    self._kept_at_stop.append(unit.tenant.name)
            elif closing:
                self._tenants.close(unit)

    def run_once(self) -> dict[str, BatchResult]:
        """One step for every tenant served, one after the other, on this thread (tests, embedding).

        Its first call reads the tenants and waits for every one's step to be
        built, however slow a server is: a first call that returned before a slow
        database's tenants were served would step none of them, and nothing here
        builds them later (``run`` does, within a bound, between its turns).
        """
        if not self._refreshed.is_set():
            self._tenants.refresh(stalled_after=None)
            self._refreshed.set()
        results = {}
        with self._workers.bound(0):  # the caller's thread is not a worker after: it publishes nothing
            for unit in list(self._tenants.units.values()):
                if unit.step is not None:
                    self._serve(unit, wait=True)
                    results[unit.tenant.name] = unit.last
        return results

    def _serve(self, unit: Unit, *, wait: bool = False) -> Turn:
        """One step of ``unit``'s tenant in a slot of its server (``_slots``); put off when none is free."""
        unit.last = BatchResult()
        if unit.step is None:
            return Turn()
        if not self._slots.take(unit):
            return Turn(retry=SLOT_RETRY)  # woken sooner, when a slot of its server is given back
        try:
            return self._step(unit, wait=wait)
        finally:
            self._slots.give_back(unit)

    def _step(self, unit: Unit, *, wait: bool) -> Turn:
        """One step of ``unit``'s tenant, through its database's gate.

        Pipelined (``wait=False``, the workers') as a single relay is: the
        batch's outcomes are written on the workers' first free writer while the
        worker goes on with the next tenant; the tenant's next step never fetches
        those rows again, and waits for its oldest write before it adds a third
        (``_batch.WRITES_IN_FLIGHT``). Its two may run at once on two writers: their
        rows are disjoint, and the fetch leaves a write's rows out until it and
        every earlier one finished (``_transport.Workers``).
        """
        step, db = unit.step, unit.db
        if step is None:
            return Turn()
        put_off = db.gate.admit()
        if put_off is not None:
            return Turn(retry=put_off)
        started = time.monotonic()
        try:
            failure, unit.lease_failure = unit.lease_failure, None
            if failure is not None and failure[0] is step:
                raise failure[1]  # its leases could not be renewed: as if its step had failed so
            # Its first leases are its step's; then its database's renewal keeps them (``run``).
            # While notifications can wake it, a fetch that was not full reads what its backoff needs
            # (poll_within).
            shared = self._shares.limit_for(unit)
            limit = min(shared or step.settings.batch_size, step.settings.batch_size)
            with self._shares.turn(unit, shared=shared is not None):
                done = step.run(wait=wait, leases=not self._databases.started or step.needs_leases,
                                look_ahead=db.listening, probe=unit.polled, limit=limit)
            self._shares.after_turn(unit, fetched=done.batch.fetched, full=done.batch.full)
            unit.served = True
            # Rows a notification announced (it woke the tenant) need no poll after them: rows a
            # poll found may come from a writer that never notifies, which the next poll serves,
            # and rows held back behind a write in flight wait for no notification either.
            if done.batch.fetched == 0 or unit.polled:  # kept through the full batches after a poll
                unit.unannounced = done.batch.fetched > 0
            unannounced = unit.unannounced or done.batch.held > 0  # held rows were fetched
            poll_in = self._polls.after_turn(unit, unannounced=unannounced, notified=db.listening)
            if poll_in > self._polls.every and not done.again:  # rarely, but by its next delayed
                # row and stuck-key check
                poll_in = min(poll_in, step.poll_within())
        except SchemaError as exc:  # resharded under it: served anew from the stored count
            self._tenants.failed(unit, exc, "stops")
            self._tenants.drop_step(unit)
            return Turn()
        except UnsupportedBrokerError as exc:  # the fleet's broker (the mock cluster, exactly once)
            self._fatal.set(exc)
            self.stop()
            return Turn()
        except Exception as exc:
            if is_database_outage(exc):
                return Turn(retry=db.gate.failed(exc))
            delay = self._tenants.failed(unit, self._diagnosed(unit, exc), "failed")
            # Built anew from its stored settings when tried again: tables dropped and made again
            # have another incarnation and leases of their own, which this step would never see
            # (it would send their rows under the old incarnation, or be fenced for ever).
            self._tenants.drop_step(unit, quiet=True)
            return Turn(retry=delay)
        finally:
            db.gate.probed()
        unit.last = done.batch
        # Not when the step itself met an outage (its pipelined write of the batch before) and went on.
        self._databases.answered(db, started)
        # Served only if its tables answered: a step owning no shard (just rebuilt, its leases not
        # taken yet) ran no statement. Taken as served, a tenant with a table dropped (its schema
        # kept, so its rebuild succeeds) was logged "failed" and "served again" every second, and
        # its backoff never grew past the first.
        if step.leases.owned():
            self._tenants.ok(unit)
        return Turn(again=done.again, due=done.due, poll_in=poll_in)

    # -- failures and the end -------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to finish the steps in hand and return; safe from any thread or signal."""
        self._runs.stop()

    def close(self) -> None:
        """Close the transports and the engines it made; after ``run_once`` calls, release their leases.

        After ``run`` the leases were released by ``run`` itself, or left to
        expire when a database did not answer within the stop bound: ``close``
        then touches no database, so a process stopping with one frozen exits.
        After ``run_once`` calls it waits seconds at most for a database that
        does not answer (its tenants' leases expire by their TTL).
        """
        if not self._runs_started:
            self._tenants.close_all(list(self._tenants.units.values()))
        self._workers.close()
        self._databases.dispose()
