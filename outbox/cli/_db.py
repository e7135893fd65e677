"""``outbox init-db``: create the tables, or upgrade an older release's in place."""

from __future__ import annotations

import sqlalchemy
import typer
from rich.console import Console
from sqlalchemy import Engine

from .. import _schema
from .._engine import create_engine, missing_sqlite_file
from .._errors import ConfigurationError
from .._outbox import Outbox
from ..housekeeping import partition_inbox, partition_outbox
from . import app
from ._errors import naming
from ._options import DB, PREFIX, SCHEMA


def open_engine(url: str) -> Engine:
    """The engine of a database that must exist already (every command but ``init-db``).

    Names the URL for error messages, and refuses a missing SQLite file rather
    than letting SQLite create an empty one.
    """
    existing_database(url)
    refuse_async_driver(url)
    return create_engine(url)


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
                shards: int | None = None, *, check: bool = True) -> Outbox:
    """An ``Outbox`` on an existing database, its tables checked now unless ``check`` is False."""
    outbox = Outbox(open_engine(db), prefix=prefix, schema=schema, shards=shards)
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
) -> None:
    """Create the outbox and inbox tables (existing tables are left alone), or upgrade them."""
    naming(db)
    outbox = Outbox(create_engine(db), prefix=prefix, schema=schema, shards=shards,
                    max_record_bytes=max_record_bytes)
    if partitioned and outbox.engine.dialect.name != "postgresql":
        raise ConfigurationError(
            f"--partitioned needs PostgreSQL; {naming(db)} is {outbox.engine.dialect.name}")
    if reshard is not None:
        assert isinstance(outbox.engine, Engine)
        old = _schema.reshard(outbox.engine, outbox.tables, reshard)
        Console().print(f"shard count changed from {old} to {reshard}")
        return
    if new_incarnation:
        assert isinstance(outbox.engine, Engine)
        was, now = _schema.new_incarnation(outbox.engine, outbox.tables)
        Console().print(f"incarnation changed from {was} to {now}: start the relays again")
        return
    assert isinstance(outbox.engine, Engine)
    existed = _existing_tables(outbox.engine, outbox)
    if upgrade:
        before, after = outbox.upgrade_tables()
    else:
        outbox.create_tables()
    console = Console()
    if upgrade and before == after:
        console.print(f"schema version {after} is current; nothing to upgrade")
    elif upgrade and before:
        console.print(f"[green]upgraded[/green] schema version {before} to {after}")
    else:
        console.print(_created(outbox, existed))
    if partitioned:
        assert isinstance(outbox.engine, Engine)
        moved = partition_outbox(outbox.engine, outbox.tables)
        console.print("outbox_messages is partitioned already" if moved is None
                      else f"[green]partitioned[/green] outbox_messages by day ({moved:,} row(s) moved)")
        moved = partition_inbox(outbox.engine, outbox.tables)
        console.print("inbox_messages is partitioned already" if moved is None
                      else f"[green]partitioned[/green] inbox_messages by day ({moved:,} row(s) moved)")
    stored = outbox.load_schema()
    console.print(f"shard count {stored.shard_count}, schema version {stored.version}, "
                  f"max record bytes {stored.max_record_bytes}")
