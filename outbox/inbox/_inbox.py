"""``Inbox``: the consumer side. Handles each message once, per key in seq order.

Register one handler per topic, then either ``run(source)`` (a blocking
consumer loop with key-ordered parallelism and safe offset commits) or call
``handle(record)`` from your own consumer loop: that is the middleware around
your handler. See docs/consumer.md for the handler contract.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from transports import Record, Source, source_features
from transports._logsafe import safe_logger

from ..core import _schema
from ..core._alerts import AlertSink, LoggingAlertSink
from ..core._envelope import Message
from ..core._errors import ConfigurationError
from ..core._foreign import ForeignEnvelope
from ..core._stopping import STOP_TIMEOUT, RunEnd, RunOnce
from ..core._tables import SUPPORTED_DIALECTS, OutboxTables
from ..core._tenant import Tenant, TenantsLike, tenant_source
from ..core._tenant_labels import TenantLabels
from ._alerting import Alerter
from ._delivery import Delivery, decode, delivery
from ._kinds import ForeignRecords, StartPolicy, UnknownEvents
from ._metrics import InboxMetrics, tenant_inbox_metrics
from ._operations import ParkedOperations
from ._outage import OutageLog, is_outage
from ._pipeline import build_pipeline
from ._places import Place, tenant_session_engine, tenant_tables
from ._registration import HandlerRegistration
from ._runner import Decode, Runner
from ._sessions import sessions_for, warn_small_pool
from ._settings import DEFAULT_BATCH_BUDGET, DEFAULT_BATCH_SIZE, InboxSettings
from ._settle import settle_alone
from ._signals import Disposition
from ._tenant_options import checked_refresh
from ._tenants import REFRESH, TenantRouter
from ._typed import HandlerRegistry
from .storage import InboxStorage, StorageFactory, storage_for

log = safe_logger("outbox.inbox")

class Inbox(HandlerRegistration, ParkedOperations):
    """Idempotent, key-ordered message handling for one consumer group.

    Guarantees: a message's handler writes, its dedup record and its key's new
    ``last_seq`` commit in one transaction, so effects in this database happen
    once however often the broker redelivers. Messages of one key are handled
    one at a time, in seq order; a message that arrives ahead of a gap waits in
    ``inbox_held`` (and parks the key after ``gap_timeout``, with one
    ``gap_held`` alert before, after ``gap_alert_after``: half the timeout
    unless given). A message that fails ``max_attempts`` times parks its key,
    and only its key.

    ``bind`` is a sync ``Engine`` or ``sessionmaker``: handlers are plain
    functions given a ``Session`` and run on worker threads. Or it is an
    ``AsyncEngine`` or ``async_sessionmaker``: handlers are ``async def``
    functions given an ``AsyncSession``, awaited on the inbox's own event loop
    inside the same transaction, under the same rules (``_sessions``).
    ``concurrency`` worker threads handle different keys in
    parallel; one transaction carries up to ``batch_size`` messages (500
    unless given), of several keys or a run of one busy key's consecutive
    messages, so a message costs a share of a commit, not a commit of its
    own; a transaction takes what is ready and never waits to fill, and
    starts no handler after ``batch_budget`` seconds (1 unless given): it
    commits what ran, the rest follows in the next one, so a slow handler
    does not hold one transaction for ``batch_size`` calls
    (docs/consumer.md, "Choosing the settings").
    ``start`` is where a key first met past seq 1 starts (``StartPolicy``),
    and what a rebuilt producer (a new incarnation counting its seqs again)
    does to its keys. ``dedup_window`` is how long this group's dedup records
    are kept when they are pruned (``outbox spark archive --dedup-window``): a
    message older than that, with a pruned record, is then counted and logged
    as an expired redelivery instead of parked as a conflict. Only a recorded
    message id is a duplicate (docs/consumer.md, "Producer restarts").
    A database or broker outage is never a failed attempt: the work waits
    and resumes. Configuration is checked here; registering handlers and
    ``handle`` are safe from several threads.

    ``tenants`` (a list of ``outbox.tenants.Tenant`` or schema names, or a
    callable returning one, read again every ``tenant_refresh`` seconds) makes
    one inbox serve many tenants: each message is applied in the schema or
    database of the tenant its ``tenant_header`` header (or
    ``tenant_of(message)``) names, with all of the above per tenant; ``bind``
    is then the default database, where a message of no known tenant is
    parked (reason ``tenant_unknown``). See ``_tenants`` and docs/tenants.md.

    ``storage`` builds the inbox's storage of a group on its tables
    (``outbox.inbox.storage``: dedup records, key positions, held and parked
    messages, each a protocol); by default the one of the engine's dialect,
    chosen once per database. Give one to wrap or replace a store
    (docs/consumer.md, "Storage").
    """

    def __init__(
        self,
        bind: Engine | sessionmaker[Session] | AsyncEngine | async_sessionmaker[AsyncSession],
        *,
        group: str,
        max_attempts: int = 3,
        alert: AlertSink | Callable[..., None] | None = None,
        concurrency: int = 8,
        batch_size: int = DEFAULT_BATCH_SIZE,
        batch_budget: timedelta | float = DEFAULT_BATCH_BUDGET,
        gap_timeout: timedelta | float = 60.0,
        gap_alert_after: timedelta | float | None = None,
        retry_backoff: float = 0.1,
        retry_backoff_max: float = 5.0,
        foreign_records: ForeignRecords | ForeignEnvelope | Literal["park", "accept", "debezium"] = (
            ForeignRecords.PARK),
        start: StartPolicy | Literal["strict", "first_seen"] = StartPolicy.STRICT,
        dedup_window: timedelta | float | None = None,
        unknown_event: UnknownEvents | Literal["park", "skip"] = UnknownEvents.PARK,
        tables: OutboxTables | None = None,
        prefix: str = "",
        schema: str | None = None,
        tenants: TenantsLike | None = None,
        tenant_header: str | None = None,
        tenant_of: Callable[[Message], str | None] | None = None,
        tenant_refresh: timedelta | float = REFRESH,
        storage: StorageFactory | None = None,
    ) -> None:
        self.settings = settings = InboxSettings.of(
            group=group, max_attempts=max_attempts, concurrency=concurrency, batch_size=batch_size,
            batch_budget=batch_budget, gap_timeout=gap_timeout, gap_alert_after=gap_alert_after,
            retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
            foreign_records=foreign_records, start=start, dedup_window=dedup_window,
            unknown_event=unknown_event)
        self.unknown_event = settings.unknown_event
        alert = LoggingAlertSink() if alert is None else alert
        if not callable(alert):
            raise ConfigurationError(f"alert must be an AlertSink (a callable), got {alert!r}")
        if tables is not None and (prefix or schema):
            raise ConfigurationError("pass either tables= or prefix=/schema=, not both")
        if storage is not None and not callable(storage):
            raise ConfigurationError(f"storage must be a StorageFactory (tables, group -> InboxStorage), "
                                     f"got {storage!r:.80}")
        self._sessions, self.sessions = sessions_for(bind)
        engine = self._sessions.engine
        if engine.dialect.name not in SUPPORTED_DIALECTS:
            raise ConfigurationError(f"unsupported database dialect {engine.dialect.name!r}; "
                                     f"supported: {SUPPORTED_DIALECTS}")

        self.group = group
        self.tables = tables or OutboxTables(prefix=prefix, schema=schema)
        self.concurrency = settings.concurrency
        self.batch_size = settings.batch_size
        self.gap_timeout = settings.gap_timeout
        self.foreign = settings.foreign_records
        """What a record without the outbox envelope becomes (``foreign_records``, resolved)."""
        self.start = settings.start
        self.alert = alert
        self.metrics = InboxMetrics(group)
        self._handlers = HandlerRegistry()
        self._stop = threading.Event()
        self._runs = RunOnce(self._stop, f"the inbox of group {group!r}")
        self._run_end = RunEnd()
        """Ended as each ``run`` returns: a sweep read begun in it and still hanging tells nothing."""
        self._run_over = functools.partial(self._run_end.over, self._stop)
        self._storage = storage
        self.alerter = Alerter(alert, group, self.metrics)
        own = build_pipeline(self._sessions, self._storage_of(self.tables, engine), self._handlers,
                             settings, self.alerter, OutageLog(), self._run_over)
        self.storage, self.step, self.settler, self.admin, self.gaps = (
            own.storage, own.step, own.settler, own.admin, own.gaps)
        warn_small_pool(engine, settings.concurrency)
        self.router: TenantRouter | None = None
        """Set on an inbox serving many tenants (``tenants=``): where each message goes (``_tenants``)."""
        if tenants is not None or tenant_header is not None or tenant_of is not None:
            self.serve_tenants(tenants, tenant_header=tenant_header, tenant_of=tenant_of,
                               tenant_refresh=tenant_refresh)

    # -- tenants ----------------------------------------------------------------

    def serve_tenants(self, tenants: TenantsLike | None, *, tenant_header: str | None = None,
                      tenant_of: Callable[[Message], str | None] | None = None,
                      tenant_refresh: timedelta | float = REFRESH) -> None:
        """Serve many tenants, each in its schema or database: what ``Inbox(tenants=…)`` does.

        For an inbox built elsewhere (``outbox inbox run --tenants``): call it
        before ``run()``, once. ``tenants`` is a list of ``Tenant`` (or schema
        names) or a callable returning one (``outbox.tenants``), read again
        every ``tenant_refresh``; the tenant of a message is its
        ``tenant_header`` header, or what ``tenant_of(message)`` returns.
        See docs/tenants.md, "The inbox per tenant".
        """
        if self.router is not None:
            raise ConfigurationError("this Inbox serves tenants already")
        self.router = self._router(tenants, tenant_header, tenant_of, tenant_refresh)
        # The first 100 tenants label the inbox metrics by name, later ones share "_other" (docs/tenants.md).
        self._tenant_metrics = tenant_inbox_metrics(self.group, TenantLabels())

    def _router(self, tenants: TenantsLike | None, header: str | None,
                tenant_of: Callable[[Message], str | None] | None,
                refresh: timedelta | float) -> TenantRouter:
        if tenants is None:
            raise ConfigurationError("tenant_header= and tenant_of= need tenants= (docs/tenants.md)")
        seconds = checked_refresh(header, tenant_of, refresh, is_async=self.is_async)
        default = Place(None, self.engine, self.tables, self._sessions, self.storage, self.step,
                        self.settler, self.admin, self.gaps, checked=True)
        return TenantRouter(tenant_source(tenants), default=default, build=self._place, header=header,
                            tenant_of=tenant_of, refresh=seconds, pool_size=self.concurrency)

    def _place(self, tenant: Tenant, engine: Engine) -> Place:
        """A tenant's pipeline: a plain inbox's stages on its engine, in its schema (``_tenants``).

        The storage names its tables without a schema; the session engine's
        ``schema_translate_map`` puts them, and the handler's own tables, in the
        tenant's schema.
        """
        sessions, _ = sessions_for(tenant_session_engine(engine, tenant))
        metrics = self._tenant_metrics.for_tenant(tenant.name)  # labelled by tenant, bounded
        p = build_pipeline(sessions, self._storage_of(OutboxTables(prefix=self.tables.prefix), engine),
                           self._handlers, self.settings,
                           Alerter(self.alert, self.group, metrics, tenant=tenant.name),
                           OutageLog(f"the database of tenant {tenant.name}"), self._run_over)
        return Place(tenant, engine, tenant_tables(self.tables, tenant), sessions, p.storage, p.step,
                     p.settler, p.admin, p.gaps)

    def _storage_of(self, tables: OutboxTables, engine: Engine) -> InboxStorage:
        """This group's storage on ``tables`` in ``engine``'s database: ``storage=``'s, or its dialect's."""
        storage = (self._storage or storage_for(engine.dialect.name))(tables, self.group)
        if not isinstance(storage, InboxStorage) or storage.group != self.group:
            raise ConfigurationError(f"storage= built {storage!r:.120}, not an InboxStorage of group "
                                     f"{self.group!r}")
        return storage

    @property
    def tenants(self) -> list[Tenant]:
        """The tenants served now (as last read from the source); empty on a single-database inbox."""
        return [] if self.router is None else self.router.tenants

    # -- consuming --------------------------------------------------------------

    def handle(self, record: Record | Message, *, partition: int | None = None,
               offset: int | None = None, cancel: threading.Event | None = None) -> Disposition:
        """Process one record to the end, in the calling thread; returns what became of it.

        This is the middleware for your own consumer loop: when it returns, the
        record is finished (applied, dropped as duplicate, held or parked) and
        its offset may be committed. Retries, ``RetryLater`` and database
        outages are waited out inside, in this thread. Call it for one key
        from one thread at a time, in the order received, and call ``sweep()``
        every few seconds so gaps that never fill are parked.

        ``cancel``, when set (by a worker that is stopping), ends the waiting:
        ``StopRequested`` is raised at the next retry or outage wait instead of
        the next attempt. The record is then not finished: do not commit it.
        """
        if isinstance(record, Message):
            d = delivery(record, partition, offset)
        else:
            d = decode(record, foreign=self.foreign)
        self.metrics.consumed(d.message.topic)
        if self.router is not None:
            d = self.router.tag(d)
        return self._settle_here(d, cancel)

    def _settle_here(self, d: Delivery, cancel: threading.Event | None = None) -> Disposition:
        """Settle ``d`` in this thread, sleeping through retry delays and outages (until ``cancel``)."""
        return settle_alone((self.router or self.settler).settle, d, cancel)

    def run(self, source: Source, *, install_signal_handlers: bool = True,
            stop_timeout: float = STOP_TIMEOUT) -> None:
        """Consume from ``source`` until ``stop()`` or SIGTERM/SIGINT; blocks.

        On stop, running transactions finish, queued records are left
        uncommitted (the next consumer gets them), offsets are committed and
        the source is closed. Database and broker outages do not end it: it
        waits for them, and resumes by itself.

        ``source`` must have Kafka positions (``transports.SourceFeatures.offsets``,
        both Kafka sources do): offsets are committed up to the lowest one not
        finished. A source without them is refused; feed ``handle`` instead.

        It returns at most ``stop_timeout`` seconds after the stop, whatever is
        down: the consumer loop runs on a thread of its own, and what it has not
        finished by then (a commit or a close that a dead broker never answers,
        a transaction on a frozen database) is left behind; an offset it did
        not commit only means a redelivery, which the inbox drops as a duplicate.
        """
        if not self._handlers:
            raise ConfigurationError("register at least one @inbox.handler(topic) before run()")
        if not source_features(source).offsets:
            raise ConfigurationError(
                f"{type(source).__name__} has no offsets (its features): run() commits what is finished "
                "as Kafka positions; call inbox.handle(record) from the source's own loop and acknowledge "
                "each record once it returned (docs/transports.md)")
        router = self.router
        read: Decode = functools.partial(decode, foreign=self.foreign)
        if router is not None:
            untagged = read

            def read(record: Record, **kw: Any) -> Delivery:
                return router.tag(untagged(record, **kw))

        def start() -> threading.Thread | None:
            try:
                return Runner(
                    source, decode=read, settler=router or self.settler, gaps=router or self.gaps,
                    metrics=self.metrics, stop=self._stop, concurrency=self.concurrency,
                    batch_size=self.batch_size,
                    parked_keys=(functools.partial(self.gaps.watched, self.admin.parked_key_count)
                                 if router is None else router.parked_key_count),
                    install_signal_handlers=install_signal_handlers,
                    stop_timeout=stop_timeout, prepare=self._check_schema,
                ).run()
            finally:
                self._run_end.end()  # a sweep read of this run still hanging tells nothing
        self._runs.run(start)

    def _check_schema(self) -> None:
        """Refuse old or new tables with what to run; a database that is down is waited for.

        The first query of ``run()``: a consumer started (or restarted by its
        supervisor) while the database restarts must wait, not exit.
        """
        outage = OutageLog()
        while not self._stop.is_set():
            try:
                self._sessions.run(functools.partial(_schema.check, inbox=True), self.engine, self.tables)
                if self.router is not None:
                    self.router.refresh(force=True)  # a source that cannot be read refuses to start
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self._stop.wait(outage.failed(exc))
            else:
                outage.answered()
                return

    def stop(self) -> None:
        """Ask ``run()`` to return; safe from any thread. Asked before ``run()``, it returns at once."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def sweep(self) -> None:
        """Apply held messages whose gap filled, park keys whose gap outlived ``gap_timeout``.

        A database outage makes it return without doing anything (logged once):
        call it again at your next turn.
        """
        if self.router is not None:  # each tenant's, in this thread; outages are the router's
            for d in self.router.sweep():
                self._settle_here(d)
            return
        try:
            for d in self.gaps.ready():
                self._settle_here(d)
            self.gaps.park_stale()
        except Exception as exc:
            if not is_outage(exc):
                raise
            self.settler.outages.failed(exc)

    # -- tables ---------------------------------------------------------------------

    def create_tables(self, *, tenant: str | None = None) -> None:
        """Create the outbox and inbox tables that do not exist yet (see ``Outbox.create_tables``).

        ``tenant``: in that tenant's schema or database (the schema must exist).
        """
        if tenant is None:
            self._sessions.run(self._create_tables, self.engine, self.tables)
            return
        if self.router is None:
            raise ConfigurationError("tenant= is for an inbox serving tenants (Inbox(tenants=…))")
        place = self.router.place(tenant)
        self._create_tables(place.engine, place.tables)

    def _create_tables(self, engine: Engine, tables: OutboxTables) -> None:
        with engine.begin() as conn:
            _schema.create(conn, tables, None)

    @property
    def engine(self) -> Engine:
        """The inbox's sync engine (an ``AsyncEngine``'s ``sync_engine``): its dialect and URL."""
        return self._sessions.engine

    def run_database(self, fn: Callable[[], Any]) -> Any:
        """Call ``fn()``, which uses ``engine``, where that works (an async inbox: on its event loop)."""
        return self._sessions.run(fn)

    @property
    def is_async(self) -> bool:
        """Built on an ``AsyncEngine``: handlers are ``async def`` and given an ``AsyncSession``."""
        return self._sessions.is_async

