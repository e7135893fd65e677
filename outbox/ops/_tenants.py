"""``outbox status --tenants``: one report over many tenants, each finding naming its tenant.

``gather_tenants`` runs ``gather`` for every tenant (``tenants.each_tenant``:
one engine per database, a few tenants at a time, a deadline each) and puts
the answers in one document. A tenant whose status cannot be read (its tables
are missing, its database is down or frozen) is a ``problem`` of that tenant,
beside the others' reports; it never stops them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from ..core._envelope import utcnow
from ..producer import Outbox
from ..tenants import DEFAULT_CONCURRENCY, Tenant, TenantDatabases, TenantOutcome, each_tenant
from ._stuck import VERSION, gather

DEFAULT_TENANT_TIMEOUT = 20.0
"""Seconds one tenant's status may take: above the engines' 10 s connect timeout, so a database
that is down is reported as such, and a frozen one (connected, never answering) as not answering."""


def gather_tenants(tenants: Iterable[Tenant], databases: TenantDatabases, *, prefix: str = "",
                   group: str | None = None, stuck_after: float = 300.0,
                   timeout: float = DEFAULT_TENANT_TIMEOUT,
                   concurrency: int = DEFAULT_CONCURRENCY) -> dict[str, Any]:
    """The status document of many tenants.

    ``{"version", "checked_at", "stuck_after_s", "tenants": [...], "stuck": [...], "problems": [...]}``:
    each entry of ``tenants`` is ``{"tenant", "schema", "database", "problem"}`` plus, when its status
    was read, ``gather``'s ``outbox``, ``inbox`` and ``stuck`` for it; ``stuck`` and ``problems``
    list every tenant's findings as ``{"tenant", "reason"}``.
    """
    outcomes = tenant_statuses(tenants, databases, prefix=prefix, group=group, stuck_after=stuck_after,
                               timeout=timeout, concurrency=concurrency)
    return tenants_document(outcomes, stuck_after)


def tenant_statuses(tenants: Iterable[Tenant], databases: TenantDatabases, *, prefix: str = "",
                    group: str | None = None, stuck_after: float = 300.0,
                    timeout: float = DEFAULT_TENANT_TIMEOUT,
                    concurrency: int = DEFAULT_CONCURRENCY) -> list[TenantOutcome[dict[str, Any]]]:
    """Each tenant's ``gather`` document, or what kept it from being read, in the tenants' order."""
    def status(tenant: Tenant, engine: Engine) -> dict[str, Any]:
        return gather(Outbox(engine, prefix=prefix, schema=tenant.schema), group=group,
                      stuck_after=stuck_after)

    return each_tenant(tenants, status, databases=databases, timeout=timeout, concurrency=concurrency)


def tenants_document(outcomes: list[TenantOutcome[dict[str, Any]]], stuck_after: float) -> dict[str, Any]:
    """The one document of ``gather_tenants`` from each tenant's outcome."""
    entries = []
    stuck: list[dict[str, str]] = []
    problems: list[dict[str, str]] = []
    for outcome in outcomes:
        tenant = outcome.tenant
        entry: dict[str, Any] = {"tenant": tenant.name, "schema": tenant.schema,
                                 "database": tenant.database_shown, "problem": outcome.problem}
        if outcome.value is not None:
            doc = outcome.value
            entry.update(outbox=doc["outbox"], inbox=doc["inbox"], stuck=doc["stuck"])
            stuck.extend({"tenant": tenant.name, "reason": reason} for reason in doc["stuck"])
        else:
            entry.update(outbox=None, inbox=None, stuck=[])
            problems.append({"tenant": tenant.name, "reason": outcome.problem or "unknown"})
        entries.append(entry)
    return {"version": VERSION, "checked_at": utcnow().isoformat(), "stuck_after_s": stuck_after,
            "tenants": entries, "stuck": stuck, "problems": problems}
