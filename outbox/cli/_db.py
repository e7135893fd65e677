"""``outbox init-db``: create the tables, or upgrade an older release's in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy
import typer
from rich.console import Console
from rich.markup import escape
from sqlalchemy import Engine

from ..core import _schema
from ..core._engine import create_engine, missing_sqlite_file
from ..core._errors import ConfigurationError
from ..core._secrets import database_url
from ..housekeeping import partition_inbox, partition_outbox
from ..producer import Outbox
from ..relay import transaction_pooled_options
from ..tenants import TenantDatabases, each_tenant
from . import app
from ._errors import naming
from ._options import DB, PREFIX, SCHEMA, TENANT, TENANTS
from ._tenants import outcome_status, tenant_only_with_tenants, tenants_of, worst


def open_engine(url: str, *, transaction_pooled: bool = False) -> Engine:
    """The engine of a database that must exist already (every command but ``init-db``).

    Names the URL for error messages, and refuses a missing SQLite file rather
    than letting SQLite create an empty one. ``transaction_pooled``: reached
    through a pooler in transaction mode (``pooled_options``).
    """
    existing_database(url)
    refuse_async_driver(url)
    return create_engine(url, **pooled_options(url, transaction_pooled))


def pooled_options(url: str, transaction_pooled: bool) -> dict[str, Any]:
    """An engine's keyword arguments for ``--transaction-pooled``: the relay then sets nothing on a
    session, and psycopg prepares no statement, which a transaction-mode pooler would hand to
    another client (``relay._session.transaction_pooled_options``)."""
    return transaction_pooled_options(url) if transaction_pooled else {}


def refuse_async_driver(url: str) -> None:
    """The commands run sync code: an asyncio driver (asyncpg, aiosqlite) would fail at its first query."""
    try:
        parsed = sqlalchemy.make_url(url)
        is_async = getattr(parsed.get_dialect(), "is_async", False)
    except Exception:
        return  # not a URL, or an unknown dialect: create_engine names the problem
    if is_async:
        raise ConfigurationError(
            f"--db {naming(url)} names the asyncio driver {parsed.get_driver_name()!r}; the command "
            f"line needs a sync driver (postgresql+psycopg://… or sqlite:///…); an async app's "
            f"Inbox is used through --app")


def existing_database(url: str) -> None:
    """Name ``url`` for error messages; refuse a SQLite file that does not exist."""
    name = naming(url)
    missing = missing_sqlite_file(url)
    if missing is not None:
        raise ConfigurationError(f"database file {missing} does not exist (check --db, or create "
                                 f"it with `outbox init-db --db {name}`)")


def open_outbox(db: str, prefix: str = "", schema: str | None = None,
                shards: int | None = None, *, check: bool = True, transaction_pooled: bool = False) -> Outbox:
    """An ``Outbox`` on an existing database, its tables checked now unless ``check`` is False."""
    outbox = Outbox(open_engine(db, transaction_pooled=transaction_pooled), prefix=prefix, schema=schema,
                    shards=shards)
    if check:
        outbox.load_schema()
    return outbox


def _existing_tables(engine: Engine, outbox: Outbox) -> set[str]:
    """Which of the outbox's and inbox's tables the database has already."""
    present = set(sqlalchemy.inspect(engine).get_table_names(schema=outbox.tables.schema))
    return {t.name for t in outbox.tables.metadata.sorted_tables} & present


def _created(outbox: Outbox, existed: set[str]) -> str:
    """What ``init-db`` did: which tables it created, and which it left alone."""
    names = [t.name for t in outbox.tables.metadata.sorted_tables]
    new = [n for n in names if n not in existed]
    kept = [n for n in names if n in existed]
    if not new:
        return "all tables exist already; nothing created"
    done = f"[green]created[/green] {', '.join(new)}"
    return done + (f"; existed already: {', '.join(kept)}" if kept else "")


@app.command("init-db")
def init_db(
    db: str = DB,
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    shards: int | None = typer.Option(
        None, help="Shard count of a new database (default 16); stored with the tables."),
    max_record_bytes: int | None = typer.Option(
        None, help="Largest broker record publishers accept (payload, key, headers, envelope; "
                   "default 1000000); stored with the tables, and every relay's producer must "
                   "allow it (message.max.bytes)."),
    upgrade: bool = typer.Option(
        False, "--upgrade", help="Upgrade tables made by an older release in place."),
    reshard: int | None = typer.Option(
        None, help="Change the stored shard count; only with publishers and relays stopped "
                   "and nothing pending (see docs/relay.md)."),
    new_incarnation: bool = typer.Option(
        False, "--new-incarnation",
        help="Give this database a new identity: run it after restoring it from a backup or "
             "copying it, with its relays stopped (see docs/consumer.md, 'Producer restarts')."),
    partitioned: bool = typer.Option(
        False, "--partitioned",
        help="PostgreSQL: partition outbox_messages and inbox_messages by day, so retention drops "
             "whole days; converts existing tables keeping every row (docs/operations.md, "
             "'Housekeeping')."),
    tenants: str | None = TENANTS,
    tenant: str | None = TENANT,
) -> None:
    """Create the outbox and inbox tables (existing tables are left alone), or upgrade them.

    With --tenants, in every tenant's schema or database: each tenant's outcome on
    lines of its own; a tenant that fails (its schema missing, its database down)
    is named and the others carry on; the exit status is then 2 or 1.
    """
    naming(db)
    tenant_only_with_tenants(tenants, tenant)
    options = _InitOptions(prefix, shards, max_record_bytes, upgrade, reshard, new_incarnation, partitioned)
    options.check_alone()
    if tenants is None:
        console = Console()
        for line in _init_one(create_engine(db), schema, options):
            console.print(line)
        return
    _init_tenants(db, schema, tenants, tenant, options)


@dataclass(frozen=True)
class _InitOptions:
    prefix: str
    shards: int | None
    max_record_bytes: int | None
    upgrade: bool
    reshard: int | None
    new_incarnation: bool
    partitioned: bool

    def check_alone(self) -> None:
        """``--reshard`` and ``--new-incarnation`` run alone: the first one given was done and the rest
        ignored (``--reshard 4 --new-incarnation`` changed the count, exited 0 and kept the identity)."""
        given = [name for name, asked in (
            ("--reshard", self.reshard is not None), ("--new-incarnation", self.new_incarnation),
            ("--shards", self.shards is not None), ("--max-record-bytes", self.max_record_bytes is not None),
            ("--upgrade", self.upgrade), ("--partitioned", self.partitioned)) if asked]
        alone = [name for name in given if name in ("--reshard", "--new-incarnation")]
        if alone and len(given) > 1:
            others = [name for name in given if name != alone[0]]
            raise typer.BadParameter(
                f"runs alone, not with {', '.join(others)}: run each as a command of its own "
                "(nothing was changed)", param_hint=alone[0])


def _init_tenants(db: str, schema: str | None, spec: str, only: str | None,
                  options: _InitOptions) -> None:
    """``init-db`` in each tenant's place, a few at a time, every tenant reported by name."""
    engine = create_engine(db)
    databases = TenantDatabases(engine)
    try:
        outcomes = each_tenant(tenants_of(spec, only, engine, schema),
                               lambda tenant, bind: _init_one(bind, tenant.schema, options),
                               databases=databases, concurrency=INIT_CONCURRENCY)
    finally:
        databases.dispose()
    console = Console()
    for outcome in outcomes:
        name = escape(outcome.tenant.name)
        for line in outcome.value or []:
            console.print(f"tenant {name}: {line}", soft_wrap=True)  # one line each, for grep
        if not outcome.ok:
            console.print(f"tenant {name}: [red]FAILED[/red] {escape(outcome.problem or '')}",
                          soft_wrap=True, highlight=False)
    failed = [outcome_status(outcome) for outcome in outcomes if not outcome.ok]
    console.print(f"{len(outcomes) - len(failed)} of {len(outcomes)} tenant(s) done"
                  + (f", {len(failed)} failed" if failed else ""))
    if failed:
        raise typer.Exit(worst(failed))


INIT_CONCURRENCY = 4
"""Tenants whose tables are made at once: DDL takes locks in the catalog, so only a few."""


def _init_one(engine: Engine, schema: str | None, options: _InitOptions) -> list[str]:
    """``init-db`` on one schema of one database; returns what it did, as lines of console markup."""
    outbox = Outbox(engine, prefix=options.prefix, schema=schema, shards=options.shards,
                    max_record_bytes=options.max_record_bytes)
    if options.partitioned and engine.dialect.name != "postgresql":
        shown = database_url(engine.url.render_as_string(hide_password=False))
        raise ConfigurationError(f"--partitioned needs PostgreSQL; {shown} is {engine.dialect.name}")
    if options.reshard is not None:
        old = _schema.reshard(engine, outbox.tables, options.reshard)
        return [f"shard count changed from {old} to {options.reshard}"]
    if options.new_incarnation:
        was, now = _schema.new_incarnation(engine, outbox.tables)
        return [f"incarnation changed from {was} to {now}: start the relays again"]
    existed = _existing_tables(engine, outbox)
    lines = []
    if options.upgrade:
        before, after = outbox.upgrade_tables()
    else:
        outbox.create_tables()
    if options.upgrade and before == after:
        lines.append(f"schema version {after} is current; nothing to upgrade")
    elif options.upgrade and before:
        lines.append(f"[green]upgraded[/green] schema version {before} to {after}")
    else:
        lines.append(_created(outbox, existed))
    if options.partitioned:
        moved = partition_outbox(engine, outbox.tables)
        lines.append("outbox_messages is partitioned already" if moved is None
                     else f"[green]partitioned[/green] outbox_messages by day ({moved:,} row(s) moved)")
        moved = partition_inbox(engine, outbox.tables)
        lines.append("inbox_messages is partitioned already" if moved is None
                     else f"[green]partitioned[/green] inbox_messages by day ({moved:,} row(s) moved)")
    stored = outbox.load_schema()
    lines.append(f"shard count {stored.shard_count}, schema version {stored.version}, "
                 f"max record bytes {stored.max_record_bytes}")
    return lines
