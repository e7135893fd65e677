"""The ``outbox`` command. Each command group lives in its own module and
registers itself on ``app`` here."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="outbox",
    help="Transactional outbox: database set-up, relay, inbox and audits.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)



@app.callback()
def _root() -> None:
    """Transactional outbox: database set-up, relay, inbox and audits."""


from . import _db, _demo, _inbox, _relay, _spark  # noqa: E402,F401  (each registers its commands)


def main() -> None:
    app()
