"""What a fleet serves: each tenant as a ``Unit``, in a ``FleetDatabase`` shared with its neighbours.

Plain state, guarded by the schedule's lock (``_schedule``): the scheduler
moves a unit between its states, the fleet's tenants (``_fleet_tenants``)
build, fail and close its step, and a database (``_databases``) finds its
units by schema when a notification names one.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

from sqlalchemy import Engine

from ..core._outage import OutageGate, OutageTracker
from ..core._tenant import Tenant
from ..relay import BatchResult, RelayStep
from ._turn_state import TurnState


@dataclass(eq=False)
class Unit:
    """One tenant as the fleet serves it: its ``RelayStep`` and its place in the schedule."""

    tenant: Tenant
    db: FleetDatabase
    step: RelayStep | None = None
    """None until its stored settings were read (or after its failure dropped it)."""
    state: TurnState = TurnState.IDLE
    polled: bool = False
    """Queued for a poll rather than woken."""
    again: bool = False
    """Woken while running: queued again as soon as its step ends."""
    generation: int = 0
    """Counts its timers: a timer of an older generation is moot."""
    removed: bool = False
    failures: int = 0
    reported: str | None = None
    """Its last failure as logged: logged again only when it changes."""
    retry_at: float = 0.0
    last: BatchResult = field(default_factory=BatchResult)
    served: bool = False
    """It has run a step: its statements are built (the fleet freezes the heap after)."""
    lease_failure: tuple[RelayStep, Exception] | None = None
    """The step whose leases could not be renewed (``_renewal``), and why: its next turn fails with
    it. Only that step's: a renewal round that began before a turn dropped the step ends after, and
    its failure said nothing of the step built on the tables made again (it failed the new step's
    first turn, and was logged as a second failure)."""
    idle_turns: int = 0
    """Its turns since a poll last found rows: its polls back off with them (``_idle_polls``)."""
    unannounced: bool = False
    """A poll found rows (a writer that never notifies), and no turn since came back empty: its
    next polls come every ``poll_interval`` (``_idle_polls``), through the full batches that drain them."""
    backlogged: bool = False
    """Its last turn fetched a full batch: more is waiting (``_shares``)."""
    kept: bool = False
    """Its close did not give its leases back (they expire within their TTL): ``FleetTenants.close``."""


@dataclass(eq=False)
class FleetDatabase:
    """One database of the fleet: its engine (one pool for all its schemas), gate and listener."""

    engine: Engine
    owned: bool
    """The fleet made the engine (from a URL) and disposes of it."""
    outage: OutageTracker
    """Its outages, logged once for all its tenants' steps."""
    gate: OutageGate
    """Closed while it is down: one step at a time probes it."""
    units: dict[str | None, Unit] = field(default_factory=dict)
    """Its tenants by schema, for the notifications."""
    listener: threading.Thread | None = None
    listening: bool = False
    """Its LISTEN connection is up: a commit's notification wakes its tenant, whose polls may be rare."""
    renewer: threading.Thread | None = None
    """Renews its tenants' leases (``_renewal``)."""
    default_schema: str | None = None
    """``current_schema()`` of its engine: the schema of its tenant without one, once looked up."""
    server: Hashable | None = None
    """The server it is on, as the server says (``core._identity``), once a tenant of it was claimed:
    what its slots are counted by (``_slots``)."""

    @property
    def down(self) -> bool:
        """Its gate is closed: its tenants wait for a probe to find it up."""
        return self.gate.down
