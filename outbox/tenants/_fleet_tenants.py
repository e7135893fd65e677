"""The tenants a fleet serves, as ``Unit``s: added and removed, their steps built, failed, closed.

``FleetTenants`` follows the tenant source: a new tenant gets a unit in its
database (``_databases``) and, once its stored settings are read, a
``RelayStep`` (built by the fleet); a removed one finishes its step and gives
its leases back. A tenant that fails for a reason of its own (tables missing,
dropped, resharded) is logged once per distinct error and tried again with
backoff, its step built anew from its stored settings; a database outage is
told to its database's gate instead, once for all its tenants. Its lock is the
schedule's (``_schedule``), which guards every unit's state.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable

from sqlalchemy import Engine
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import NullPool

from transports._logsafe import safe_logger

from ..core._engine import create_engine
from ..core._errors import ConfigurationError, SchemaError
from ..core._identity import schema_identity
from ..core._outage import OutageBackoff, first_line, is_database_outage
from ..core._schema_claims import SchemaClaims, SharedSchemaError
from ..core._tenant import Tenant, TenantShare, TenantSource
from ..relay import RelayStep, TenantRelayMetrics
from ..relay._closers import RELEASE_WITHIN, Closers
from ._databases import FleetDatabases
from ._schedule import Schedule
from ._turn_state import TurnState
from ._units import FleetDatabase, Unit

log = safe_logger("outbox.relay")

_TENANT_BACKOFF = OutageBackoff(first=1.0, cap=60.0)
"""How a tenant that fails for a reason of its own (missing tables) is retried: 1 s doubling to 60 s."""

NAMED_AT_MOST = 10
"""Tenants a log line names; a stop of 500 tenants whose release outlasted its bound named all 500."""


def some_names(names: list[str]) -> str:
    """The first ``NAMED_AT_MOST`` of ``names``, and an ellipsis when there are more."""
    return ", ".join(names[:NAMED_AT_MOST]) + (", …" if len(names) > NAMED_AT_MOST else "")


LOOKUP_PAUSE_MIN = 30.0
LOOKUP_PAUSE_MAX = 600.0
"""Seconds before another share's database that could not tell its schemas is asked again: from the
first to the second, doubling (``FleetTenants._identified``)."""

BUILD_STALLED = 3.0
"""Seconds ``start_pending`` waits while no tenant's step of any database is done: a hung server's
builder goes on alone, and the tenants of the others are read and served meanwhile."""


class FleetTenants:
    """The fleet's units by tenant name; ``make_step`` builds a tenant's ``RelayStep``. Thread-safe."""

    def __init__(self, source: TenantSource, *, databases: FleetDatabases, schedule: Schedule,
                 make_step: Callable[[Unit], RelayStep], metrics: TenantRelayMetrics, worker_id: str,
                 default: str | Engine | None, share: TenantShare | None = None) -> None:
        self.source = source
        self._share = share
        """Serve only this share's tenants (``TenantShare``); None: every tenant of the source."""
        self._elsewhere: dict[str, tuple[Hashable, Tenant]] = {}
        """By name, the tenants of the source another share serves, with what holds their schema here."""
        self._lookup_pauses: dict[str, tuple[float, float]] = {}
        """By database, until when (monotonic) its schemas are not asked again, and the pause."""
        self._lookups: dict[str, Engine] = {}
        """Connection-less engines (``NullPool``) on the databases of those tenants, by URL: to ask
        their servers which schema they are, without a pool or listener for them."""
        self._held_names: frozenset[str] | None = None
        """The share's tenants last logged (``_of_share``)."""
        self._databases = databases
        self._schedule = schedule
        self._make_step = make_step
        self._metrics = metrics
        self.worker_id = worker_id
        self._default = default
        self.units: dict[str, Unit] = {}
        self._claims = SchemaClaims()
        """Which tenant serves each schema, by what its server says (``outbox.core._schema_claims``)."""
        self._unfrozen: set[Unit] = set()
        """Tenants built since the heap was last frozen (``freeze_new``)."""
        self._retiring: set[Unit] = set()
        """Removed while a worker ran their step: still served until that step ends and they close."""
        self._closers: Closers[Unit] = Closers(self._close_on_closer, late=self._given_back_late)
        """The units a closer thread is giving back (``close_all``), a refresh's removed ones too."""
        self._building: set[FleetDatabase] = set()
        """Databases whose tenants' steps a builder thread is building (``start_pending``)."""
        self._built = 0
        """Steps built or failed so far: ``start_pending`` waits while this moves."""

    def served(self) -> list[str]:
        """The names of the tenants served now (those whose tables were read).

        A tenant removed while its step runs is served until that step ends:
        once its name is gone from here, nothing of it is sent any more.
        """
        with self._schedule.lock:
            units = [*self.units.values(), *self._retiring]
            return sorted({unit.tenant.name for unit in units if unit.step is not None})

    def refresh(self, *, stalled_after: float | None = BUILD_STALLED) -> None:
        """Read the tenants again: start serving new ones, drop removed ones (``start_pending``)."""
        try:
            every = {tenant.name: tenant for tenant in self.source()}
        except Exception as exc:
            if is_database_outage(exc):
                log.warning("relay %s: cannot read its tenants (%s); keeps serving the ones it has",
                            self.worker_id, first_line(exc))
                return
            raise
        wanted = self._of_share(every)
        self._refuse_shared_places(every.values(), wanted)
        with self._schedule.lock:
            gone = [unit for name, unit in self.units.items()
                    if name not in wanted or wanted[name].address != unit.tenant.address]
            for unit in gone:
                del self.units[unit.tenant.name]
                unit.removed = True
                self._schedule.unqueue_locked(unit)  # no worker starts it while it is closed
            # Decided under the lock: a running one is closed by its worker, the others here.
            closing = [unit for unit in gone if unit.state is not TurnState.RUNNING]
            self._retiring.update(unit for unit in gone if unit.state is TurnState.RUNNING)
            new = [tenant for name, tenant in wanted.items() if name not in self.units]
        for unit in gone:
            log.info("relay %s: tenant %s removed", self.worker_id, unit.tenant.name)
            self._metrics.forget(unit.tenant.name)
        # Each database's on a thread, within a bound: a hung server's must not hold the refresh.
        self.close_all(closing)
        for tenant in new:
            unit = Unit(tenant, self._databases.of(tenant))
            with self._schedule.lock:
                self.units[tenant.name] = unit
                unit.db.units[tenant.schema] = unit
        self.start_pending(stalled_after=stalled_after)

    def _of_share(self, every: dict[str, Tenant]) -> dict[str, Tenant]:
        """The tenants of ``every`` this process serves: its share's (all without one); logged when
        they change."""
        if self._share is None:
            return every
        wanted = {name: tenant for name, tenant in every.items() if self._share.holds(name)}
        names = frozenset(wanted)
        if names != self._held_names:
            self._held_names = names
            log.info("relay %s: tenant share %s: %d of the source's %d tenants", self.worker_id,
                     self._share, len(wanted), len(every))
        return wanted

    def _refuse_shared_places(self, tenants: Collection[Tenant], wanted: dict[str, Tenant]) -> None:
        """Two tenants in one schema of one database, however their URLs spell it: refused.

        The source's own check compares what the tenants say; this one what their
        servers say (``SchemaClaims``). Served twice, a schema's rows would go out
        under two names, by two steps of one worker id, which do not fence each
        other. A database down now is asked again before its tenants are served.

        With a share, every tenant of the source is asked, not only ``wanted``
        (the share's): two names of one schema in two shares would be served by
        two processes, each under its name. The others' databases are asked
        through connection-less engines, and their schemas held here for them
        (``_hold_elsewhere``): a tenant of this share whose database answers only
        later is refused its claim of one of them.
        """
        found, elsewhere = [], []
        for tenant in tenants:
            if tenant.database is None and self._default is None:
                continue  # refused by name when it is served
            try:
                if tenant.name in wanted:
                    db = self._databases.of(tenant)
                    if not db.down:
                        found.append((tenant, db.engine))
                elif (engine := self._identified(tenant)) is not None:
                    elsewhere.append((tenant, engine))
            except ArgumentError:  # not the URL itself: it may hold a password
                raise ConfigurationError(f"tenant {tenant.name}: its database is not a URL") from None
        self._claims.refuse_shared(found + elsewhere)
        if self._share is not None:
            self._forget_lookups(tenant for tenant in tenants if tenant.name not in wanted)
            self._hold_elsewhere(elsewhere)

    def _identified(self, tenant: Tenant) -> Engine | None:
        """An engine on which ``tenant``'s schema (another share's tenant) is known, asked once; None
        while it cannot be (its database down, frozen or refusing this process: asked again after
        a pause that grows to ``LOOKUP_PAUSE_MAX``, so that it holds no refresh for long).

        Whatever the error: the tenant is its own share's to serve or refuse, and an error of
        its database must not stop this share's reading. The fleet's own engine on its database if
        it has one, else one without a pool, kept while a tenant of the source is there.
        """
        database = tenant.database if tenant.database is not None else self._default
        assert database is not None  # a tenant of no database is skipped by the caller
        if isinstance(database, Engine):
            engine, key = database, f"engine:{id(database)}"
        else:
            if database not in self._lookups:
                self._lookups[database] = create_engine(database, poolclass=NullPool)
            engine, key = self._lookups[database], database
        pause = self._lookup_pauses.get(key)
        if pause is not None and time.monotonic() < pause[0]:
            return None
        try:
            schema_identity(engine, tenant.schema)
        except Exception as exc:
            wait = LOOKUP_PAUSE_MIN if pause is None else min(pause[1] * 2, LOOKUP_PAUSE_MAX)
            self._lookup_pauses[key] = (time.monotonic() + wait, wait)
            if pause is None:
                log.info("relay %s: cannot tell which schema tenant %s (another share's) is in: %s; "
                         "asked again later", self.worker_id, tenant.name, first_line(exc))
            return None
        self._lookup_pauses.pop(key, None)
        return engine

    def _forget_lookups(self, others: Iterable[Tenant]) -> None:
        """Drop the lookup engines (and pauses) of databases no tenant of ``others`` is in any more:
        URLs that come and go (rotated credentials) would otherwise pile up."""
        urls = {tenant.database if tenant.database is not None else self._default for tenant in others}
        for url in [url for url in self._lookups if url not in urls]:
            del self._lookups[url]
            self._lookup_pauses.pop(url, None)

    def _hold_elsewhere(self, others: list[tuple[Tenant, Engine]]) -> None:
        """Hold the schemas of ``others`` (other shares' tenants) for them: a tenant of this share
        in one of them is refused (``SchemaClaims.claim``), as it would be beside a tenant served
        here. A database that does not answer is asked again at the next refresh."""
        names = {tenant.name for tenant, _ in others}
        for name in [name for name in self._elsewhere if name not in names]:
            self._claims.release(self._elsewhere.pop(name)[0])
        for tenant, engine in others:
            held = self._elsewhere.get(tenant.name)
            if held is not None and held[1] == tenant:
                continue
            if held is not None:  # pointed elsewhere
                self._claims.release(held[0])
            holder = ("elsewhere", tenant.name)
            try:
                self._claims.claim(holder, tenant, engine)  # its identity is known: no query
            except SharedSchemaError:
                # One of this process's units not in this reading has it still (renamed or moved
                # to another share while its step runs): held once that unit has closed.
                self._elsewhere.pop(tenant.name, None)
                continue
            self._elsewhere[tenant.name] = (holder, tenant)

    def start_pending(self, *, stalled_after: float | None = BUILD_STALLED) -> None:
        """Build the step of every tenant that has none yet: reads its stored settings.

        Each database's tenants on a thread of its own, waited for while any of
        them gets on (``stalled_after`` seconds without a step built): a server
        that hangs (it fails nothing, so its gate stays open) holds its own
        builder, whose database gets no other until it is done, and the refresh
        goes on with the other databases' tenants. ``stalled_after=None`` waits
        for every builder: ``run_once`` steps every tenant, as a single relay's
        ``run_once`` steps its one database, however slow its server is.
        """
        pending: dict[FleetDatabase, list[Unit]] = {}
        with self._schedule.lock:
            for unit in self.units.values():
                if (unit.step is not None or unit.removed or time.monotonic() < unit.retry_at
                        or unit.db in self._building
                        # removed and added again: its old unit ends its last step first
                        or any(old.tenant.name == unit.tenant.name for old in self._retiring)):
                    continue
                pending.setdefault(unit.db, []).append(unit)
            self._building.update(pending)
            built = self._built
        builders = [threading.Thread(target=self._build_all, args=(db, units), name="outbox-relay-build",
                                     daemon=True) for db, units in pending.items()]
        for builder in builders:
            builder.start()
        patience = math.inf if stalled_after is None else stalled_after
        stalled_at = time.monotonic() + patience
        while any(builder.is_alive() for builder in builders) and time.monotonic() < stalled_at:
            next(builder for builder in builders if builder.is_alive()).join(0.05)
            with self._schedule.lock:
                if self._built != built:
                    built, stalled_at = self._built, time.monotonic() + patience

    def _build_all(self, db: FleetDatabase, units: list[Unit]) -> None:
        try:
            for unit in units:
                self._build(unit)
                with self._schedule.lock:
                    self._built += 1
        finally:
            with self._schedule.lock:
                self._building.discard(db)

    def _build(self, unit: Unit) -> None:
        """Build ``unit``'s step, unless removed meanwhile; a failure is logged and tried again later."""
        if unit.removed:
            return
        db = unit.db
        if db.gate.admit() is not None:
            return  # its database is down: one caller at a time probes it
        started = time.monotonic()
        try:
            self._claims.claim(unit, unit.tenant, db.engine)
            self._databases.identify(db)
            unit.step = self._make_step(unit)
        except Exception as exc:
            self.failed(unit, exc, "cannot be served")
            return
        finally:
            db.gate.probed()
        self._databases.answered(db, started)
        # Not served yet: its stored settings were read, not its tables (a table dropped from a
        # schema that is kept fails only its first turns); its first turn that ran on them says so.
        log.info("relay %s: serving tenant %s", self.worker_id, unit.tenant.name)
        with self._schedule.lock:
            self._unfrozen.add(unit)
        self._schedule.wake(unit)


    def freeze_new(self) -> None:
        """Freeze the heap again once the tenants built since have served a step, if it was frozen.

        ``outbox relay`` freezes what it loaded before ``run`` (``tune_gc_for_batches``),
        but the tenants' steps, and the statements of their first batch, are built
        inside ``run``: for 500 tenants some 2.8 million objects that every full
        collection walked, a 1.5 s pause of every worker, which a quiet tenant's
        message waited out next to a backlog (docs/benchmarks.md, "Many tenants").
        A process that never froze its heap is left as it is: a library does not
        change interpreter-wide settings on its own.
        """
        with self._schedule.lock:
            if not self._unfrozen or not gc.get_freeze_count():
                return
            if any(unit.step is not None and not unit.removed and not unit.served
                   for unit in self._unfrozen):
                return
            self._unfrozen.clear()
        gc.collect()
        gc.freeze()


    def failed(self, unit: Unit, exc: Exception, what: str) -> float:
        """Log a tenant's own failure once per distinct error; the seconds before it is tried again."""
        if is_database_outage(exc):
            delay = unit.db.gate.failed(exc)
            unit.retry_at = time.monotonic() + delay
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

    def ok(self, unit: Unit) -> None:
        if unit.reported is not None:
            log.warning("relay %s: tenant %s served again", self.worker_id, unit.tenant.name)
        unit.reported, unit.failures = None, 0

    def drop_step(self, unit: Unit, *, quiet: bool = False) -> bool:
        """Give the tenant's step up; ``quiet``: its failure was logged. True unless it held leases
        it could not give back (they expire within their TTL)."""
        step, unit.step = unit.step, None
        return step is None or step.release(quiet=quiet)

    def close(self, unit: Unit) -> bool:
        """Close ``unit``: True unless it held leases it did not give back."""
        with self._schedule.lock:
            left = unit.db.units.get(unit.tenant.schema) is unit and unit.removed
            if left:
                del unit.db.units[unit.tenant.schema]
        if left:  # its server may have no tenant left; one removed mid-step leaves only now
            self._databases.span()
        self._claims.release(unit)
        held = unit.step is not None
        if not unit.db.gate.down:
            released = self.drop_step(unit)
        else:
            released, unit.step = unit.step is None, None  # its database is down: leases expire by their TTL
        if held:  # closed again (a stop closes every tenant twice), it keeps what the first close found
            unit.kept = not released
        with self._schedule.lock:
            self._retiring.discard(unit)
        return released

    def close_all(self, units: list[Unit]) -> list[str]:
        """Close ``units`` (release their leases), each database's on a closer of its own; the
        names of the tenants whose leases are not given back when it returns: their release
        failed (they expire within their TTL), or it still goes on.

        Waits at most ``RELEASE_WITHIN`` seconds (``relay._closers``): a frozen
        database's tenants are left to their lease TTL, and never delay the
        others' release. A tenant an earlier call's closer still releases is
        waited for (within the bound), not released by a second closer beside
        the first; one with nothing to release is closed here.
        """
        going = self._closers.close_within(
            units, group=lambda unit: id(unit.db) if unit.step is not None else None, at_once=self.close)
        if going:
            log.warning("relay %s: %d tenants had not given their leases back after %gs (%s; their "
                        "database is slow or does not answer); their release goes on, and leases it "
                        "cannot give back expire within the lease TTL",
                        self.worker_id, len(going), RELEASE_WITHIN,
                        some_names([unit.tenant.name for unit in units if unit in going]))
        return [unit.tenant.name for unit in units if unit.kept or unit in going]

    def releasing(self) -> list[Unit]:
        """The units whose leases a closer is giving back now (``close_all``), removed ones too."""
        return self._closers.going()

    def _close_on_closer(self, unit: Unit) -> bool:
        """``close`` on a closer: True unless it kept leases; a bug is logged, the others of its
        database are closed still."""
        try:
            self.close(unit)
        except Exception:
            log.exception("relay %s: tenant %s could not be closed", self.worker_id, unit.tenant.name)
            unit.kept = True
        return not unit.kept

    def _given_back_late(self, units: list[Unit], seconds: float) -> None:
        """Tenants a closer gave back past ``RELEASE_WITHIN``: the warning of ``close_all`` said they
        were not."""
        log.info("relay %s: %d tenants gave their leases back %.1fs after their release began (%s)",
                 self.worker_id, len(units), seconds, some_names([unit.tenant.name for unit in units]))
