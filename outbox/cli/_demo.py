"""``outbox demo``: the guided tour on embedded defaults (SQLite, embedded broker)."""

from __future__ import annotations

from pathlib import Path

import typer

from . import app


@app.command("demo")
def demo(
    orders: int = typer.Option(300, min=10, help="How many orders to place."),
    workdir: Path = typer.Option(Path("demo-output"), help="Where databases and logs go."),
    console: bool = typer.Option(False, "--console", help="Then serve the web console until Ctrl-C."),
    port: int = typer.Option(8470, min=1, max=65535, help="The console's port (with --console)."),
) -> None:
    """Orders and billing services through the outbox: ordering, a SIGKILLed relay, a parked key."""
    from ..demo import run_demo

    status = run_demo(orders=orders, workdir=workdir)
    if console:
        from ..demo._console import serve_console

        serve_console(workdir, port=port)
    raise typer.Exit(status)
