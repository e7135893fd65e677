"""``outbox demo``: the guided tour on embedded defaults (SQLite, embedded broker)."""

from __future__ import annotations

from pathlib import Path

import typer

from . import app


@app.command("demo")
def demo(
    orders: int = typer.Option(300, min=10, help="How many orders to place."),
    workdir: Path = typer.Option(Path("demo-output"), help="Where databases and logs go."),
) -> None:
    """Orders and billing services through the outbox: ordering, a SIGKILLed relay, a parked key."""
    from ..demo import run_demo

    raise typer.Exit(run_demo(orders=orders, workdir=workdir))
