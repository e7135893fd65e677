"""``Inbox``: the consumer side. Handles each message once, per key in seq order.

Register one handler per topic, then either ``run(source)`` (a blocking
consumer loop with key-ordered parallelism and safe offset commits) or call
``handle(record)`` from your own consumer loop: that is the middleware around
your handler. See docs/consumer.md for the handler contract.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Literal, TypeVar, overload

import pydantic
import tenacity
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from transports import Record, Source
from transports._logsafe import safe_logger

from .. import _schema
from .._alerts import AlertSink, LoggingAlertSink
from .._envelope import Message
from .._errors import ConfigurationError
from .._events import EventReader
from .._statements import SUPPORTED_DIALECTS
from .._stopping import STOP_TIMEOUT, RunOnce, StopRequested
from .._tables import OutboxTables
from .._validation import validate_topic
from .._wire import ENVELOPE_HEADERS
from ..tenants import Tenant, TenantLabels
from ..tenants._tenant import TenantsLike, tenant_source
from ._admin import ParkedAdmin, ParkedMessage, ParkedReplay
from ._alerting import Alerter
from ._calls import TopicHandler, TopicHandlers
from ._delivery import Delivery, decode, delivery
from ._gaps import GapSweeper
from ._kinds import ForeignRecords, StartPolicy, UnknownEvents
from ._metrics import InboxMetrics, tenant_inbox_metrics
from ._outage import OutageLog, is_outage
from ._runner import Decode, Runner
from ._sessions import sessions_for
from ._settings import DEFAULT_BATCH_SIZE, InboxSettings
from ._settle import Settler
from ._signals import Disposition
from ._store import store_for
from ._tenants import REFRESH, Gate, Place, TenantRouter, tenant_session_engine, tenant_tables
from ._transaction import TransactionStep
from ._typed import HandlerRegistry

log = safe_logger("outbox.inbox")

H = TypeVar("H", bound=Callable[[Session, Message], Any] | Callable[[AsyncSession, Message], Awaitable[Any]])
B = TypeVar("B", bound=Callable[[Session, list[Message]], Any]
            | Callable[[AsyncSession, list[Message]], Awaitable[Any]])
F = TypeVar("F", bound=Callable[..., Any])


class Inbox:
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
    parallel; ``batch_size`` > 1 lets one transaction carry up to that many
    messages, of several keys or a run of one busy key's consecutive
    messages, which is what high throughput (and a hot key) needs.
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
        gap_timeout: timedelta | float = 60.0,
        gap_alert_after: timedelta | float | None = None,
        retry_backoff: float = 0.1,
        retry_backoff_max: float = 5.0,
        foreign_records: ForeignRecords | Literal["park", "accept"] = ForeignRecords.PARK,
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
    ) -> None:
        self.settings = settings = InboxSettings.of(
            group=group, max_attempts=max_attempts, concurrency=concurrency, batch_size=batch_size,
            gap_timeout=gap_timeout, gap_alert_after=gap_alert_after, retry_backoff=retry_backoff,
            retry_backoff_max=retry_backoff_max, foreign_records=foreign_records, start=start,
            dedup_window=dedup_window, unknown_event=unknown_event)
        self.unknown_event = settings.unknown_event
        alert = LoggingAlertSink() if alert is None else alert
        if not callable(alert):
            raise ConfigurationError(f"alert must be an AlertSink (a callable), got {alert!r}")
        if tables is not None and (prefix or schema):
            raise ConfigurationError("pass either tables= or prefix=/schema=, not both")
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
        self.accept_foreign = settings.foreign_records is ForeignRecords.ACCEPT
        self.start = settings.start
        self.alert = alert
        self.metrics = InboxMetrics(group)
        self._handlers = HandlerRegistry()
        self._stop = threading.Event()
        self._runs = RunOnce(self._stop, f"the inbox of group {group!r}")
        # The pipeline's stages, each handed what it needs: one store owns every statement.
        self.store = store_for(self.tables, group, engine.dialect.name)
        self.step = TransactionStep(self._sessions, self.store, self._handlers, self.metrics,
                                    settings.start, settings.dedup_window)
        self.alerter = Alerter(alert, group, self.metrics)
        self.settler = Settler(
            self.step, self.alerter, OutageLog(), max_attempts=settings.max_attempts,
            wait=tenacity.wait_exponential_jitter(multiplier=settings.retry_backoff,
                                                 max=settings.retry_backoff_max,
                                                 jitter=settings.retry_backoff),
        )
        self.admin = ParkedAdmin(self._sessions, self.store, self.step)
        self.gaps = GapSweeper(self._sessions, self.store, self.alerter, self.gap_timeout,
                               settings.gap_alert_after or self.gap_timeout / 2)
        _warn_small_pool(engine, settings.concurrency)
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
        if (header is None) == (tenant_of is None):
            raise ConfigurationError("an inbox serving tenants needs one of tenant_header= (the header "
                                     "naming the tenant) or tenant_of= (a function of the message)")
        if header is not None and (not isinstance(header, str) or not header.strip()
                                   or header != header.strip()
                                   or not header.isprintable() or len(header) > 200):
            raise ConfigurationError(f"tenant_header must be a header name, got {header!r:.80}")
        if header in ENVELOPE_HEADERS:  # read into the envelope, never into message.headers
            raise ConfigurationError(f"tenant_header {header!r} is an outbox envelope header: name "
                                     "the header that carries the tenant (e.g. 'x-tenant')")
        if tenant_of is not None and not callable(tenant_of):
            raise ConfigurationError(f"tenant_of must be a function of the message, got {tenant_of!r:.80}")
        if self.is_async:
            raise ConfigurationError("tenants= needs an Inbox built on a sync Engine or sessionmaker")
        seconds = refresh.total_seconds() if isinstance(refresh, timedelta) else refresh
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise ConfigurationError(f"tenant_refresh must be a positive number of seconds, got {refresh!r}")
        default = Place(None, self.engine, self.tables, self._sessions, self.store, self.step,
                        self.settler, self.admin, self.gaps, Gate(checked=True))
        return TenantRouter(tenant_source(tenants), default=default, build=self._place, header=header,
                            tenant_of=tenant_of, refresh=float(seconds), pool_size=self.concurrency)

    def _place(self, tenant: Tenant, engine: Engine) -> Place:
        """A tenant's pipeline: a plain inbox's stages on its engine, in its schema (``_tenants``).

        The store names its tables without a schema; the session engine's
        ``schema_translate_map`` puts them, and the handler's own tables, in the
        tenant's schema.
        """
        settings = self.settings
        sessions, _ = sessions_for(tenant_session_engine(engine, tenant))
        store = store_for(OutboxTables(prefix=self.tables.prefix), self.group, engine.dialect.name)
        metrics = self._tenant_metrics.for_tenant(tenant.name)  # labelled by tenant, bounded
        step = TransactionStep(sessions, store, self._handlers, metrics, settings.start,
                               settings.dedup_window)
        alerter = Alerter(self.alert, self.group, metrics, tenant=tenant.name)
        settler = Settler(step, alerter, OutageLog(f"the database of tenant {tenant.name}"),
                          max_attempts=settings.max_attempts, wait=self.settler.wait)
        gaps = GapSweeper(sessions, store, alerter, self.gap_timeout,
                          settings.gap_alert_after or self.gap_timeout / 2)
        return Place(tenant, engine, tenant_tables(self.tables, tenant), sessions, store, step, settler,
                     ParkedAdmin(sessions, store, step), gaps, Gate(checked=False))

    @property
    def tenants(self) -> list[Tenant]:
        """The tenants served now (as last read from the source); empty on a single-database inbox."""
        return [] if self.router is None else self.router.tenants

    def _at(self, tenant: str | None) -> ParkedAdmin:
        """The parked-key admin of ``tenant`` (None: the inbox's own database)."""
        if tenant is None:
            return self.admin
        if self.router is None:
            raise ConfigurationError("tenant= is for an inbox serving tenants (Inbox(tenants=…))")
        return self.router.place(tenant).admin

    # -- handlers -------------------------------------------------------------

    @overload
    def handler(self, topic: str, *, replace: bool = False) -> Callable[[H], H]: ...

    @overload
    def handler(self, topic: str, event: type[pydantic.BaseModel], *,
                replace: bool = False) -> Callable[[F], F]: ...

    def handler(self, topic: str, event: type[pydantic.BaseModel] | None = None, *,
                replace: bool = False) -> Callable[[Any], Any]:
        """Register ``fn(session, message)`` for ``topic``: the untyped handler, one per topic.

        The handler runs inside the inbox's transaction: write through
        ``session``, never commit or roll back. On an inbox built on an
        ``AsyncEngine``, ``fn`` is an ``async def`` function given an
        ``AsyncSession``. Raise to fail (it is retried,
        then parked) or raise ``RetryLater`` / ``SkipMessage`` / ``ParkMessage``.

        With ``event`` (a pydantic model class), a typed handler: called for
        the messages of ``topic`` whose event type is the model's
        (``outbox.event``: its type, aliases, and older versions it has
        upcasters from), as ``fn(session, event)`` with the payload validated
        into the model, or ``fn(session, event, message)`` when it takes a
        third argument. A topic has one handler per event type; its untyped
        handler, if any, takes every other message. A message none takes, or
        whose payload does not validate, follows ``unknown_event``. Messages of
        one key are handled one at a time in seq order, whichever handler each gets.

        A second handler for the same topic (and event type) is refused, unless
        ``replace=True``: then ``fn`` takes the place of the one registered,
        per-message or batch, for the messages that come after (a test
        "deploying the fix" before a replay; in production, deploy and restart).
        The topic's other handlers stay. The checks above apply all the same.
        """
        return self._register(topic, batch=False, event=event, replace=replace)

    @overload
    def batch_handler(self, topic: str, *, replace: bool = False) -> Callable[[B], B]: ...

    @overload
    def batch_handler(self, topic: str, event: type[pydantic.BaseModel], *,
                      replace: bool = False) -> Callable[[F], F]: ...

    def batch_handler(self, topic: str, event: type[pydantic.BaseModel] | None = None, *,
                      replace: bool = False) -> Callable[[Any], Any]:
        """Register ``fn(session, messages)`` for ``topic``: many messages per call, for throughput.

        ``messages`` may hold several consecutive messages of one key, always
        in seq order (a hot key's run), so one ``executemany`` can write them
        all; a write that folds messages into one row per key must follow
        that order. Same contract as ``handler``; when a call raises, the
        inbox rolls back and calls ``fn`` once per message, each in a
        SAVEPOINT, so only the failing message is retried and parked, and
        attempts count only those calls.

        With ``event``, typed as in ``handler``: ``fn(session, events)`` or
        ``fn(session, events, messages)``. A call holds consecutive messages
        of its type only: a key's messages of other types between them go to
        their handlers in seq order, so a batch is cut there.

        ``replace=True`` as in ``handler``.
        """
        return self._register(topic, batch=True, event=event, replace=replace)

    def _register(self, topic: str, *, batch: bool, event: type[pydantic.BaseModel] | None = None,
                  replace: bool = False) -> Callable[[Any], Any]:
        validate_topic(topic)
        reader = None if event is None else EventReader(event)
        many = "events" if batch else "event"

        def register(fn: Any) -> Any:
            if not callable(fn):
                raise ConfigurationError(f"handler for {topic!r} must be callable, got {fn!r}")
            with_message = False
            try:
                if reader is not None and _takes(fn, 3):
                    with_message = True
                else:
                    inspect.signature(fn).bind(None, None)
            except TypeError:
                raise ConfigurationError(
                    f"handler {getattr(fn, '__qualname__', fn)!r} must take "
                    + (f"(session, {'messages' if batch else 'message'})" if reader is None else
                       f"(session, {many}) or (session, {many}, {'messages' if batch else 'message'})")
                ) from None
            if self._sessions.is_async != _is_async(fn):
                raise ConfigurationError(
                    f"handler {getattr(fn, '__qualname__', fn)!r} must be "
                    + ("an async def function: this Inbox is built on an AsyncEngine"
                       if self._sessions.is_async else
                       "a plain function: an async def handler needs an Inbox built on an "
                       "AsyncEngine or async_sessionmaker"))
            handler = TopicHandler(fn, batch=batch, reader=reader, with_message=with_message,
                                   unknown=self.unknown_event)
            if replace:  # a new set, swapped in at once: a worker sees the old handler or the new
                handlers = self._without(topic, handler)
            else:
                handlers = self._handlers.get(topic) or TopicHandlers(topic, self.unknown_event)
            handlers.add(handler)
            self._handlers[topic] = handlers
            return fn

        return register

    def _without(self, topic: str, new: TopicHandler) -> TopicHandlers:
        """A copy of ``topic``'s handlers without the one(s) ``new`` would collide with.

        That is the untyped handler for an untyped ``new``; for a typed one, every
        handler taking one of its event types, under all the types it took.
        """
        old = self._handlers.get(topic)
        kept = TopicHandlers(topic, self.unknown_event)
        if old is None:
            return kept
        if new.reader is None:
            kept.typed = dict(old.typed)
            return kept
        kept.untyped = old.untyped
        displaced = {id(old.typed[t]) for t in new.reader.accepts if t in old.typed}
        kept.typed = {t: h for t, h in old.typed.items() if id(h) not in displaced}
        return kept

    @property
    def topics(self) -> list[str]:
        """The topics with a handler, to subscribe to."""
        return sorted(self._handlers)

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
            d = decode(record, accept_foreign=self.accept_foreign)
        self.metrics.consumed(d.message.topic)
        if self.router is not None:
            d = self.router.tag(d)
        return self._settle_here(d, cancel)

    def _settle_here(self, d: Delivery, cancel: threading.Event | None = None) -> Disposition:
        """Settle ``d`` in this thread, sleeping through retry delays and outages (until ``cancel``)."""
        while True:
            if cancel is not None and cancel.is_set():
                raise StopRequested(f"stopped before {d.message.topic}/{d.message.key} seq "
                                    f"{d.message.seq} was finished; it is delivered again")
            settled = (self.router or self.settler).settle([d])
            for done, disposition in settled.done:
                if done is d:
                    return disposition
            [(_, delay)] = [(later, delay) for later, delay in settled.later if later is d]
            if cancel is None:
                time.sleep(delay)
            else:
                cancel.wait(delay)

    def run(self, source: Source, *, install_signal_handlers: bool = True,
            stop_timeout: float = STOP_TIMEOUT) -> None:
        """Consume from ``source`` until ``stop()`` or SIGTERM/SIGINT; blocks.

        On stop, running transactions finish, queued records are left
        uncommitted (the next consumer gets them), offsets are committed and
        the source is closed. Database and broker outages do not end it: it
        waits for them, and resumes by itself.

        It returns at most ``stop_timeout`` seconds after the stop, whatever is
        down: the consumer loop runs on a thread of its own, and what it has not
        finished by then (a commit or a close that a dead broker never answers,
        a transaction on a frozen database) is left behind; an offset it did
        not commit only means a redelivery, which the inbox drops as a duplicate.
        """
        if not self._handlers:
            raise ConfigurationError("register at least one @inbox.handler(topic) before run()")
        router = self.router
        read: Decode = functools.partial(decode, accept_foreign=self.accept_foreign)
        if router is not None:
            untagged = read

            def read(record: Record, **kw: Any) -> Delivery:
                return router.tag(untagged(record, **kw))
        self._runs.run(lambda: Runner(
            source, decode=read, settler=router or self.settler, gaps=router or self.gaps,
            metrics=self.metrics, stop=self._stop, concurrency=self.concurrency,
            batch_size=self.batch_size,
            parked_keys=self.admin.parked_key_count if router is None else router.parked_key_count,
            install_signal_handlers=install_signal_handlers,
            stop_timeout=stop_timeout, prepare=self._check_schema,
        ).run())

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

    # -- operators ----------------------------------------------------------------

    def parked(self, topic: str | None = None, key: str | None = None, *,
               tenant: str | None = None) -> list[ParkedMessage]:
        """Parked messages of this group, per key in seq order.

        ``tenant``: of that tenant (an inbox serving tenants); without it, the
        inbox's own database (there, the messages of no known tenant).
        """
        return self._at(tenant).parked(topic, key)

    def replay(self, topic: str, key: str | None, *, tenant: str | None = None) -> ParkedReplay:
        """Re-run a parked key's messages in seq order; unpark it when all succeed.

        ``key=None`` re-runs the topic's parked unkeyed messages. ``tenant``:
        the key of that tenant. On an inbox serving tenants, without
        ``tenant``, the key's messages parked as ``tenant_unknown`` go to their
        tenants (which must be served now), as if they had just arrived.
        """
        if tenant is None and self.router is not None:
            return self.router.replay_unknown(topic, key)
        return self._at(tenant).replay(topic, key)

    def discard(self, message_id: uuid.UUID | str, *, by: str, reason: str,
                tenant: str | None = None) -> None:
        """Skip one parked message for good, recording who discarded it, when and why.

        Raises ``DiscardRefusedError`` while an earlier message of its key is
        parked (replay or discard that one first): nothing may be skipped over.
        ``tenant``: a message parked in that tenant's place.
        """
        self._at(tenant).discard(message_id, by=by, reason=reason)

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


def _takes(fn: Any, count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments."""
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    return True


def _is_async(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _warn_small_pool(engine: Engine, concurrency: int) -> None:
    size = getattr(engine.pool, "size", None)
    overflow = getattr(engine.pool, "_max_overflow", 0)
    if callable(size) and concurrency > size() + max(overflow, 0):
        log.warning("concurrency=%d exceeds the engine's pool (%d + %d overflow): workers will "
                    "wait for connections; create the engine with pool_size=%d",
                    concurrency, size(), overflow, concurrency)
