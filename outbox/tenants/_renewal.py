"""The fleet's shard leases, renewed per database: a thread each, a transaction per few dozen tenants.

A single relay renews its leases on a thread of its own, so that a batch that
blocks on the broker never lets them lapse. A fleet does the same once per
database, not per tenant: every renewal interval (TTL/3) one thread takes the
tenants of its database, sorted by schema, ``RENEW_CHUNK`` at a time, and
renews each one's leases (heartbeat, renew, take up to the fair share) inside
one transaction. 500 tenants of one database cost 16 commits every interval
instead of 500 transactions on the workers, and the workers' turns are
batches only, so polls no longer need to come every renewal interval to keep
idle tenants' leases.

What a round costs was most of what an idle fleet cost: three statements a
tenant (``Leases._heartbeat``). On PostgreSQL a chunk is now one statement
(``relay._leases_shared``); elsewhere its tenants' three statements follow one
another, with no savepoint around each. A tenant whose leases cannot be
renewed for a reason of its own (its tables dropped) rolls its chunk back,
and the chunk is renewed again tenant by tenant, each in a savepoint, so that
its failure undoes none of the others' renewals. The error (or a changed
shard count) is handed to its next turn, which fails the tenant as if its
step had raised it. A database outage is told
to the database's gate (logged once); its tenants' steps probe it. A tenant
that took new shards (or must give some back) is woken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from sqlalchemy import Connection, Engine

from transports._logsafe import safe_logger

from ..core._envelope import utcnow
from ..core._outage import is_database_outage
from ..relay import RelayStep
from ..relay._leases_shared import renew_together
from ..relay._session import relay_engine
from ._schedule import Schedule
from ._units import FleetDatabase, Unit

log = safe_logger("outbox.relay")

RENEW_CHUNK = 32
"""Tenants renewed per transaction: its locks (their heartbeat rows, their leases) stay short."""


class LeaseRenewal:
    """Renews the leases of each database's tenants every ``every`` seconds, a thread per database."""

    def __init__(self, *, every: float, schedule: Schedule, stopping: threading.Event, worker_id: str,
                 answered: Callable[[FleetDatabase, float], None]) -> None:
        self.every = every
        self._schedule = schedule
        self._stopping = stopping
        self._worker_id = worker_id
        self._answered = answered

    def start(self, db: FleetDatabase) -> None:
        """Renew ``db``'s tenants' leases from now on, until the fleet stops."""
        if db.renewer is None:
            db.renewer = threading.Thread(target=self._loop, args=(db,), name="outbox-relay-leases",
                                          daemon=True)
            db.renewer.start()

    def _loop(self, db: FleetDatabase) -> None:
        engine = relay_engine(db.engine)
        while not self._stopping.wait(self.every):
            if db.gate.down:
                continue  # its tenants' steps probe it; their leases expire if it stays down
            started = time.monotonic()
            try:
                self.renew(db, engine)
            except Exception as exc:
                if is_database_outage(exc):
                    db.gate.failed(exc)
                else:
                    log.exception("relay %s: could not renew its tenants' leases", self._worker_id)
            else:
                # A round that began before an outage another thread met says nothing of now.
                self._answered(db, started)

    def renew(self, db: FleetDatabase, engine: Engine) -> None:
        """One round over ``db``'s tenants; raises a database outage, hands each tenant its own failure."""
        with self._schedule.lock:
            units = sorted((unit for unit in db.units.values() if unit.step is not None and not unit.removed),
                           key=lambda unit: unit.tenant.schema or "")
        shared = engine.dialect.name != "sqlite"  # pysqlite's savepoints are not to be trusted
        postgres = engine.dialect.name == "postgresql"
        for start in range(0, len(units), RENEW_CHUNK):
            chunk = [(unit, unit.step) for unit in units[start:start + RENEW_CHUNK]]
            held = [set(step.leases.owned()) if step is not None else set() for _, step in chunk]
            with engine.connect() as conn:
                if not shared:
                    renewed = [self._alone(conn, unit, step, conn.begin) for unit, step in chunk]
                elif (together := self._together(conn, chunk, postgres)) is not None:
                    renewed = together
                else:  # one tenant's own failure undid the chunk: again, each tenant in a savepoint
                    with conn.begin():
                        renewed = [self._alone(conn, unit, step, conn.begin_nested) for unit, step in chunk]
            for (unit, step), before, after in zip(chunk, held, renewed, strict=True):
                if step is not None and after is not None and (set(after) - before or step.leases.surplus):
                    self._schedule.wake(unit)  # new shards to serve, or surplus to give back

    def _together(self, conn: Connection, chunk: list[tuple[Unit, RelayStep | None]], postgres: bool
                  ) -> list[dict[int, int] | None] | None:
        """The chunk's leases renewed in one transaction, without a savepoint each; None if a tenant failed.

        On PostgreSQL one statement renews the chunk (``_leases_shared``);
        elsewhere each tenant's three follow one another (``Leases._heartbeat``).
        A savepoint and its release would add two a tenant. A tenant's failure
        in the statements rolls the chunk back, to be renewed again tenant by
        tenant; a database outage is raised.
        """
        try:
            if postgres:
                return self._in_one_statement(conn, chunk)
            with conn.begin():
                return [_maintain(conn, unit, step) for unit, step in chunk]
        except Exception as exc:
            if is_database_outage(exc):
                raise
            return None

    def _in_one_statement(self, conn: Connection, chunk: list[tuple[Unit, RelayStep | None]]
                          ) -> list[dict[int, int] | None]:
        """The chunk renewed by one statement, each tenant's ``Leases`` held from the round to its answer.

        What a tenant's answer says (shards lost, taken, a changed shard count)
        is taken in after the commit; a failure there is its own (its next turn
        fails it), the others' renewals stand.
        """
        steps = [(unit, step) for unit, step in chunk if step is not None]
        owned: dict[int, dict[int, int] | None] = {}
        with ExitStack() as locked:
            entered = [(unit, step, locked.enter_context(step.leases.shared_round())) for unit, step in steps]
            # Timed once every lock is held: a tenant's lock may be held for long (its own renewal
            # waiting on a row lock, a release), and the rounds of the tenants before it would begin
            # that long before their statement, renewing them for that much less than a TTL.
            now = utcnow()
            rounds = [(unit, step, None if round_ is None else round_.at(now))
                      for unit, step, round_ in entered]
            members = [(unit.tenant.schema, step.leases, round_) for unit, step, round_ in rounds
                       if round_ is not None]
            conn.execution_options(schema_translate_map=None)
            with conn.begin():
                answers = iter(renew_together(conn, members))
            for unit, step, round_ in rounds:
                if round_ is None:  # it gave its leases back: left alone, as maintain(conn) does
                    owned[id(unit)] = {}
                    continue
                try:
                    owned[id(unit)] = step.leases_maintained(step.leases.settle_round(round_, *next(answers)))
                except Exception as exc:
                    if is_database_outage(exc):
                        raise
                    unit.lease_failure = exc  # its next turn fails the tenant with it
                    self._schedule.wake(unit)
                    owned[id(unit)] = None
        return [owned.get(id(unit)) for unit, _ in chunk]

    def _alone(self, conn: Connection, unit: Unit, step: RelayStep | None,
               begin: Callable[[], Any]) -> dict[int, int] | None:
        """``unit``'s leases renewed in a transaction (or savepoint) of their own; None if it failed."""
        try:
            with begin():
                return _maintain(conn, unit, step)
        except Exception as exc:
            if is_database_outage(exc):
                raise
            unit.lease_failure = exc  # its next turn fails the tenant with it
            self._schedule.wake(unit)
            return None


def _maintain(conn: Connection, unit: Unit, step: RelayStep | None) -> dict[int, int] | None:
    """``step``'s leases renewed on ``conn``, under its tenant's schema; None without a step."""
    if step is None:
        return None
    schema = unit.tenant.schema
    conn.execution_options(schema_translate_map={None: schema} if schema is not None else None)
    return step.maintain_leases(conn)


