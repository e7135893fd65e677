"""``outbox init-db``: create the tables, or upgrade an older release's in place."""

from __future__ import annotations

import typer
from rich.console import Console
from sqlalchemy import Engine

from .. import _schema
from .._engine import create_engine
from .._errors import OutboxError
from .._outbox import Outbox
from . import app

DB_OPTION = typer.Option(..., "--db", help="SQLAlchemy database URL, e.g. sqlite:///app.db")


def open_outbox(db: str, prefix: str = "", schema: str | None = None,
                shards: int | None = None) -> Outbox:
    """An ``Outbox`` whose tables are checked now: a wrong schema or shard count is one line, exit 2."""
    try:
        outbox = Outbox(create_engine(db), prefix=prefix, schema=schema, shards=shards)
        outbox.load_schema()
    except OutboxError as exc:
        fail(exc)
    return outbox


def fail(exc: Exception) -> None:
    Console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command("init-db")
def init_db(
    db: str = DB_OPTION,
    prefix: str = typer.Option("", help="Table name prefix."),
    schema: str | None = typer.Option(None, help="Database schema for the tables."),
    shards: int | None = typer.Option(
        None, help="Shard count of a new database (default 16); stored with the tables."),
    upgrade: bool = typer.Option(
        False, "--upgrade", help="Upgrade tables made by an older release in place."),
    reshard: int | None = typer.Option(
        None, help="Change the stored shard count; only with publishers and relays stopped "
                   "and nothing pending (see docs/relay.md)."),
) -> None:
    """Create the outbox and inbox tables (existing tables are left alone), or upgrade them."""
    try:
        outbox = Outbox(create_engine(db), prefix=prefix, schema=schema, shards=shards)
        if reshard is not None:
            assert isinstance(outbox.engine, Engine)
            old = _schema.reshard(outbox.engine, outbox.tables, reshard)
            Console().print(f"shard count changed from {old} to {reshard}")
            return
        if upgrade:
            before, after = outbox.upgrade_tables()
        else:
            outbox.create_tables()
    except OutboxError as exc:
        fail(exc)
    console = Console()
    if upgrade and before == after:
        console.print(f"schema version {after} is current; nothing to upgrade")
    elif upgrade and before:
        console.print(f"[green]upgraded[/green] schema version {before} to {after}")
    else:
        names = ", ".join(t.name for t in outbox.tables.metadata.sorted_tables)
        console.print(f"[green]created[/green] {names}")
    console.print(f"shard count {outbox.shards}, schema version {outbox.load_schema().version}")
