"""The ``outbox`` command. Each command group lives in its own module and
registers itself on ``app`` here; how a failed command reports is ``_errors``."""

from __future__ import annotations

import sys

import typer

from ._errors import Typer, report

app = Typer(
    name="outbox",
    help="Transactional outbox: database set-up, relay, inbox and audits.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)



def _print_version(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:  # parsing only (completion, the docs' check): print nothing
        from .._version import version

        print(f"outbox {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the installed version and exit."),
) -> None:
    """Transactional outbox: database set-up, relay, inbox and audits."""


from . import (  # noqa: E402,F401  (each adds commands)
    _console,
    _db,
    _demo,
    _dev_broker,
    _housekeeping,
    _inbox,
    _relay,
    _spark,
    _status,
    _trace,
)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Run the command line; click's own usage errors (a missing option) get one line too.

    ``args``/``prog_name`` serve other entry points (``python -m outbox.spark``), so
    every way in reports errors the same way: one ``error: …`` line.
    """
    try:
        status = app(args, prog_name=prog_name, standalone_mode=False)
    except Exception as exc:  # what a command raises is reported by the command (_errors.reporting)
        status = report(exc)
    sys.exit(status if isinstance(status, int) else 0)
