"""Run one piece of work for every tenant: one engine per database, failures isolated and named.

What the operations commands need when they serve many tenants (``outbox
init-db``/``status``/``housekeeping run --tenants``, the console, a relay's
retention): each tenant's outcome on its own, whatever happened to the others.

- ``TenantDatabases`` keeps one engine (one pool) per database, however many
  tenant schemas live in it: 500 schemas of one database cost one pool.
- ``each_tenant`` runs ``work(tenant, engine)`` for every tenant, a few at a
  time, and returns one ``TenantOutcome`` per tenant in the tenants' order.
  A tenant whose work raises is a failed outcome naming it; a tenant whose
  work does not end within ``timeout`` seconds (a frozen database) is given up
  on, its thread left behind as a daemon, and reported so. Once a database
  has failed to answer (an outage, or ``FROZEN_AFTER`` of its tenants given up
  on: one alone may be waiting for a lock on its own tables), its remaining
  tenants are reported unreachable without each waiting out its own timeout.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy import Engine

from ..core._engine import create_engine
from ..core._errors import ConfigurationError, SchemaError
from ..core._outage import is_database_outage
from ..core._secrets import database_secrets, scrub
from ..core._tenant import Tenant

T = TypeVar("T")

DEFAULT_CONCURRENCY = 8
"""Tenants worked on at once; below a pool's default size (5 + 10 overflow), so one database
serving them all never waits for a connection."""


FROZEN_AFTER = 2
"""Tenants of one database given up on (with no answer from it in between) that make it "frozen"."""


class TenantDatabases:
    """One engine per database the tenants name; tenants without one use ``default``.

    A tenant whose ``database`` is an ``Engine`` uses that engine; a URL gets
    one engine per distinct URL, made on first use (``outbox.create_engine``:
    connect timeouts included) and disposed by ``dispose``. Safe to call from
    several threads.
    """

    def __init__(self, default: Engine | None = None,
                 make: Callable[[str], Engine] = create_engine) -> None:
        self.default = default
        self._make = make
        self._made: dict[str, Engine] = {}
        self._lock = threading.Lock()

    def engine_for(self, tenant: Tenant) -> Engine:
        """The engine of ``tenant``'s database; ``ConfigurationError`` when it names none."""
        database = tenant.database
        if isinstance(database, Engine):
            return database
        if database is None:
            if self.default is None:
                raise ConfigurationError(f"tenant {tenant.name} names no database and there is no default")
            return self.default
        with self._lock:
            engine = self._made.get(database)
            if engine is None:
                engine = self._made[database] = self._make(database)
            return engine

    def key(self, tenant: Tenant) -> str:
        """What tenants of one database share (the URL with its password), for grouping."""
        database = tenant.database
        if database is None:
            database = self.default
        if database is None:
            return ""
        return database if isinstance(database, str) else database.url.render_as_string(hide_password=False)

    def dispose(self) -> None:
        """Close the pools of the engines made here (not ``default``, not a tenant's own Engine)."""
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for engine in made:
            engine.dispose()


@dataclass(frozen=True)
class TenantOutcome(Generic[T]):
    """What became of one tenant's work: its ``value``, or ``problem`` (one line naming what went wrong)."""

    tenant: Tenant
    value: T | None = None
    problem: str | None = None
    error: BaseException | None = None
    """The exception behind ``problem`` (``None`` for a timeout or an unreachable database's sibling)."""
    unreachable: bool = False
    """The tenant's database did not answer (an outage, a timeout): not the tenant's own fault."""

    @property
    def ok(self) -> bool:
        return self.problem is None


def each_tenant(tenants: Iterable[Tenant], work: Callable[[Tenant, Engine], T], *,
                databases: TenantDatabases, timeout: float | None = None,
                concurrency: int = DEFAULT_CONCURRENCY) -> list[TenantOutcome[T]]:
    """``work(tenant, engine)`` for each of ``tenants``, each isolated; the outcomes in their order.

    ``timeout``: seconds one tenant's work may take (``None``: no limit, for
    work that must finish, like creating tables). ``concurrency``: how many
    tenants are worked on at once.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigurationError(f"concurrency must be a positive int, got {concurrency!r}")
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise ConfigurationError(f"timeout must be positive seconds, got {timeout!r}")
    return _Run(list(tenants), work, databases, timeout, concurrency).outcomes()


class _Run(Generic[T]):
    """Worker threads take tenants from a queue; the caller's thread watches the deadlines.

    A worker stuck past its tenant's deadline is replaced, so a frozen database
    holds at most the threads that were inside it, never the report. A start is
    announced: the caller, waiting while no tenant it knew of had started, would
    otherwise never watch the deadline of one that started after it began to wait.
    """

    def __init__(self, tenants: Sequence[Tenant], work: Callable[[Tenant, Engine], T],
                 databases: TenantDatabases, timeout: float | None, concurrency: int) -> None:
        self._tenants = tenants
        self._work = work
        self._databases = databases
        self._timeout = timeout
        self._concurrency = concurrency
        self._queue = deque(range(len(tenants)))
        self._done: list[TenantOutcome[T] | None] = [None] * len(tenants)
        self._left = len(tenants)
        self._started: dict[int, float] = {}
        self._down: dict[str, str] = {}
        self._unanswered: dict[str, int] = {}  # per database: tenants given up on since its last answer
        self._changed = threading.Condition()

    def outcomes(self) -> list[TenantOutcome[T]]:
        for _ in range(min(self._concurrency, len(self._tenants))):
            self._spawn()
        with self._changed:
            while self._left:
                wait = None
                if self._timeout is not None and self._started:
                    now = time.monotonic()
                    for index, began in list(self._started.items()):
                        if now - began >= self._timeout:
                            del self._started[index]
                            self._give_up(index)
                            self._spawn()  # the stuck thread is lost to us; keep the pace
                    if self._started:
                        wait = max(0.0, min(self._started.values()) + self._timeout - time.monotonic())
                if self._left:
                    self._changed.wait(wait)
        return [outcome for outcome in self._done if outcome is not None]

    def _spawn(self) -> None:
        threading.Thread(target=self._serve, name="outbox-tenant", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._changed:
                if not self._queue:
                    return
                index = self._queue.popleft()
                tenant = self._tenants[index]
                key = self._databases.key(tenant)
                if key in self._down:
                    self._settle(index, TenantOutcome(tenant, problem=self._down[key], unreachable=True))
                    continue
                self._started[index] = time.monotonic()
                self._changed.notify_all()  # a caller waiting with no deadline to watch has one now
            outcome = self._one(tenant)
            with self._changed:
                if self._started.pop(index, None) is None:
                    return  # given up on while it ran: a fresh thread has taken this one's place
                if outcome.unreachable:
                    self._down.setdefault(key, f"database {tenant.database_shown or 'default'} "
                                               f"unreachable (found by tenant {tenant.name})")
                else:
                    self._unanswered.pop(key, None)  # it answers: a tenant given up on was its own
                self._settle(index, outcome)

    def _one(self, tenant: Tenant) -> TenantOutcome[T]:
        try:
            return TenantOutcome(tenant, value=self._work(tenant, self._databases.engine_for(tenant)))
        except Exception as exc:
            return TenantOutcome(tenant, problem=describe(tenant, exc, self._databases), error=exc,
                                 unreachable=is_database_outage(exc))

    def _give_up(self, index: int) -> None:
        """Report a tenant past its deadline; its database is "frozen" after ``FROZEN_AFTER`` such.

        One tenant alone may be waiting for a lock on its own tables (a
        migration, ``VACUUM FULL``) while its database serves the others: the
        rest of its database is given up on only when another of its tenants
        does not answer either, before any answers.
        """
        tenant = self._tenants[index]
        key = self._databases.key(tenant)
        self._unanswered[key] = self._unanswered.get(key, 0) + 1
        if self._unanswered[key] >= FROZEN_AFTER:
            self._down.setdefault(key, f"database {tenant.database_shown or 'default'} did not answer "
                                       f"(found by tenant {tenant.name})")
        self._settle(index, TenantOutcome(
            tenant, problem=f"no answer within {self._timeout:g} s (is its database frozen?)",
            unreachable=True))

    def _settle(self, index: int, outcome: TenantOutcome[T]) -> None:
        """Record ``outcome``; the caller holds ``_changed``."""
        self._done[index] = outcome
        self._left -= 1
        self._changed.notify_all()


def describe(tenant: Tenant, exc: BaseException, databases: TenantDatabases) -> str:
    """One line saying what went wrong for ``tenant``, with no credential of its database in it."""
    text = str(exc.orig or exc if isinstance(exc, sa.exc.DBAPIError) else exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, sa.exc.DBAPIError) and is_database_outage(exc):
        line = f"cannot reach database {tenant.database_shown or 'default'}: {first}"
    elif isinstance(exc, ConfigurationError | SchemaError):
        line = first
    elif isinstance(exc, sa.exc.DBAPIError):
        hint = " (run `outbox init-db --tenants SPEC`, or check its schema)"
        line = first + (hint if _missing(first) else "")
    else:
        line = f"{type(exc).__name__}: {first}"
    return scrub(line, database_secrets(databases.key(tenant)) if databases.key(tenant) else [])


def _missing(reason: str) -> bool:
    lowered = reason.lower()
    return "no such table" in lowered or "does not exist" in lowered
