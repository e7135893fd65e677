"""``outbox housekeeping run``: delete settled rows past their retention, with progress.

The relay and the inbox can run the same passes themselves (``outbox relay
--retention 7d``, ``outbox inbox run --retention 30d``); this command is for a
cron job, a Kubernetes CronJob or a one-off clean-up.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import typer
from sqlalchemy import Engine

from ..core._stopping import stop_signals
from ..housekeeping import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DUTY,
    PartitionReport,
    RetentionResult,
    parse_period,
    run_retention,
    run_retention_for_tenants,
)
from ..housekeeping._worker import RetentionThread
from ..inbox import Inbox
from ..tenants import TenantDatabases
from . import app
from ._db import open_engine, open_outbox
from ._errors import Typer
from ._options import DB, PREFIX, SCHEMA, TENANT, TENANTS
from ._tenants import existing_engine, outcome_status, tenant_only_with_tenants, tenants_of, worst

housekeeping_app = Typer(help="Delete published and processed rows past their retention.",
                         no_args_is_help=True, env_namespace="housekeeping")
app.add_typer(housekeeping_app, name="housekeeping")

OLDER_THAN_HELP = "Delete published outbox rows created longer ago than this (e.g. 7d, 36h)."
DEDUP_WINDOW_HELP = ("Delete inbox dedup records whose message is older than this; at least the "
                     "Inbox(dedup_window=) of every group (docs/consumer.md).")


@housekeeping_app.command("run")
def run(
    db: str = DB,
    older_than: str | None = typer.Option(None, "--older-than", help=OLDER_THAN_HELP),
    dedup_window: str | None = typer.Option(None, "--dedup-window", help=DEDUP_WINDOW_HELP),
    group: str | None = typer.Option(None, "--group", help="Only this consumer group's dedup records."),
    batch_size: int = typer.Option(DEFAULT_BATCH_SIZE, "--batch-size", help="Rows per delete transaction."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be deleted; delete nothing."),
    duty: float = typer.Option(DEFAULT_DUTY, "--duty", help=(
        "Share of the time spent deleting (above 0, at most 1); it rests between batches for the "
        "rest, leaving the database to the relay and the inbox. 1: no rest.")),
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    tenants: str | None = TENANTS,
    tenant: str | None = TENANT,
) -> None:
    """Delete settled rows past their retention in short batches; safe to stop and run again.

    With --tenants, in every tenant's schema or database, one after another: a tenant
    that fails (missing tables, its database down) is named, the others are cleaned,
    and the exit status is then 2 or 1.
    """
    if older_than is None and dedup_window is None:
        raise typer.BadParameter("give --older-than (outbox rows), --dedup-window (inbox records) or both")
    if not 0 < duty <= 1:
        raise typer.BadParameter(f"--duty must be above 0 and at most 1, got {duty:g}")
    if group is not None and dedup_window is None:
        raise typer.BadParameter("--group limits the inbox records: give --dedup-window too")
    for flag, value in (("--older-than", older_than), ("--dedup-window", dedup_window)):
        if value is not None:
            parse_period(value, flag)
    tenant_only_with_tenants(tenants, tenant)
    if tenants is not None:
        _run_for_tenants(db, prefix, schema, tenants, tenant, older_than=older_than,
                         dedup_window=dedup_window, group=group, batch_size=batch_size, dry_run=dry_run,
                         duty=duty)
        return
    outbox = open_outbox(db, prefix, schema)
    started = time.monotonic()
    shown = [started]

    def progress(table: str, deleted: int) -> None:
        now = time.monotonic()
        if now - shown[0] >= 1.0:
            shown[0] = now
            typer.echo(f"{table}: {deleted:,} deleted ({deleted / max(now - started, 1e-9):,.0f} rows/s)")

    with _stopped_by_signals() as (stop, stopped_by):
        result = run_retention(outbox, older_than=older_than, dedup_window=dedup_window, group=group,
                               batch_size=batch_size, dry_run=dry_run, progress=progress, stop=stop,
                               duty=duty)
    _show_result(result, dry_run, time.monotonic() - started)
    if result.stopped:
        typer.echo(f"stopped by {stopped_by[0].name} before it finished; run it again to carry on")
        raise typer.Exit(128 + stopped_by[0].value)


@contextmanager
def _stopped_by_signals() -> Iterator[tuple[threading.Event, list[signal.Signals]]]:
    """SIGTERM (a CronJob's pod ending) or Ctrl-C set the event: the open batch commits, the
    totals are printed."""
    stop, stopped_by = threading.Event(), list[signal.Signals]()
    with stop_signals(stop.set, seen=stopped_by):  # the one place that installs signal handlers
        yield stop, stopped_by


def _show_result(result: RetentionResult, dry_run: bool, elapsed: float, who: str = "") -> None:
    for parts in (result.partitions, result.inbox_partitions):
        if parts is not None:
            _show(parts, dry_run, who)
    for table, count in result.deleted.items():
        cutoff = f"{result.cutoffs[table]:%Y-%m-%d %H:%M:%S} UTC"
        if dry_run:
            typer.echo(f"{who}{table}: {count:,} row(s) before {cutoff} would be deleted (dry run)")
        else:
            typer.echo(f"{who}{table}: {count:,} row(s) before {cutoff} deleted in {elapsed:.1f} s")


def _run_for_tenants(db: str, prefix: str, schema: str | None, spec: str, only: str | None, *,
                     older_than: str | None, dedup_window: str | None, group: str | None,
                     batch_size: int, dry_run: bool, duty: float) -> None:
    """``housekeeping run`` in each tenant's place; every line names its tenant."""
    engine = open_engine(db)
    databases = TenantDatabases(engine, make=existing_engine)
    started = time.monotonic()
    try:
        chosen = tenants_of(spec, only, engine, schema)
        with _stopped_by_signals() as (stop, stopped_by):
            outcomes = run_retention_for_tenants(
                chosen, databases, prefix=prefix, older_than=older_than, dedup_window=dedup_window,
                group=group, batch_size=batch_size, dry_run=dry_run, stop=stop, duty=duty)
    finally:
        databases.dispose()
    elapsed = time.monotonic() - started
    for outcome in outcomes:
        if outcome.value is not None:
            _show_result(outcome.value, dry_run, elapsed, f"tenant {outcome.tenant.name}: ")
        else:
            typer.echo(f"tenant {outcome.tenant.name}: FAILED {outcome.problem}")
    failed = [outcome_status(outcome) for outcome in outcomes if not outcome.ok]
    typer.echo(f"{len(outcomes) - len(failed)} of {len(chosen)} tenant(s) cleaned"
               + (f", {len(failed)} failed" if failed else ""))
    if stopped_by:
        typer.echo(f"stopped by {stopped_by[0].name} before it finished; run it again to carry on")
        raise typer.Exit(128 + stopped_by[0].value)
    if failed:
        raise typer.Exit(worst(failed))



def _show(parts: PartitionReport, dry_run: bool, who: str = "") -> None:
    """What a pass did with one table's partitions: dropped (with their rows), kept (why), made."""
    verb = "would drop" if dry_run else "dropped"
    for name, rows in parts.dropped.items():
        size = ("row count not known yet" if rows is None
                else f"{'' if dry_run else 'about '}{rows:,} row(s)")
        typer.echo(f"{who}{name}: {verb} ({size})")
    for name, why in parts.kept.items():
        typer.echo(f"{who}{name}: kept, {why}")
    if parts.created:
        typer.echo(f"{who}created partition(s) {', '.join(parts.created)}")


def retention_every_option() -> Any:
    """``--retention-every``; a new option object per command (each gets its own environment variable)."""
    return typer.Option("10m", "--retention-every", help="How often the worker runs a retention pass.")


def every_seconds(every: str) -> float:
    """``--retention-every`` in seconds, checked before a worker starts."""
    return parse_period(every, "retention interval") / timedelta(seconds=1)


def start_retention(run_pass: Callable[[threading.Event], RetentionResult], every: float) -> RetentionThread:
    """Start a worker's retention thread; ``run_pass(stop)`` runs one pass every ``every`` seconds."""
    return RetentionThread(run_pass, every).start()


def dedup_retention(inbox: Inbox, retention: str) -> timedelta:
    """The inbox worker's ``--retention``, refused unless the group's dedup window covers it.

    A record deleted inside the window would turn a redelivery into a conflict
    (parked): the window must be set, and the retention at least as long.
    """
    period = parse_period(retention, "retention")
    if not isinstance(inbox.engine, Engine):
        raise typer.BadParameter("the worker's retention runs on a sync engine and this Inbox's is "
                                 "async: run `outbox housekeeping run --dedup-window …` from a "
                                 "scheduler instead", param_hint="--retention")
    window = inbox.step.dedup_window
    if window is None:
        raise typer.BadParameter("the Inbox has no dedup_window: set Inbox(dedup_window=...) to at most "
                                 "the retention, or a redelivery of a deleted record parks as a conflict",
                                 param_hint="--retention")
    if period < timedelta(seconds=window):
        raise typer.BadParameter(f"{retention!r} is shorter than the Inbox's dedup_window "
                                 f"({timedelta(seconds=window)}): records inside the window must stay",
                                 param_hint="--retention")
    return period
