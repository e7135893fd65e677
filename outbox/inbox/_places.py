"""Where one tenant's messages are applied: a ``Place``, the per-database pipeline of a plain inbox.

A place is the very same stages a single-database inbox has (sessions,
store, transaction step, settle stage, parked-key admin, gap sweeper), built
on the tenant's engine, with an ``OutageGate`` in front: while the tenant's
database is down (or its inbox tables are missing) its deliveries are put off
on a timer and one probe at a time tries again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from ..core._outage import OutageGate
from ..core._tables import OutboxTables
from ..core._tenant import Tenant
from ._admin import ParkedAdmin
from ._gaps import GapSweeper
from ._outage import BACKOFF
from ._sessions import Sessions
from ._settle import Settler
from ._transaction import TransactionStep
from .storage import InboxStorage


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
    store: InboxStorage
    step: TransactionStep
    settler: Settler
    admin: ParkedAdmin
    gaps: GapSweeper
    checked: bool = False
    """Its inbox tables were found (checked once, and again after a failure)."""
    parked_keys: int = 0
    missing_looks: int = 0
    """Consecutive looks that found its tables missing: paces the next look like an outage's retries."""
    swept_shut: bool = False
    """Its gate was last closed by an outage its gap sweep met: the sweep probes it (``_tenant_sweep``).
    One a transaction met is its put-off deliveries' to probe: reads that answer say nothing of writes."""
    gate: OutageGate = dataclasses.field(init=False)
    """Closed from an outage (or its tables missing, or not checked yet) until a probe answers:
    its deliveries are put off meanwhile, without touching its database."""

    def __post_init__(self) -> None:
        self.gate = OutageGate(self.settler.outages, closed=not self.checked, least=BACKOFF.first)

    @property
    def name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name

    @property
    def what(self) -> str:
        return "the default database" if self.tenant is None else f"tenant {self.tenant.name}"


BuildPlace = Callable[[Tenant, Engine], Place]
"""Builds a tenant's place on its database's engine (``Inbox._place``)."""

def tenant_tables(tables: OutboxTables, tenant: Tenant) -> OutboxTables:
    """The inbox's tables as they are named in ``tenant``'s schema (for checks and creation)."""
    return OutboxTables(prefix=tables.prefix, schema=tenant.schema)


def tenant_session_engine(engine: Engine, tenant: Tenant) -> Engine:
    """``engine`` with ``tenant``'s schema for every unqualified table (the pool is shared)."""
    if tenant.schema is None:
        return engine
    return engine.execution_options(schema_translate_map={None: tenant.schema})

