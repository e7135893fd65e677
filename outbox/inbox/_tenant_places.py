"""The tenants an inbox serves, read from their source, each with its ``Place``.

The source is read again every ``refresh`` seconds (and, for a name no
tenant has, at most every ``LOOKUP_AGAIN``); a failure keeps the tenants as
they were. A tenant keeps its place while it does not change; a database no
tenant is in any more has its pool closed. One engine per database URL, so
one pool per database, shared by its tenants' schemas.

The workers a hung database may hold (``slots``) are counted per server
(``server_of``): two databases of one server, or one database spelled two
ways, hang together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy import Engine

from transports._logsafe import safe_logger

from ..core._envelope import utcnow
from ..core._errors import ConfigurationError
from ..core._identity import known_server
from ..core._schema_claims import DEFAULT_DATABASE_REFUSAL, SchemaClaims
from ..core._slots import Slots
from ..core._tenant import Tenant, TenantSource
from ._outage import OutageLog, is_outage
from ._places import BuildPlace, Place

log = safe_logger("outbox.inbox")

REFRESH = 30.0
"""Seconds between two readings of the tenant source (``Inbox(tenant_refresh=…)``)."""
LOOKUP_AGAIN = 1.0
"""A name no tenant has makes the source be read again, at most this often (or every refresh,
when that is shorter), before it parks."""


def server_of(engine: Engine) -> Hashable:
    """What the slots of ``engine``'s database are counted by: its server, as it says it is, or its
    pool until it was asked (no query here: a hung server is never asked on a worker's way in).

    Known from the first reading of the tenants on (``refuse_shared`` asks every database that
    answers), else from the claim before a tenant's tables are first used.
    """
    server = known_server(engine)
    return engine.pool if server is None else server


class TenantPlaces:
    """The tenants as last read from the source, a ``Place`` each, and the default database's.

    ``refresh`` reads the source again when due; ``place`` and ``serving``
    find a tenant's place (reading the source again for a name not found).
    Thread-safe: the place map is replaced whole at each refresh.
    """

    def __init__(self, source: TenantSource, *, default: Place, build: BuildPlace,
                 refresh: float, pool_size: int) -> None:
        self.source = source
        self.default = default
        self._build = build
        self.refresh_every = refresh
        self.lookup_every = min(LOOKUP_AGAIN, refresh)
        self._pool_size = pool_size
        self.slots = Slots(pool_size)
        self._places: dict[str, Place] = {}
        self._engines: dict[str, Engine] = {}
        self._claims = SchemaClaims()
        """Whose each schema is, by what its server says: the default database's, or one tenant's."""
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._read_since = datetime.min.replace(tzinfo=UTC)
        """When the last successful reading of the source began (wall clock, as ``received_at``)."""
        self._loaded = False
        self.source_log = OutageLog("the tenant source")
        self._reading = threading.Lock()
        """Held while the source is read: one reading at a time, apart from ``_lock``."""


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
                self.source_log.failed(exc)
                return True
            self.source_log.answered()
            self._take(tenants, began)
            return True
        finally:
            self._reading.release()

    def _refuse_the_default(self, tenants: Sequence[Tenant]) -> None:
        """``ConfigurationError`` for a tenant whose tables would be the default database's, or another's.

        In the default database's tables the messages of no known tenant park:
        that tenant's parked list, replay and discard would take them for its
        own, and replay would apply another tenant's message in its tables. Two
        tenants in one schema would share their dedup records. Decided by what
        the servers say (``SchemaClaims``): the default database spelled
        otherwise is the default database. A tenant whose database does not
        answer now is asked again before its tables are first used (``claim``).
        """
        default = self.default
        self._claims.reserve(default, default.engine, default.tables.schema, DEFAULT_DATABASE_REFUSAL)
        self._claims.refuse_shared([(tenant, self._engine_of(tenant)) for tenant in tenants])

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
            self._claims.retain(places.values())
            self._loaded = True
            self._read_since = began
            named = {t.database for t in tenants if isinstance(t.database, str)}
            released = [self._engines.pop(url) for url in list(self._engines) if url not in named]
            self._span()
        # A database no tenant is in any more: its pooled connections would stay open for good (and
        # keep a DROP DATABASE of a tenant that left waiting). Those checked out close when returned.
        for engine in released:
            engine.dispose()

    def _span(self) -> None:
        """Size the slots by the servers the tenants and the default database are on: a server
        that hangs holds at most its slots' share of the workers (``core._slots``)."""
        engines = {id(p.engine.pool): p.engine for p in [*self._places.values(), self.default]}
        self.slots.span(len({server_of(engine) for engine in engines.values()}))

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
        self.claim(found)
        return found

    def claim(self, place: Place) -> None:
        """Before a tenant's tables are used: ``ConfigurationError`` when they are another's (``_claims``)."""
        if place.tenant is not None:
            was = server_of(place.engine)
            self._claims.claim(place, place.tenant, place.engine)
            if server_of(place.engine) != was:  # its server is known now: it may share one
                with self._lock:
                    self._span()

    def get(self, name: str) -> Place | None:
        """Tenant ``name``'s place as last read, or None (the source is not read again)."""
        return self._places.get(name)

    def all(self) -> list[Place]:
        """Every tenant's place, as last read (not the default database's)."""
        return list(self._places.values())

    def due(self) -> bool:
        """The source is due to be read again (``refresh_every`` since the last reading began)."""
        return time.monotonic() - self._read_at >= self.refresh_every

    def serving(self, name: str, received_at: datetime) -> Place | float | None:
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
                self.source_log.failed(exc)
            found = self._places.get(name)
            if found is None and self._read_since <= received_at:
                return self.lookup_every
        return found
