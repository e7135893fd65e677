"""The ``outbox`` command. Each command group lives in its own module and
registers itself on ``app`` here; how a failed command reports is ``_errors``."""

from __future__ import annotations

import sys

from ._errors import Typer, report

app = Typer(
    name="outbox",
    help="Transactional outbox: database set-up, relay, inbox and audits.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)



@app.callback()
def _root() -> None:
    """Transactional outbox: database set-up, relay, inbox and audits."""


from . import _console, _db, _demo, _dev_broker, _inbox, _relay, _spark, _status  # noqa: E402,F401  (each adds commands)


def main() -> None:
    """Run the command line; click's own usage errors (a missing option) get one line too."""
    try:
        status = app(standalone_mode=False)
    except Exception as exc:  # what a command raises is reported by the command (_errors.reporting)
        status = report(exc)
    sys.exit(status if isinstance(status, int) else 0)
