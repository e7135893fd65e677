"""The ``outbox …`` command lines the docs show, and whether the real CLI accepts them.

``doc_commands`` finds every line of a fenced block and every inline code span
that starts with ``outbox `` (after ``$ `` and ``VAR=value`` prefixes), joins
``\\`` continuations, and expands the docs' shorthand: ``list|retry|skip``
alternatives become one command each, ``[--shards N]`` brackets are dropped
around what they hold, a pipe, redirection or comment ends the command.
``parse_error`` parses a command with click's own parser on the Typer app
(``make_context`` with ``resilient_parsing``: nothing runs, a missing required
option is allowed since the docs leave ``--db`` to ``OUTBOX_DB``), and says
what is wrong: an unknown command or option, or an argument nothing takes.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN = re.compile(r"(?<!`)`(outbox [^`]+)`(?!`)")
ENDS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}
ELLIPSIS = {"…", "..."}
COMPLETE = "  # complete"  # marks a command a block shows in full: no option it needs may be missing


def source_commands(source: Path) -> Iterator[tuple[int, str]]:
    """(line number, command) for each `outbox …` span in a module's messages (what it tells users to run)."""
    text = source.read_text()
    for span in SPAN.finditer(text):
        number = text.count("\n", 0, span.start()) + 1
        yield from ((number, c) for c in _expand(" ".join(span.group(1).split())))


def doc_commands(doc: Path) -> Iterator[tuple[int, str]]:
    """(line number, command) for each ``outbox …`` command ``doc`` shows, shorthand expanded."""
    text = doc.read_text()
    for first, lines in _shell_blocks(text):
        prompted = any(line.startswith("$ ") for line in lines)
        for offset, line in enumerate(lines):
            if prompted and not line.startswith("$ "):
                continue  # the output of a command (`outbox console on http://…`), not one
            command = _strip_prefixes(line.strip())
            if command.startswith("outbox "):
                yield from ((first + offset, c + COMPLETE) for c in _expand(command))
    for span in SPAN.finditer(text):
        number = text.count("\n", 0, span.start()) + 1
        yield from ((number, c) for c in _expand(" ".join(span.group(1).split())))


def _shell_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines with ``\\`` continuations joined) of each fenced block but Python's."""
    language, start, lines = None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if language is None:
                language, start, lines = line[3:].strip() or "text", number + 1, []
                continue
            if language not in ("python", "py", "toml", "yaml", "json", "ini", "dockerfile"):
                yield start, "\n".join(lines).replace("\\\n", " ").splitlines()
            language = None
        elif language is not None:
            lines.append(line)


def _strip_prefixes(line: str) -> str:
    line = line.removeprefix("$ ")
    while re.match(r"[A-Z_][A-Z0-9_]*=\S*\s", line):
        line = line.split(None, 1)[1]
    return line


def _expand(command: str) -> list[str]:
    """``a b|c d`` → [``a b d``, ``a c d``]; ``\\|`` (escaped in a table) counts as ``|``."""
    command = command.replace("\\|", "|").replace("[", " ").replace("]", " ")
    words = shlex.split(command, comments=True)
    kept: list[str] = []
    for word in words:
        if word in ENDS or word.startswith((">", "2>")):
            break
        kept.append(word)
    variants: list[list[str]] = [[]]
    for word in kept:
        choices = word.split("|") if "|" in word and not word.startswith("-") else [word]
        variants = [[*v, c] for v in variants for c in choices]
    return [shlex.join(v) for v in variants]


@functools.cache
def cli() -> Any:
    """The real CLI as click sees it, built once: typer rebuilds the whole tree of commands from
    the app at every ``get_command`` (most of a check's time when each of some 900 parses built
    it again). Parsing only reads the tree: each parse makes a context and a parser of its own."""
    from outbox.cli import app

    return typer.main.get_command(app)


def parse_error(command: str) -> str | None:
    """Why the real CLI would not accept ``command`` (``outbox …``), or None if it would."""
    complete = command.endswith(COMPLETE)
    words = shlex.split(command, comments=True)
    assert words[0] == "outbox", command
    current = cli()
    path, args = ["outbox"], words[1:]
    parent = None
    while True:
        try:
            ctx = current.make_context(path[-1], list(args), parent=parent, resilient_parsing=True)
        except Exception as exc:  # typer's click: a UsageError (no such option, a bad value)
            if not hasattr(exc, "format_message"):
                raise
            return f"{' '.join(path)}: {exc.format_message()}"
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not hasattr(current, "resolve_command"):  # a command, not a group
            return _leaf_error(current, ctx, args, " ".join(path), complete)
        if not rest or rest[0] in ELLIPSIS:
            return None  # a group named on its own (`outbox parked`) or elided (`outbox spark …`)
        name, sub, args = current.resolve_command(ctx, rest)
        if sub is None:
            return f"{' '.join(path)}: no such command {rest[0]!r}"
        path.append(name or rest[0])
        current, parent = sub, ctx


def _leaf_error(command: Any, ctx: Any, args: list[str], name: str, complete: bool = False) -> str | None:
    """Parse ``args`` strictly (resilient parsing would drop an unknown option in silence).

    Only the parser runs: options and arguments must exist and take their
    values, but no value is converted. A ``complete`` command (a block's, not
    prose's) must also give each required option that no environment variable
    can (``--by``, ``--reason``).
    """
    ctx.resilient_parsing = False
    try:
        given, left, _ = command.make_parser(ctx).parse_args(list(args))
    except Exception as exc:
        if not hasattr(exc, "format_message"):
            raise
        if args and args[-1].startswith("-") and "requires an argument" in exc.format_message():
            return _leaf_error(command, ctx, [*args, "…"], name, complete)  # prose naming an option
        return f"{name}: {exc.format_message()}"
    extra = [a for a in left if a not in ELLIPSIS]
    if extra:
        return f"{name}: unexpected argument(s) {extra}"
    missing = [p.opts[0] for p in command.params if complete and p.param_type_name == "option"
               and p.required and not p.envvar and p.name not in given]
    return f"{name}: missing {', '.join(missing)}" if missing else None
