"""The fleet's shard leases, renewed per database: a thread each, a transaction per few dozen tenants.

A single relay renews its leases on a thread of its own, so that a batch that
blocks on the broker never lets them lapse. A fleet does the same once per
database, not per tenant: every renewal interval (TTL/3) one thread takes the
tenants of its database, sorted by schema, ``RENEW_CHUNK`` at a time, and
renews each one's leases (heartbeat, renew) inside one transaction; after its
COMMIT each tenant takes free shards up to its fair share. 500 tenants of one
database cost 16 commits every interval instead of 500 transactions on the
workers, and the workers' turns are batches only, so polls no longer need to
come every renewal interval to keep idle tenants' leases.

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
from ..core._stopping import RunEnd
from ..relay import RelayStep
from ..relay._leases import Answer, LeaseRound, renew_interval, renewal_watched
from ..relay._leases_shared import renew_together
from ..relay._session import relay_engine
from ._schedule import Schedule
from ._units import FleetDatabase, Unit

log = safe_logger("outbox.relay")

RENEW_CHUNK = 32
"""Tenants renewed per transaction: its locks (their heartbeat rows, their leases) stay short."""


class LeaseRenewal:
    """Renews the leases (``ttl`` seconds) of each database's tenants every TTL/3, a thread per database."""

    def __init__(self, *, ttl: float, schedule: Schedule, stopping: threading.Event, worker_id: str,
                 answered: Callable[[FleetDatabase, float], None], run_end: RunEnd | None = None) -> None:
        self.ttl = ttl
        self.every = renew_interval(ttl)
        self._schedule = schedule
        self._stopping = stopping
        self._worker_id = worker_id
        self._answered = answered
        self._run_end = run_end or RunEnd()
        """Ended as the fleet's run returns: a round still hanging once it stops tells nothing."""

    def start(self, db: FleetDatabase) -> None:
        """Renew ``db``'s tenants' leases from now on, until the fleet stops."""
        if db.renewer is None:
            db.renewer = threading.Thread(target=self._loop, args=(db,), name="outbox-relay-leases",
                                          daemon=True)
            db.renewer.start()

    def _loop(self, db: FleetDatabase) -> None:
        engine = relay_engine(db.engine)
        while not self._stopping.wait(self.every):
            # Tried while its gate is closed too, and its answer opens it: the tenants' steps probe it,
            # but a step may wait long in the broker before it asks the database anything (an
            # exactly-once tenant's progress-topic check, up to the transaction timeout), and the
            # leases of a database back meanwhile lapsed unrenewed, for another process to take.
            # A round unanswered for the lease TTL closes the gate (``renewal_watched``): a frozen
            # server fails no call, and its tenants' turns would each wait on it in silence.
            started = time.monotonic()
            try:
                with renewal_watched(db.gate.failed, self.ttl, unless=self._run_end.over(self._stopping)):
                    self.renew(db, engine)
            except Exception as exc:
                if is_database_outage(exc):
                    if not db.gate.down:  # told once; while it is down the probes' backoff paces the gate
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
        for start in range(0, len(units), RENEW_CHUNK):
            chunk = [(unit, unit.step) for unit in units[start:start + RENEW_CHUNK]]
            held = [set(step.leases.owned()) if step is not None else set() for _, step in chunk]
            with engine.connect() as conn:
                renewed = self._renew_chunk(conn, chunk)
            for (unit, step), before, after in zip(chunk, held, renewed, strict=True):
                if step is not None and after is not None and (set(after) - before or step.leases.surplus):
                    self._schedule.wake(unit)  # new shards to serve, or surplus to give back

    def _renew_chunk(self, conn: Connection, chunk: list[tuple[Unit, RelayStep | None]]
                     ) -> list[dict[int, int] | None]:
        """The chunk renewed in one transaction, each tenant's ``Leases`` held from its round to its answer.

        What a tenant's answer says (shards lost, shards to take, a changed
        shard count) is taken in after the COMMIT: taking shards is a
        transaction of its own (``Leases._take``), and inside the chunk's it
        would wait on the chunk's own row locks. A lease this fleet renews
        whose committed expiry had passed looks free to the take, whose UPDATE
        then waits for the chunk's COMMIT, which waits for the take: until the
        database's lock wait timeout (MariaDB's 50 s, every tenant of the
        database unrenewed meanwhile). A failure in taking the answer in is the
        tenant's own (its next turn fails it); the others' renewals stand.
        """
        steps = [(unit, step) for unit, step in chunk if step is not None]
        owned: dict[int, dict[int, int] | None] = {}
        with ExitStack() as locked:
            entered = [(unit, step, locked.enter_context(step.leases.shared_round())) for unit, step in steps]
            # Timed once every lock is held: a tenant's lock may be held for long (its own renewal
            # waiting on a row lock, a release), and the rounds of the tenants before it would begin
            # that long before their statement, renewing them for that much less than a TTL.
            now, started = utcnow(), time.monotonic()
            rounds = [(unit, step, None if round_ is None else round_.at(now))
                      for unit, step, round_ in entered]
            answers = self._answers(conn, [(unit, step, round_) for unit, step, round_ in rounds
                                           if round_ is not None])
            for unit, step, round_ in rounds:
                if round_ is None:  # it gave its leases back: left alone, no heartbeat brings it back
                    owned[id(unit)] = {}
                    continue
                try:
                    answer = answers[id(unit)]
                    if isinstance(answer, Exception):
                        raise answer
                    # When it began: a chunk that hung through an outage told meanwhile (a frozen
                    # server) ends nothing when it answers; the first work begun after does.
                    owned[id(unit)] = step.leases_maintained(step.leases.settle_round(round_, *answer),
                                                             started)
                except Exception as exc:
                    if is_database_outage(exc):
                        raise
                    unit.lease_failure = (step, exc)  # its step's next turn fails the tenant with it
                    self._schedule.wake(unit)
                    owned[id(unit)] = None
        return [owned.get(id(unit)) for unit, _ in chunk]

    def _answers(self, conn: Connection, members: list[tuple[Unit, RelayStep, LeaseRound]]
                 ) -> dict[int, Answer | Exception]:
        """Each member's heartbeat, live relays, shard count and renewal, committed; by ``id`` of its unit.

        On PostgreSQL one statement renews the chunk (``_leases_shared``);
        on MySQL/MariaDB each tenant's three statements follow one another
        (``Leases.heartbeat``), with no savepoint around each: a savepoint and
        its release would add two a tenant. A tenant's failure rolls the chunk
        back, and the chunk is renewed again tenant by tenant, each in a
        savepoint, so that its failure (its answer) undoes none of the others'
        renewals. SQLite renews each tenant in a transaction of its own
        (pysqlite's savepoints are not to be trusted). A database outage is raised.
        """
        dialect = conn.dialect.name
        if dialect == "sqlite":
            return {id(unit): _alone(conn, unit, step, round_, conn.begin) for unit, step, round_ in members}
        try:
            with conn.begin():
                if dialect == "postgresql":
                    conn.execution_options(schema_translate_map=None)
                    answers = renew_together(conn, [(unit.tenant.schema, step.leases, round_)
                                                    for unit, step, round_ in members])
                else:
                    answers = [_heartbeat(conn, unit, step, round_) for unit, step, round_ in members]
            return {id(unit): answer for (unit, _, _), answer in zip(members, answers, strict=True)}
        except Exception as exc:
            if is_database_outage(exc):
                raise
        with conn.begin():  # a tenant's own failure undid the chunk: again, each tenant in a savepoint
            return {id(unit): _alone(conn, unit, step, round_, conn.begin_nested)
                    for unit, step, round_ in members}


def _alone(conn: Connection, unit: Unit, step: RelayStep, round_: LeaseRound,
           begin: Callable[[], Any]) -> Answer | Exception:
    """``unit``'s heartbeat and renewal in a transaction (or savepoint) of their own, or its failure."""
    try:
        with begin():
            return _heartbeat(conn, unit, step, round_)
    except Exception as exc:
        if is_database_outage(exc):
            raise
        return exc


def _heartbeat(conn: Connection, unit: Unit, step: RelayStep, round_: LeaseRound) -> Answer:
    """``step``'s heartbeat and renewal on ``conn``, under its tenant's schema (``Leases.heartbeat``)."""
    schema = unit.tenant.schema
    conn.execution_options(schema_translate_map={None: schema} if schema is not None else None)
    return step.leases.heartbeat(conn, round_)
