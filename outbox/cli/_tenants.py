"""What the operations commands share when they serve many tenants (``--tenants``, ``--tenant``).

``tenants_of`` reads the fleet's tenants once (``parse_tenants``), keeping
only ``--tenant`` when given; ``outcome_status`` is the exit status a failed
tenant gives, the same one the command would exit with for that tenant alone.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
import typer
from sqlalchemy import Engine

from ..core._engine import create_engine, missing_sqlite_file
from ..core._errors import ConfigurationError, SchemaError
from ..tenants import Tenant, TenantOutcome, check_tenant_name, parse_tenants
from ._errors import RUNTIME, USAGE

TENANT_TIMEOUT_HELP = ("Seconds one tenant may take before it is reported as not answering "
                       "(a frozen database), with --tenants.")


def tenants_of(spec: str, only: str | None, engine: Engine, schema: str | None) -> list[Tenant]:
    """The tenants ``--tenants SPEC`` names now (``--tenant``: that one alone)."""
    if schema is not None:
        raise typer.BadParameter("--tenants names each tenant's schema: leave --schema out",
                                 param_hint="--schema")
    tenants = list(parse_tenants(spec, engine)())
    if only is not None:
        check_tenant_name(only)
        tenants = [t for t in tenants if t.name == only]
        if not tenants:
            raise typer.BadParameter(f"{only!r} is not one of the tenants --tenants names",
                                     param_hint="--tenant")
    if not tenants:
        raise ConfigurationError(f"--tenants {spec!r:.80} names no tenant now")
    return tenants


def existing_engine(url: str) -> Engine:
    """A tenant's database for a command that must not create one: a missing SQLite file is refused."""
    missing = missing_sqlite_file(url)
    if missing is not None:
        raise ConfigurationError(f"database file {missing} does not exist (create its tables with "
                                 "`outbox init-db --tenants SPEC`)")
    return create_engine(url)


def tenant_only_with_tenants(spec: str | None, only: str | None) -> None:
    if only is not None and spec is None:
        raise typer.BadParameter("--tenant picks one of --tenants: give --tenants too", param_hint="--tenant")


def outcome_status(outcome: TenantOutcome[Any]) -> int:
    """0 for a tenant that went well; else 2 (its tables or settings) or 1 (its database, anything else)."""
    if outcome.ok:
        return 0
    error = outcome.error
    if isinstance(error, ConfigurationError | SchemaError):
        return USAGE
    if isinstance(error, sa.exc.ProgrammingError) and not outcome.unreachable:
        return USAGE  # a missing table or schema: init-db, or the tenant's place, is what to fix
    return RUNTIME


def worst(statuses: list[int]) -> int:
    """One exit status for many tenants: a runtime failure (1) before a usage one (2), then 0."""
    return RUNTIME if RUNTIME in statuses else USAGE if USAGE in statuses else 0
