"""``outbox init-db``: create the tables in a database."""

from __future__ import annotations

import typer
from rich.console import Console

from .._engine import create_engine
from .._outbox import Outbox
from . import app

DB_OPTION = typer.Option(..., "--db", help="SQLAlchemy database URL, e.g. sqlite:///app.db")


@app.command("init-db")
def init_db(
    db: str = DB_OPTION,
    prefix: str = typer.Option("", help="Table name prefix."),
    schema: str | None = typer.Option(None, help="Database schema for the tables."),
) -> None:
    """Create the outbox and inbox tables (existing tables are left alone)."""
    outbox = Outbox(create_engine(db), prefix=prefix, schema=schema)
    outbox.create_tables()
    names = ", ".join(t.name for t in outbox.tables.metadata.sorted_tables)
    Console().print(f"[green]created[/green] {names}")
