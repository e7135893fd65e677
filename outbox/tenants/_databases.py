"""The databases of a fleet: one engine, one outage gate, one lease renewal and one listener each.

However many tenant schemas a database holds, the fleet keeps one pool for it
(``pool_size`` connections), one ``OutageGate`` (its outage is logged once for
all its tenants, and while it is down one step at a time probes it), one
thread renewing all its tenants' leases (``_renewal``) and, on PostgreSQL, one
LISTEN connection whose notifications (``shard:schema``) wake the tenant of
the schema they name; while it is up, its idle tenants are polled rarely
(``_idle_polls``). It knows each database's server (``identify``), by which the
fleet's slots are counted (``_slots``).
"""

from __future__ import annotations

import threading

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ..core._engine import create_engine
from ..core._errors import ConfigurationError
from ..core._identity import database_identity
from ..core._notify import parse_notify_payload
from ..core._outage import OutageBackoff, OutageGate
from ..core._secrets import database_url
from ..core._stopping import RunEnd
from ..core._tenant import Tenant
from ..relay import RelayMetrics, RelayOutages, transaction_pooled_options
from ..relay._wakeup import start_listening
from ._renewal import LeaseRenewal
from ._schedule import Schedule
from ._slots import ServerSlots
from ._units import FleetDatabase

MAX_PROBE_PAUSE = 5.0
"""Seconds between two probes of a database that is down, at most."""


class FleetDatabases:
    """The fleet's databases by URL (or ``Engine``); tenants naming none are in ``default``'s.

    ``start`` starts every database's lease renewal and listener once the fleet
    runs (``started``); a database met later starts its own then. With
    ``transaction_pooled``, the engines it makes from URLs reach their databases
    through a pooler in transaction mode (``relay._session``): nothing is set on a
    session, and nothing prepared, that the pooler would hand to another client.
    """

    def __init__(self, default: str | Engine | None, *, pool_size: int, worker_id: str,
                 metrics: RelayMetrics, poll_interval: float, lease_ttl: float,
                 notify_channel: str | None, schedule: Schedule, stopping: threading.Event,
                 slots: ServerSlots, run_end: RunEnd, transaction_pooled: bool = False) -> None:
        self.default = default
        self._pool_size = pool_size
        self._transaction_pooled = transaction_pooled
        self._worker_id = worker_id
        self._metrics = metrics
        self._probe_pause = OutageBackoff(first=poll_interval / 4, cap=MAX_PROBE_PAUSE)
        self._channel = notify_channel
        self._schedule = schedule
        self._stopping = stopping
        self._slots = slots
        self._by_key: dict[str, FleetDatabase] = {}
        self._renewal = LeaseRenewal(ttl=lease_ttl, schedule=schedule, stopping=stopping,
                                     worker_id=worker_id, answered=self.answered, run_end=run_end)
        self.started = False

    def values(self) -> list[FleetDatabase]:
        return list(self._by_key.values())

    def of(self, tenant: Tenant) -> FleetDatabase:
        """The database ``tenant`` lives in, made on first use."""
        database = tenant.database if tenant.database is not None else self.default
        if database is None:
            raise ConfigurationError(
                f"tenant {tenant.name} names no database and the TenantRelay has no default database")
        key = database if isinstance(database, str) else f"engine:{id(database)}"
        db = self._by_key.get(key)
        if db is None:
            engine = (database if isinstance(database, Engine)
                      else create_engine(database, pool_size=self._pool_size, max_overflow=0,
                                         **(transaction_pooled_options(database)
                                            if self._transaction_pooled else {})))
            shown = database_url(database if isinstance(database, str) else str(database.url))
            tracker = RelayOutages.tracker(f"relay {self._worker_id}: database {shown}", "database",
                                           self._metrics, self._probe_pause)
            db = FleetDatabase(engine, owned=not isinstance(database, Engine), outage=tracker,
                               gate=OutageGate(tracker))
            self._by_key[key] = db
            if self.started and not self._stopping.is_set():
                self._start(db)
        return db

    def identify(self, db: FleetDatabase) -> None:
        """Learn ``db``'s server, once a tenant of it was claimed (``SchemaClaims`` read it: no query),
        and count it in the slots' span.

        The server, not the database: the databases of one server hang together.
        Spanned again even when the server was known: its tenants may all have
        been removed (it was no longer counted) and this one be back.
        """
        if db.server is None:
            identity = database_identity(db.engine)
            db.server = (identity.dialect, identity.server)
        self.span()

    def span(self) -> None:
        """Size the slots by the servers the fleet's tenants are on (``_slots``)."""
        with self._schedule.lock:
            servers = {db.server for db in self._by_key.values() if db.server is not None and db.units}
        self._slots.span(len(servers))

    def start(self) -> None:
        """From now on every database's tenants' leases are renewed, and its notifications wake them."""
        self.started = True
        for db in self.values():
            self._start(db)

    def _start(self, db: FleetDatabase) -> None:
        self._renewal.start(db)
        self._listen(db)

    def _listen(self, db: FleetDatabase) -> None:
        if db.listener is not None or self._channel is None:
            return
        db.listener = start_listening(db.engine, [self._channel],
                                      on_notify=lambda payload: self._notified(db, payload),
                                      on_connect=lambda: self._listening(db, True),
                                      on_lost=lambda: self._listening(db, False), stop=self._stopping)

    def _listening(self, db: FleetDatabase, up: bool) -> None:
        """``db``'s LISTEN connection is (back) up, or lost: every tenant of it is polled now.

        Up: a commit while it was down was notified to nobody. Lost: a
        notification may have been lost with it, and from now until it is back
        the tenants' polls come every ``poll_interval`` (``_idle_polls``), not rarely.
        """
        with self._schedule.lock:
            db.listening = up
        self.wake_all(db)

    def _notified(self, db: FleetDatabase, payload: str) -> None:
        """A commit in ``db``: wake the tenant of the schema the payload names (``outbox.core._notify``).

        Another process may NOTIFY on the channel: a payload that is not ours wakes nobody.
        The payload names the schema as the server does (``current_schema()`` for a writer
        without one), so the tenant without a schema is matched by its own
        ``current_schema()``, looked up once: the schema it is, not how a writer spelled it.
        """
        try:
            _, schema = parse_notify_payload(payload)
        except ValueError:
            return
        unit = db.units.get(schema)
        if unit is None and schema is not None and None in db.units and schema == self._default_schema(db):
            unit = db.units.get(None)
        if unit is not None:
            self._schedule.wake(unit)

    @staticmethod
    def _default_schema(db: FleetDatabase) -> str | None:
        """``db``'s ``current_schema()`` (its tenant without a schema); None while it cannot be read."""
        if db.default_schema is None:
            try:
                with db.engine.connect() as conn:
                    db.default_schema = conn.exec_driver_sql("SELECT current_schema()").scalar()
            except SQLAlchemyError:  # down: the tenant's polls and the wake-ups of a reconnect cover it
                return None
        return db.default_schema

    def wake_all(self, db: FleetDatabase) -> None:
        """Poll every tenant of ``db`` (its listener (re)connected, or it answers again)."""
        with self._schedule.lock:
            for unit in db.units.values():
                self._schedule.wake_locked(unit, poll=True)

    def answered(self, db: FleetDatabase, started: float | None = None) -> None:
        """``db`` answered (work ``started`` then): its gate opens; if it was closed, its tenants wake."""
        if db.gate.answered(started):
            self.wake_all(db)

    def problem(self) -> str | None:
        """Every database down: the process is not ready. One of several down: it is."""
        databases = self.values()
        down = sum(1 for db in databases if db.gate.down)
        if databases and down == len(databases):
            return f"all {down} of its databases are unreachable"
        return None

    def threads(self) -> list[threading.Thread]:
        """The databases' listeners and lease renewals (joined, within a bound, at the stop)."""
        return [thread for db in self.values() for thread in (db.listener, db.renewer) if thread is not None]

    def dispose(self) -> None:
        """Close the pools of the engines the fleet made."""
        for db in self.values():
            if db.owned:
                db.engine.dispose()

