"""How every list command prints: a table for people, ``--json`` for scripts.

Cells are ``rich.text.Text``, never markup: a key, a topic or an error text
that holds ``[red]`` or ``[spark]`` is printed as it is, not eaten. When stdout
is not a terminal (a pipe, a file, ``kubectl logs``) the table is as wide as its
content: nothing wraps at 80 columns and no value is cut.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import typer
from rich.table import Table
from rich.text import Text

from ..core._terminal import stdout_console


def json_option() -> Any:
    """``--json``; a new option object per command, as each gets its own environment variable."""
    return typer.Option(False, "--json", help="Print one JSON array (one object per row) for scripts.")


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, empty: str) -> None:
    """``rows`` under ``columns`` (values printed as plain text), or ``empty`` when there are none."""
    found = list(rows)
    console = stdout_console()
    if not found:
        console.print(Text(empty))
        return
    table = Table(*columns)
    for row in found:
        table.add_row(*(Text(_text(value)) for value in row))
    console.print(table)


def print_json(rows: Iterable[dict[str, Any]]) -> None:
    """``rows`` as one JSON array; ids, times and enums as strings."""
    typer.echo(json.dumps(list(rows), indent=2, default=_text))


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    return str(getattr(value, "value", value))
