"""Retention for many tenants: each tenant's tables cleaned, one tenant's failure named, not fatal.

``run_retention_for_tenants`` runs ``run_retention`` in every tenant's schema
or database (one engine per database, ``tenants.TenantDatabases``), one tenant
after another by default: retention is background work, and several tenants
at once would only compete for the same disk. A tenant whose tables are
missing or whose database is down is an outcome naming it; the next tenant
is cleaned all the same. ``tenant_retention_pass`` wraps it for a worker's
retention thread (``RetentionThread``): what a multi-tenant relay or inbox
runs every ``--retention-every``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from sqlalchemy import Engine

from transports._logsafe import safe_logger

from ..core._errors import ConfigurationError
from ..producer import Outbox
from ..tenants import Tenant, TenantDatabases, TenantOutcome, TenantSource, each_tenant
from ._durations import parse_period
from ._retention import DEFAULT_BATCH_SIZE, DEFAULT_DUTY, RetentionResult, run_retention

log = safe_logger("outbox.housekeeping")

TenantProgress = Callable[[Tenant, str, int], None]
"""Called after each batch with the tenant, the table's name and its rows deleted so far."""


def run_retention_for_tenants(
    tenants: Iterable[Tenant],
    databases: TenantDatabases | Engine,
    *,
    prefix: str = "",
    older_than: timedelta | str | float | None = None,
    dedup_window: timedelta | str | float | None = None,
    group: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    progress: TenantProgress | None = None,
    stop: threading.Event | None = None,
    now: datetime | None = None,
    concurrency: int = 1,
    duty: float = DEFAULT_DUTY,
) -> list[TenantOutcome[RetentionResult]]:
    """``run_retention`` in each tenant's schema or database; one outcome per tenant, in order.

    ``databases`` says where tenants without a database of their own live: an
    engine, or a ``TenantDatabases`` (reused across calls, it keeps one pool per
    database). The options mean what they mean for ``run_retention`` and are
    checked before any tenant is touched. ``stop`` ends the run between two
    batches; tenants not reached are left out of the outcomes. A tenant's
    outcome holds its ``RetentionResult``, or its ``problem`` (one line, no
    credential) when its tables or database failed it.
    """
    if older_than is None and dedup_window is None:
        raise ConfigurationError("give older_than (outbox rows), dedup_window (inbox records) or both")
    for name, value in (("retention", older_than), ("dedup window", dedup_window)):
        if value is not None:
            parse_period(value, name)
    if isinstance(databases, Engine):
        databases = TenantDatabases(databases)
    moment = now

    def clean(tenant: Tenant, engine: Engine) -> RetentionResult | None:
        if stop is not None and stop.is_set():
            return None
        report = None if progress is None else (lambda table, n: progress(tenant, table, n))
        return run_retention(Outbox(engine, prefix=prefix, schema=tenant.schema), older_than=older_than,
                             dedup_window=dedup_window, group=group, batch_size=batch_size,
                             dry_run=dry_run, progress=report, stop=stop, now=moment, duty=duty)

    done: list[TenantOutcome[RetentionResult]] = []
    for outcome in each_tenant(tenants, clean, databases=databases, concurrency=concurrency):
        if outcome.value is not None:
            done.append(TenantOutcome(outcome.tenant, value=outcome.value))
        elif not outcome.ok:  # else: not reached before ``stop``
            done.append(TenantOutcome(outcome.tenant, problem=outcome.problem, error=outcome.error,
                                      unreachable=outcome.unreachable))
    return done


def tenant_retention_pass(
    tenants: TenantSource,
    databases: TenantDatabases | Engine,
    *,
    prefix: str = "",
    older_than: timedelta | str | float | None = None,
    dedup_window: timedelta | str | float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> Callable[[threading.Event], RetentionResult]:
    """One retention pass over the tenants ``tenants()`` names now, for ``RetentionThread``.

    Each call asks ``tenants`` again (tenants come and go), cleans each one,
    logs each tenant's failure once with its name (at WARNING, the database's
    credentials left out), and returns the pass's sum: rows per
    ``"tenant/table"``. A failing tenant never ends the pass nor the worker.
    """
    if isinstance(databases, Engine):
        databases = TenantDatabases(databases)
    shared = databases

    def run_pass(stop: threading.Event) -> RetentionResult:
        total = RetentionResult()
        for outcome in run_retention_for_tenants(
                tenants(), shared, prefix=prefix, older_than=older_than, dedup_window=dedup_window,
                batch_size=batch_size, stop=stop):
            name = outcome.tenant.name
            if outcome.value is None:
                log.warning("retention of tenant %s failed: %s", name, outcome.problem)
                continue
            for table, count in outcome.value.deleted.items():
                total.deleted[f"{name}/{table}"] = count
                total.cutoffs[f"{name}/{table}"] = outcome.value.cutoffs[table]
            total.stopped = total.stopped or outcome.value.stopped
        total.stopped = total.stopped or stop.is_set()
        return total
    return run_pass
