"""The inbox per tenant: one consumer, each message applied in its own tenant's schema or database.

An ``Inbox`` given ``tenants=`` keeps one consumer (one group, one Kafka
consumer, one offset tracker, one key scheduler) and routes every delivery to
a *place*: its tenant's sessions, store, transaction step, settle stage,
parked-key admin and gap sweeper, the very same objects a single-database
inbox has, built on the tenant's engine. Nothing in a transaction knows about
tenants: a batch is one tenant's (``_schedule``), so it runs where it would
run in an inbox of that tenant alone, with the same promises.

- **Where:** a tenant's sessions are bound to its database's engine, with
  ``schema_translate_map={None: schema}`` when it has a schema: the inbox
  tables and the handler's own unqualified tables land in the tenant's schema,
  in one transaction. One engine (one pool) per database, shared by its
  tenants: ``execution_options`` copies share the pool.
- **Which:** the tenant is named by a record header (``tenant_header``) or by
  ``tenant_of(message)``; ``Delivery.tenant`` carries it, and the scheduler's
  turn includes it, so tenant A's key "k" and tenant B's key "k" are two keys.
- **Isolation:** each place has a ``Gate``. A tenant whose database fails
  (or whose inbox tables are missing) closes its gate: its deliveries go back
  to their lanes on a timer without touching the database, and one *probe*
  at a time tries again after the backoff. Nothing counts as an attempt; the
  outage is logged once per tenant. A database that hangs instead of failing
  (a frozen host) holds the workers whose transactions it took: when the
  tenants span several databases, one database's transactions take at most
  half the workers at a time (``Slots``), so the others' tenants keep the
  rest. The offset tracker holds the commit below its unfinished records
  (at-least-once; dedup drops the redelivery).
- **Unknown tenant:** a message whose header is missing, names no tenant
  served, or whose ``tenant_of`` raised is parked alone in the default
  database with reason ``tenant_unknown`` (one alert per tenant name and
  process); one that cannot be read is parked there for what it is
  (``foreign``, ``undecodable``), so no replay ever hands it to a handler.
  A message naming a tenant is parked so only after a reading of
  the tenant source that began after the message was received (the source is
  read again for it, at most once a second; meanwhile, and while the source
  cannot be read, it waits): a tenant added before its first message is found. ``replay`` of such a message
  (``Inbox.replay(topic, key)`` without ``tenant``) sends it to its tenant once
  the tenant exists: it arrives there as if just received.
- **Refresh:** the tenant source is read again every ``refresh`` seconds (by
  the sweep); a tenant removed takes no new messages (they park as unknown),
  a tenant added is served from then on.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from transports._logsafe import safe_logger

from .. import _schema
from .._alerts import Alert, AlertKind, deliver
from .._envelope import Message, utcnow
from .._errors import ConfigurationError, OutboxError
from .._tables import OutboxTables
from .._tenant import Tenant, TenantSource
from ._admin import NotParkedError, ParkedAdmin, ParkedReplay
from ._delivery import Delivery, Origin, delivery
from ._gaps import GapSweeper
from ._kinds import Reason
from ._outage import BACKOFF, OutageLog, is_outage
from ._sessions import Sessions
from ._settle import Settled, Settler
from ._signals import Disposition
from ._store import InboxStore, ParkedRow
from ._transaction import TransactionStep

log = safe_logger("outbox.inbox")

REFRESH = 30.0
"""Seconds between two readings of the tenant source (``Inbox(tenant_refresh=…)``)."""
LOOKUP_AGAIN = 1.0
"""A name no tenant has makes the source be read again, at most this often (or every refresh,
when that is shorter), before it parks."""
SWEEP_SLICE = 50
"""Places swept per sweep turn (one a second): with many tenants, each is swept in its turn."""
NO_TENANT = ""
"""``Delivery.tenant`` of a message that names none."""
_MAX_ALERTED = 10_000

T = TypeVar("T")


class Gate:
    """Whether a place may be used now: open, or closed with one probe at a time after a backoff.

    Closed from the first outage (or missing tables) until a probe answers;
    while closed, ``admit`` tells a worker how long to put its deliveries off
    instead of letting it wait for a database that may hang. Thread-safe.
    """

    def __init__(self, *, checked: bool) -> None:
        self._lock = threading.Lock()
        self.checked = checked
        """The place's inbox tables were found (checked once, and again after a failure)."""
        self._closed = not checked
        self._retry_at = 0.0
        self._probing = False

    def admit(self) -> float | None:
        """None: go ahead (as the probe, when closed); else the seconds to put the work off."""
        with self._lock:
            if not self._closed:
                return None
            now = time.monotonic()
            if self._probing or now < self._retry_at:
                return max(BACKOFF.first, self._retry_at - now)
            self._probing = True
            return None

    @property
    def open(self) -> bool:
        return not self._closed

    def opened(self) -> None:
        with self._lock:
            self._closed = self._probing = False
            self.checked = True

    def closed(self, delay: float, *, unchecked: bool = False) -> None:
        with self._lock:
            self._closed, self._probing = True, False
            self._retry_at = time.monotonic() + delay
            if unchecked:
                self.checked = False


class Slots:
    """How many transactions each database may run at once: a hung database keeps the rest free.

    Keyed by the engine's pool (tenants in schemas of one database share it).
    ``take`` never waits: a worker that gets no slot puts its batch off.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._taken: dict[object, int] = {}

    def take(self, pool: object) -> bool:
        with self._lock:
            taken = self._taken.get(pool, 0)
            if taken >= self.limit:
                return False
            self._taken[pool] = taken + 1
            return True

    def give_back(self, pool: object) -> None:
        with self._lock:
            left = self._taken[pool] - 1
            if left:
                self._taken[pool] = left
            else:
                del self._taken[pool]


@dataclass(eq=False)
class Place:
    """Where one tenant's messages are applied: the per-database pipeline of a plain inbox."""

    tenant: Tenant | None
    """None: the inbox's default database (unknown tenants park there)."""
    engine: Engine
    """The database's engine without the schema translation: schema checks, ``create_tables``."""
    tables: OutboxTables
    """The tenant's tables, qualified with its schema: what the checks look for."""
    sessions: Sessions
    store: InboxStore
    step: TransactionStep
    settler: Settler
    admin: ParkedAdmin
    gaps: GapSweeper
    gate: Gate
    parked_keys: int = 0
    missing_looks: int = 0
    """Consecutive looks that found its tables missing: paces the next look like an outage's retries."""

    @property
    def name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name

    @property
    def what(self) -> str:
        return "the default database" if self.tenant is None else f"tenant {self.tenant.name}"


BuildPlace = Callable[[Tenant, Engine], Place]
"""Builds a tenant's place on its database's engine (``Inbox._place``)."""


class TenantRouter:
    """Routes deliveries to their tenant's place; settles, sweeps and counts across places.

    Takes the roles of the settle stage and the gap sweeper in the runner
    (``settle``, ``ready``, ``park_stale``, ``parked_key_count``).
    Thread-safe: the place map is replaced whole at each refresh.
    """

    def __init__(self, source: TenantSource, *, default: Place, build: BuildPlace,
                 header: str | None, tenant_of: Callable[[Message], str | None] | None,
                 refresh: float, pool_size: int) -> None:
        self.source = source
        self.default = default
        self._build = build
        self.header = header
        self.tenant_of = tenant_of
        self.refresh_every = refresh
        self.lookup_every = min(LOOKUP_AGAIN, refresh)
        self._pool_size = pool_size
        self._workers = pool_size
        self.slots = Slots(pool_size)
        self._places: dict[str, Place] = {}
        self._engines: dict[str, Engine] = {}
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._read_since = datetime.min.replace(tzinfo=UTC)
        """When the last successful reading of the source began (wall clock, as ``received_at``)."""
        self._loaded = False
        self._source_log = OutageLog("the tenant source")
        self._missing: set[str] = set()  # places whose tables were reported missing
        self._alerted: set[str] = set()
        self._sweep_from = 0
        self._sweeps: dict[object, Future[list[Delivery]]] = {}
        self._refreshing = threading.Lock()
        self._reading = threading.Lock()
        """Held while the source is read: one reading at a time, apart from ``_lock``."""

    # -- the tenants ------------------------------------------------------------

    def refresh(self, *, force: bool = False, at_most_every: float | None = None,
                wait: bool = True) -> bool:
        """Read the tenant source again when due; a failure keeps the tenants as they were.

        The first reading raises what the source raised (``run`` waits out an
        outage and refuses a bad source); later ones log it once and go on.
        One reading at a time, and never under the lock the consumer thread
        takes (``ready``): a source that hangs holds up its readers, not the
        poll. ``wait=False``: False at once when another reading is under way.
        """
        every = self.refresh_every if at_most_every is None else at_most_every
        if not self._reading.acquire(blocking=wait):
            return False
        try:
            if not force and time.monotonic() - self._read_at < every:
                return True
            self._read_at = time.monotonic()
            began = utcnow()
            try:
                tenants = self.source()
                self._refuse_the_default(tenants)
            except Exception as exc:
                if not self._loaded:
                    raise
                self._source_log.failed(exc)
                return True
            self._source_log.answered()
            self._take(tenants, began)
            return True
        finally:
            self._reading.release()

    def _refuse_the_default(self, tenants: Sequence[Tenant]) -> None:
        """``ConfigurationError`` for a tenant whose tables would be the default database's.

        There the messages of no known tenant park: that tenant's parked list,
        replay and discard would take them for its own, and replay would apply
        another tenant's message in its tables.
        """
        default = self.default
        # Unqualified tables are in the connection's default schema (PostgreSQL's "public"): known
        # once the default database was connected to (run() does that first).
        schemas = {default.tables.schema}
        if default.tables.schema is None:
            schemas.add(getattr(default.engine.dialect, "default_schema_name", None))
        for tenant in tenants:
            database = tenant.database
            same_database = (database is None
                             or (isinstance(database, Engine) and database.pool is default.engine.pool)
                             or (isinstance(database, str)
                                 and _same_url(database, default.engine.url)))
            if same_database and tenant.schema in schemas:
                raise ConfigurationError(
                    f"tenant {tenant.name}: its inbox tables would be the default database's, where "
                    "the messages of no known tenant park; give it a schema or a database of its own")

    def _take(self, tenants: Sequence[Tenant], began: datetime) -> None:
        """Serve ``tenants`` from now on: a place each, kept when its tenant did not change."""
        with self._lock:
            places: dict[str, Place] = {}
            for tenant in tenants:
                old = self._places.get(tenant.name)
                places[tenant.name] = (old if old is not None and old.tenant == tenant
                                       else self._build(tenant, self._engine_of(tenant)))
            gone = self._places.keys() - places.keys()
            added = places.keys() - self._places.keys()
            if self._loaded and (gone or added):
                log.info("tenants: %d served (%d added, %d removed)", len(places), len(added), len(gone))
            self._places = places
            self._loaded = True
            self._read_since = began
            named = {t.database for t in tenants if isinstance(t.database, str)}
            released = [self._engines.pop(url) for url in list(self._engines) if url not in named]
            # One database: nothing to keep free from it. Several: each takes half the workers at most.
            databases = {id(p.engine.pool) for p in places.values()} | {id(self.default.engine.pool)}
            self.slots.limit = self._workers if len(databases) == 1 else max(1, self._workers // 2)
        # A database no tenant is in any more: its pooled connections would stay open for good (and
        # keep a DROP DATABASE of a tenant that left waiting). Those checked out close when returned.
        for engine in released:
            engine.dispose()

    def _engine_of(self, tenant: Tenant) -> Engine:
        """The engine of the tenant's database: one per database URL, so one pool per database."""
        database = tenant.database
        if database is None:
            return self.default.engine
        if isinstance(database, Engine):
            return database
        engine = self._engines.get(database)
        if engine is None:
            engine = self._engines[database] = sa.create_engine(
                database, pool_pre_ping=True, pool_size=self._pool_size,
                max_overflow=self._pool_size)
        return engine

    @property
    def tenants(self) -> list[Tenant]:
        """The tenants served, as last read (read now if never read)."""
        if not self._loaded:
            self.refresh(force=True)
        return [p.tenant for p in self._places.values() if p.tenant is not None]

    def place(self, name: str | None) -> Place:
        """The place of tenant ``name`` for an operator (None: the default database)."""
        if name is None:
            return self.default
        found = self._places.get(name)
        if found is None:
            self.refresh(force=True)
            found = self._places.get(name)
        if found is None:
            raise ConfigurationError(f"no tenant {name!r:.80} among the inbox's tenants "
                                     f"({len(self._places)} served)")
        return found

    def _serving(self, name: str, received_at: datetime) -> Place | float | None:
        """The place of a message's tenant; None: none has it (park it); a delay: ask again then.

        A name not found makes the source be read again (at most every
        ``lookup_every`` s); it is "none" only after a reading that began after
        ``received_at``.
        """
        found = self._places.get(name) if name else None
        if found is not None or not name:
            return found
        if self._read_since <= received_at:
            try:  # a reading under way (maybe hung) is not waited for: the message waits on its lane
                self.refresh(at_most_every=self.lookup_every, wait=False)
            except Exception as exc:  # only the first reading raises: a bad source is refused then
                if not self._loaded and not is_outage(exc):
                    raise  # the runner read it first; ``handle()`` without ``run()`` gets here
                self._source_log.failed(exc)
            found = self._places.get(name)
            if found is None and self._read_since <= received_at:
                return self.lookup_every
        return found

    # -- which tenant -------------------------------------------------------------

    def name_of(self, message: Message) -> tuple[str, str | None]:
        """(tenant name or "", why it names none) for ``message``; never raises.

        Whatever ``tenant_of`` returns or raises (an object whose ``==`` or
        ``str()`` raises, a ``str`` subclass) is looked at only through
        ``isinstance`` and ``str``'s own methods: the consumer thread calls this.
        """
        if self.tenant_of is not None:
            try:
                named = self.tenant_of(message)
            except Exception as exc:
                return NO_TENANT, f"tenant_of raised {_described(exc)}"
            if named is None:
                return NO_TENANT, "tenant_of named no tenant"
            if not isinstance(named, str):
                return NO_TENANT, f"tenant_of returned a {type(named).__name__:.80}, not a tenant name"
            name = str.__getitem__(named, slice(None, 200))  # a plain str, whatever the subclass
            if not name:
                return NO_TENANT, "tenant_of named no tenant"
            return name, None
        value = message.headers.get(self.header or "")
        if not value:
            return NO_TENANT, f"no {self.header!r} header"
        return value[:200], None

    def tag(self, d: Delivery) -> Delivery:
        """``d`` with its tenant's name."""
        return dataclasses.replace(d, tenant=self.name_of(d.message)[0])

    # -- the settle stage ---------------------------------------------------------

    def settle(self, batch: list[Delivery]) -> Settled:
        """Settle a batch of one tenant at its place; an unknown tenant's are parked as such."""
        name = batch[0].tenant or NO_TENANT
        place = self._serving(name, max(d.received_at for d in batch))
        if isinstance(place, float):
            return Settled(later=[(d, place) for d in batch])
        if place is None:
            return self._park_unknown(batch)
        return self._at(place, batch, lambda: place.settler.settle(batch))

    def _park_unknown(self, batch: list[Delivery]) -> Settled:
        """Park messages of no known tenant in the default database: unreadable ones for what they are.

        A record that cannot be read (foreign, undecodable) is never to be
        applied anywhere: parked as ``tenant_unknown``, replay would send it to
        its tenant as if it were a message and apply it. It is parked as a
        single-database inbox parks it (``foreign``, ``undecodable``), in the
        default database; the others as ``tenant_unknown``.
        """
        unreadable = [d for d in batch if d.unreadable is not None]
        readable = [d for d in batch if d.unreadable is None]
        default = self.default
        settled = Settled()
        if unreadable:
            settled = self._at(default, unreadable, lambda: default.settler.settle(unreadable))
        if readable:
            rest = self._at(default, readable, lambda: self._parked_unknown(readable))
            settled = Settled(done=settled.done + rest.done, later=settled.later + rest.later)
        return settled

    def _at(self, place: Place, batch: list[Delivery], settle: Callable[[], Settled]) -> Settled:
        """Run ``settle`` at ``place`` through its gate: put off while closed, closed by an outage."""
        pool = place.engine.pool
        if not self.slots.take(pool):
            return Settled(later=[(d, BACKOFF.first) for d in batch])
        try:
            return self._through_gate(place, batch, settle)
        finally:
            self.slots.give_back(pool)

    def _through_gate(self, place: Place, batch: list[Delivery], settle: Callable[[], Settled]) -> Settled:
        wait = place.gate.admit()
        if wait is not None:
            return Settled(later=[(d, wait) for d in batch])
        if not place.gate.checked:
            delay = self._check(place)
            if delay is not None:
                place.gate.closed(delay, unchecked=True)
                return Settled(later=[(d, delay) for d in batch])
        try:
            settled = settle()
        except DBAPIError as exc:
            # Not an outage (those settle as "later"): the tables went away under us? Check them.
            delay = self._check(place)
            if delay is None:
                raise
            place.gate.closed(delay, unchecked=True)
            log.warning("%s: inbox transaction failed (%s); its tables are checked again before "
                        "it is used", place.what, type(exc).__name__)
            return Settled(later=[(d, delay) for d in batch])
        if place.settler.outages.down:
            place.gate.closed(max((delay for _, delay in settled.later), default=BACKOFF.first))
        else:
            place.gate.opened()
        return settled

    def _check(self, place: Place) -> float | None:
        """None when ``place``'s inbox tables are there; else the seconds before the next look."""
        try:
            place.sessions.run(functools.partial(_schema.check, inbox=True), place.engine, place.tables)
        except Exception as exc:
            if is_outage(exc):
                return place.settler.outages.failed(exc)
            if not isinstance(exc, OutboxError | DBAPIError):
                raise
            name = place.name or ""
            if name not in self._missing:
                self._missing.add(name)
                log.error("%s: its inbox tables are not usable (%s); its messages wait, the other "
                          "tenants go on. Create them (`outbox init-db`, or Inbox.create_tables(tenant=…))",
                          place.what, str(exc).splitlines()[0][:300])
            place.missing_looks += 1
            return BACKOFF.delay(place.missing_looks)
        place.settler.outages.answered()
        place.missing_looks = 0
        if place.name in self._missing:
            self._missing.discard(place.name or "")
            log.warning("%s: its inbox tables are there now", place.what)
        return None

    def _parked_unknown(self, batch: list[Delivery]) -> Settled:
        """Park readable messages of no known tenant, alone, reason ``tenant_unknown``."""
        default = self.default
        whys = [self._why_unknown(d) for d in batch]
        try:
            default.sessions.run(self._park_rows, batch, whys)
        except Exception as exc:
            if not is_outage(exc):
                raise
            delay = default.settler.outages.failed(exc)
            return Settled(later=[(d, delay) for d in batch])
        default.settler.outages.answered()
        for d, why in zip(batch, whys, strict=True):
            default.settler.alerter.metrics.parked(d.message.topic, Reason.TENANT_UNKNOWN)
            self._alert_unknown(d, why)
        return Settled(done=[(d, Disposition.PARKED) for d in batch])

    def _why_unknown(self, d: Delivery) -> str:
        name, why = self.name_of(d.message)
        return why if why is not None else f"tenant {name!r} is not among the inbox's tenants"

    def _park_rows(self, batch: list[Delivery], whys: list[str]) -> None:
        store = self.default.store
        with self.default.sessions() as session, session.begin():
            for d, why in zip(batch, whys, strict=True):
                store.park(session, d, Reason.TENANT_UNKNOWN, error=why)

    def _alert_unknown(self, d: Delivery, why: str) -> None:
        """One alert per tenant name (or per "names none") and process."""
        name = d.tenant or NO_TENANT
        if name in self._alerted or len(self._alerted) >= _MAX_ALERTED:
            return
        self._alerted.add(name)
        alerter = self.default.settler.alerter
        deliver(alerter.sink, Alert(
            kind=AlertKind.MESSAGE_PARKED, topic=d.message.topic, key=d.message.key,
            message_id=str(d.message.message_id), group=alerter.group,
            error=f"{why}: parked in the default database (reason tenant_unknown); replay it "
                  "once its tenant is served",
            details={"reason": Reason.TENANT_UNKNOWN.value, "tenant": name or None,
                     "seq": d.message.seq, "partition": d.partition, "offset": d.offset}))

    # -- the sweep ----------------------------------------------------------------

    def _slice(self) -> list[Place]:
        """The places whose turn it is to be swept (``SWEEP_SLICE`` of them, round robin)."""
        places = list(self._places.values())
        if len(places) <= SWEEP_SLICE:
            return places
        start = self._sweep_from % len(places)
        self._sweep_from = start + SWEEP_SLICE
        return (places + places)[start:start + SWEEP_SLICE]

    def ready(self) -> list[Delivery]:
        """Held messages next in their key that the sweeps finished since the last call found.

        Called by the runner's consumer thread, which must never wait for a
        tenant's database: each turn hands the places whose turn it is to the
        sweeper threads, one per database (a database whose last sweep has
        not returned, a hung one, is skipped), and takes what the finished
        ones found. Reads the tenant source when due, on a thread of its own.
        """
        self._refresh_in_background()
        found: list[Delivery] = []
        by_pool: dict[object, list[Place]] = {}
        for place in self._slice():
            by_pool.setdefault(place.engine.pool, []).append(place)
        with self._lock:
            for pool, task in list(self._sweeps.items()):
                if task.done():
                    del self._sweeps[pool]
                    if task.exception() is None:
                        found.extend(task.result())
            for pool, places in by_pool.items():
                if pool not in self._sweeps:
                    self._sweeps[pool] = self._in_background(places)
        return found

    def _refresh_in_background(self) -> None:
        """``refresh()`` when due, on a daemon thread: a source whose database hangs holds up no poll."""
        if time.monotonic() - self._read_at < self.refresh_every or self._refreshing.locked():
            return

        def refresh() -> None:
            with self._refreshing:
                try:
                    self.refresh()
                except Exception:
                    log.exception("reading the tenant source failed")
        threading.Thread(target=refresh, name="outbox-inbox-tenants", daemon=True).start()

    def _in_background(self, places: list[Place]) -> Future[list[Delivery]]:
        """``sweep(places)`` on a daemon thread of its own: one that hangs never holds up an exit."""
        task: Future[list[Delivery]] = Future()

        def sweep() -> None:
            try:
                task.set_result(self.sweep(places))
            except BaseException as exc:
                log.exception("inbox sweep failed")
                task.set_exception(exc)
        threading.Thread(target=sweep, name="outbox-inbox-sweep", daemon=True).start()
        return task

    def park_stale(self) -> int:
        """Nothing to do here: ``ready``'s sweeps park the stale gaps of their places too."""
        return 0

    def sweep(self, places: list[Place] | None = None) -> list[Delivery]:
        """Sweep ``places`` (all, when None) in this thread: held messages ready, gaps to park, counts.

        Sweeping them all (``Inbox.sweep``) also reads the tenant source when due.
        """
        if places is None:
            self.refresh()
        found: list[Delivery] = []
        for place in self._places.values() if places is None else places:
            if place.gate.open:
                found.extend(self._sweeping(place, lambda p: [
                    dataclasses.replace(d, tenant=p.name) for d in p.gaps.ready()], []))
                self._sweeping(place, lambda p: p.gaps.park_stale(), 0)
                place.parked_keys = self._sweeping(place, lambda p: p.admin.parked_key_count(),
                                                   place.parked_keys)
        return found

    def _sweeping(self, place: Place, fn: Callable[[Place], T], otherwise: T) -> T:
        """``fn(place)``; an outage closes the place's gate and gives ``otherwise``."""
        try:
            return fn(place)
        except Exception as exc:
            if is_outage(exc):
                place.gate.closed(place.settler.outages.failed(exc))
            elif isinstance(exc, DBAPIError):
                place.gate.closed(BACKOFF.cap, unchecked=True)
            else:
                log.exception("%s: inbox sweep failed", place.what)
            return otherwise

    def parked_key_count(self) -> int:
        """Parked keys of every tenant, as last counted by the sweep."""
        return sum(p.parked_keys for p in self._places.values())

    # -- operators ----------------------------------------------------------------

    def replay_unknown(self, topic: str, key: str | None) -> ParkedReplay:
        """Send the key's ``tenant_unknown`` messages to their tenants, in seq order per tenant.

        A message whose tenant is still unknown stays, and with it the later
        ones naming the same tenant (or none). Each other one goes through its
        tenant's transaction as if it had just arrived (applied, held behind a
        gap, a duplicate, or parked there when its handler fails: then replay
        it with ``tenant=``), and only then leaves the default database's
        ``inbox_parked``.
        """
        self.refresh(force=True)
        default = self.default
        rows = [r for r in default.sessions.run(self._unknown_rows, topic, key)
                if r.reason is Reason.TENANT_UNKNOWN]
        if not rows:
            name = f"key {key!r}" if key is not None else "unkeyed message"
            raise NotParkedError(f"no {name} of topic {topic!r} is parked as tenant_unknown in "
                                 f"group {default.store.group!r}")
        moved, stuck, error = 0, set[str](), None
        for row in rows:
            name, why = self.name_of(row.delivery.message)
            place = self._places.get(name) if name else None
            if place is None or name in stuck:
                # Its tenant is still unknown: it stays, and so do the later ones naming the same.
                stuck.add(name)
                error = error or why or f"tenant {name!r} is still not among the inbox's tenants"
                continue
            d = delivery(row.delivery.message, row.delivery.partition, row.delivery.offset,
                         origin=Origin.CALLER)
            d = dataclasses.replace(d, tenant=name)
            committed = place.step.apply([d])
            for failure in committed.failed:
                _, parked = place.step.park(d, failure.error, failure.traceback)
                if parked is not None:
                    place.settler.alerter.parked([parked])
            place.settler.alerter.parked(committed.parked)
            default.sessions.run(self._unpark, row.id)
            moved += 1
        remaining = len(rows) - moved
        return ParkedReplay(applied=moved, remaining=remaining, unparked=not remaining, error=error)

    def _unknown_rows(self, topic: str, key: str | None) -> list[ParkedRow]:
        with self.default.sessions() as session:
            return self.default.store.parked(session, topic, key)

    def _unpark(self, row_id: int) -> None:
        with self.default.sessions() as session, session.begin():
            self.default.store.unpark(session, row_id)


def _same_url(url: str, other: sa.URL) -> bool:
    try:
        return sa.make_url(url).render_as_string(hide_password=False) == other.render_as_string(
            hide_password=False)
    except Exception:  # not a URL: creating its engine says so
        return False


def _described(exc: BaseException) -> str:
    """``exc`` as stored and alerted: its type and text, escaped (no NUL, no surrogate), short."""
    try:
        text = str(exc)
    except Exception:
        text = "(its text cannot be shown)"
    return f"{type(exc).__name__:.80}: {repr(text)[1:-1][:200]}"


def tenant_tables(tables: OutboxTables, tenant: Tenant) -> OutboxTables:
    """The inbox's tables as they are named in ``tenant``'s schema (for checks and creation)."""
    return OutboxTables(prefix=tables.prefix, schema=tenant.schema)


def tenant_session_engine(engine: Engine, tenant: Tenant) -> Engine:
    """``engine`` with ``tenant``'s schema for every unqualified table (the pool is shared)."""
    if tenant.schema is None:
        return engine
    return engine.execution_options(schema_translate_map={None: tenant.schema})

