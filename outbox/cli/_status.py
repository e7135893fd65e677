"""``outbox status``: everything stuck, in one view, with an exit status for health checks.

Read-only (``open_engine`` refuses a missing SQLite file; nothing is created).
Exit 0: nothing stuck; 3 (``STUCK``): something needs a person, each reason
printed; 2/1 as every command (``_errors``). ``outbox stats`` stays as the
backlog table alone; ``status`` shows the same rows among the rest.
"""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..core._terminal import stdout_console
from ..ops import DEFAULT_TENANT_TIMEOUT, gather, tenant_statuses, tenants_document
from ..tenants import TenantDatabases
from . import app
from ._db import open_engine, open_outbox
from ._errors import STUCK
from ._options import DB, PREFIX, SCHEMA, TENANT, TENANTS
from ._tenants import (
    TENANT_TIMEOUT_HELP,
    existing_engine,
    outcome_status,
    tenant_only_with_tenants,
    tenants_of,
    worst,
)


@app.command("status")
def status(
    db: str = DB,
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    group: str | None = typer.Option(None, help="Only this inbox consumer group."),
    stuck_after: float = typer.Option(
        300.0, "--stuck-after", min=0,
        help="Seconds after which a retrying head or a held gap counts as stuck."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as one JSON document."),
    tenants: str | None = TENANTS,
    tenant: str | None = TENANT,
    tenant_timeout: float = typer.Option(DEFAULT_TENANT_TIMEOUT, "--tenant-timeout", min=0.1,
                                         help=TENANT_TIMEOUT_HELP),
) -> None:
    """Backlog, failed rows, retrying keys, relays and leases, parked keys and held gaps.

    Exits 0 when nothing is stuck and 3 when something is, so it serves as a health check.
    With --tenants, one report over every tenant; a tenant that cannot be read is reported
    by name and the exit status is then 2 (its tables) or 1 (its database).
    """
    tenant_only_with_tenants(tenants, tenant)
    if tenants is not None:
        _status_of_tenants(db, prefix, schema, tenants, tenant, group, stuck_after, as_json, tenant_timeout)
        return
    doc = gather(open_outbox(db, prefix, schema, check=False), group=group, stuck_after=stuck_after)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        _print(doc)
    if doc["stuck"]:
        raise typer.Exit(STUCK)


def _status_of_tenants(db: str, prefix: str, schema: str | None, spec: str, only: str | None,
                       group: str | None, stuck_after: float, as_json: bool, timeout: float) -> None:
    engine = open_engine(db)
    databases = TenantDatabases(engine, make=existing_engine)
    try:
        outcomes = tenant_statuses(tenants_of(spec, only, engine, schema), databases, prefix=prefix,
                                   group=group, stuck_after=stuck_after, timeout=timeout)
    finally:
        databases.dispose()
    report = tenants_document(outcomes, stuck_after)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print_tenants(report)
    failed = [outcome_status(outcome) for outcome in outcomes if not outcome.ok]
    if failed:
        raise typer.Exit(worst(failed))
    if report["stuck"]:
        raise typer.Exit(STUCK)


def _print_tenants(report: dict[str, Any]) -> None:
    """Each tenant's report under its name, then every finding, each naming its tenant."""
    console = stdout_console()
    for entry in report["tenants"]:
        where = ", ".join(part for part in (
            f"schema {entry['schema']}" if entry["schema"] else "",
            f"database {entry['database']}" if entry["database"] else "") if part)
        console.print(f"== tenant {entry['tenant']}" + (f" ({where})" if where else ""),
                      highlight=False, markup=False)
        if entry["problem"] is not None:
            console.print(f"cannot read its status: {entry['problem']}", highlight=False, markup=False)
        else:
            _print_parts(entry, console)
    for verdict, findings in (("PROBLEM", report["problems"]), ("STUCK", report["stuck"])):
        for finding in findings:
            console.print(f"{verdict}: tenant {finding['tenant']}: {finding['reason']}",
                          highlight=False, markup=False)
    if not report["stuck"] and not report["problems"]:
        console.print(f"nothing stuck in {len(report['tenants'])} tenant(s)")


NO_RELAY = ("outbox: nothing to send, and no relay has run on this database "
            "(a consumer's database, or a new one)")
"""The console's overview says the same in the same case (``overview.html``)."""


def _never_relayed(out: dict[str, Any]) -> bool:
    """Nothing waits, nothing retries, no relay heartbeat and no shard owned: no relay ever ran here."""
    return not (out["backlog"] or out["retrying"] or out["relays"]
                or any(s["state"] != "unowned" for s in out["shards"]))


def _s(value: float | None) -> str:
    return "" if value is None else f"{value:g} s"


def _print(doc: dict[str, Any]) -> None:
    """Compact: a table only for what has rows, and one closing verdict."""
    console = stdout_console()
    _print_parts(doc, console)
    if doc["stuck"]:
        for reason in doc["stuck"]:
            console.print(f"STUCK: {reason}", highlight=False, markup=False)
    else:
        console.print("nothing stuck")


def _print_parts(doc: dict[str, Any], console: Console) -> None:
    """The outbox and inbox parts of one database's (or tenant's) status, as tables."""
    def show(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
        table = Table(*columns, title=title, title_justify="left", box=None, pad_edge=False)
        for row in rows:
            table.add_row(*(Text("" if v is None else str(v)) for v in row))  # values, not markup
        console.print(table)

    out = doc["outbox"]
    if out is None:
        console.print("outbox: no outbox tables")
    elif _never_relayed(out):
        # A consumer's database (or a new one): "0 of 16 shards owned" would read as an outage.
        console.print(NO_RELAY, highlight=False, markup=False)
    else:
        if out["backlog"]:
            show("backlog", ("topic", "shard", "pending", "failed", "oldest pending"),
                 [(r["topic"], r["shard"], r["pending"], r["failed"], _s(r["oldest_pending_age_s"]))
                  for r in out["backlog"]])
        else:
            console.print("backlog: none")
        if out["retrying"]:
            show("retrying heads", ("topic", "key", "seq", "attempts", "age", "waiting", "last error"),
                 [(h["topic"], h["key"], h["seq"], h["attempts"], _s(h["age_s"]), h["waiting_behind"],
                   (h["last_error"] or "")[:60]) for h in out["retrying"]])
        owned = sum(s["state"] == "owned" for s in out["shards"])
        console.print(f"shards: {owned} of {out['shard_count']} owned" + "".join(
            f", {n} {state}" for state in ("expired", "unowned")
            if (n := sum(s["state"] == state for s in out["shards"]))))
        if out["relays"]:
            show("relays", ("worker", "heartbeat age", "shards"),
                 [(r["worker_id"], _s(r["heartbeat_age_s"]), r["shards"]) for r in out["relays"]])
    inbox = doc["inbox"]
    if inbox is None:
        console.print("inbox: no inbox tables")
    elif inbox["groups"]:
        show("inbox groups", ("group", "parked keys", "parked msgs", "oldest parked", "held", "oldest held"),
             [(g["group"], g["parked_keys"], g["parked_messages"], _s(g["oldest_parked_age_s"]),
               g["held_messages"], _s(g["oldest_held_age_s"])) for g in inbox["groups"]])
    else:
        console.print("inbox: nothing parked or held")
