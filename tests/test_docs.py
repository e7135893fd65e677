"""The README's and docs' Python code blocks run, so the docs cannot rot.

All ```python blocks of one file run in order in one namespace, in a scratch
directory. Shell sessions are written as ```console and are not run here; the
commands they show are exercised by their own tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import outbox.core._events

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _param(doc: Path):
    """Docs that run Spark jobs need a JVM, like the Spark tests."""
    marks = [pytest.mark.spark] if "outbox.spark" in doc.read_text() else []
    return pytest.param(doc, marks=marks, id=doc.relative_to(ROOT).as_posix())


@pytest.mark.parametrize("doc", [_param(d) for d in DOCS if BLOCK.search(d.read_text())])
def test_python_blocks_run(doc, tmp_path, monkeypatch, request):
    if "outbox.spark" in doc.read_text():
        request.getfixturevalue("java_home")
    monkeypatch.chdir(tmp_path)
    # Each page runs as a fresh service would: event classes registered by other tests in this
    # worker (examples.order_events sends "orders.OrderPaid" too) are not the page's.
    monkeypatch.setattr(outbox.core._events, "_SPECS", {})
    monkeypatch.setattr(outbox.core._events, "_TYPES", {})
    namespace: dict = {"__name__": f"docs.{doc.stem}"}
    for number, match in enumerate(BLOCK.finditer(doc.read_text()), 1):
        code = compile(match.group(1), f"{doc.name} block {number}", "exec")
        exec(code, namespace)


def test_links_between_docs_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+\.md)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def _commands_of(paths, find):
    for path in paths:
        for number, command in find(path):
            yield f"{path.relative_to(ROOT)}:{number}", command


def test_every_outbox_command_the_docs_show_parses():
    """Each `outbox …` line of README and docs/ names real commands and options (nothing runs)."""
    from _doc_commands import doc_commands, parse_error

    shown = list(_commands_of(DOCS, doc_commands))
    assert len(shown) > 150  # the extraction finds the docs' commands, not nothing
    wrong = [f"{where}: {command}\n    {error}" for where, command in shown
             if (error := parse_error(command)) is not None]
    assert not wrong, "\n".join(wrong)


def test_every_outbox_command_a_message_names_parses():
    """What the library's messages tell users to run (`outbox init-db --db …`) exists too."""
    from _doc_commands import parse_error, source_commands

    named = list(_commands_of(sorted((ROOT / "outbox").rglob("*.py")), source_commands))
    assert len(named) > 10
    wrong = [f"{where}: {command}\n    {error}" for where, command in named
             if (error := parse_error(command)) is not None]
    assert not wrong, "\n".join(wrong)


def _every_command():
    """(path words, command) of every command of the real CLI, groups walked recursively."""
    import typer

    from outbox.cli import app

    def walk(command, path):
        subcommands = getattr(command, "commands", None)
        if subcommands is None:
            yield path, command
            return
        for name, sub in subcommands.items():
            yield from walk(sub, [*path, name])
    yield from walk(typer.main.get_command(app), [])


def test_the_checker_accepts_every_real_option_and_rejects_any_other():
    """Over the whole CLI: each option of each command parses; a misspelt one, an unknown
    command and a surplus argument do not — so a passing doc check means something."""
    from _doc_commands import parse_error

    commands = list(_every_command())
    assert len(commands) > 15
    for path, command in commands:
        line = " ".join(["outbox", *path])
        positional = [p for p in command.params if p.param_type_name == "argument"]
        assert parse_error(line + " …") is None
        if not positional:
            assert parse_error(line + " surplus") is not None, line
        for param in command.params:
            if param.param_type_name != "option":
                continue
            flag = next(o for o in param.opts if o.startswith("--"))
            value = [] if param.is_flag else ["VALUE"]
            assert parse_error(" ".join([line, flag, *value])) is None, (line, flag)
            assert parse_error(" ".join([line, flag + "x", *value])) is not None, (line, flag)
    assert parse_error("outbox no-such-command") is not None
    assert parse_error("outbox inbox no-such-command") is not None
