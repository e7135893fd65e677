"""Every option and argument of every command has help, and every environment variable is documented.

Both walk the real command tree (every command registered on the Typer app),
so a command added tomorrow is checked without touching this file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import click
import typer.main
from typer.testing import CliRunner

from outbox.cli import app

ROOT = Path(__file__).resolve().parents[1]
CONFIGURATION = ROOT / "docs" / "configuration.md"
# os.environ["X"], os.environ.get("X"), env.get("X"), and NAME_ENV/NAME_VARIABLE = "X" constants
# (a container's with_env("X", …) is not the process environment: \b keeps it out)
READS = re.compile(r"""\b(?:environ|env)(?:\.get|\.setdefault)?[(\[]\s*["']([A-Z][A-Z0-9_]+)["']"""
                   r"""|[A-Z_]*(?:_ENV|_VARIABLE)\s*=\s*["']([A-Z][A-Z0-9_]+)["']""")
NOT_PROCESS_ENVIRONMENT = {"PATH_INFO"}  # a WSGI request's environ, not the process's


def commands() -> Iterator[tuple[str, click.Command]]:
    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")
    yield from walk(typer.main.get_command(app), "outbox")


def variables(param: click.Parameter) -> list[str]:
    envvar = getattr(param, "envvar", None)
    return [] if not envvar else [envvar] if isinstance(envvar, str) else list(envvar)


def test_every_option_and_argument_of_every_command_has_help():
    missing = [f"{path} {param.human_readable_name}" for path, command in commands()
               for param in command.params if not (getattr(param, "help", None) or "").strip()]
    assert missing == []


def test_every_command_has_help():
    assert [path for path, command in commands() if not (command.help or command.short_help)] == []


def test_no_option_reads_a_generic_variable_first():
    """The issue's list: OUTBOX_TOPIC, OUTBOX_KEY, OUTBOX_JSON, OUTBOX_PORT … are no option's own name."""
    first = {variables(p)[0] for _, c in commands() for p in c.params if variables(p)}
    assert not first & {"OUTBOX_TOPIC", "OUTBOX_KEY", "OUTBOX_JSON", "OUTBOX_PORT", "OUTBOX_CONSOLE",
                        "OUTBOX_WINDOW", "OUTBOX_BATCH", "OUTBOX_OUT", "OUTBOX_MASTER"}


def test_each_variable_means_one_option():
    """Two options of different meaning never share a first (own) name."""
    meaning: dict[str, set[str]] = {}
    for _, command in commands():
        for param in command.params:
            if names := variables(param):
                meaning.setdefault(names[0], set()).add(param.name or "")
    assert {v: m for v, m in meaning.items() if len(m) > 1} == {"OUTBOX_DB": {"db", "outbox_db"}}


def test_every_variable_the_code_reads_is_documented():
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", CONFIGURATION.read_text()))
    read: dict[str, str] = {}
    for _, command in commands():
        for param in command.params:
            read.update({name: f"{command.name} --{param.name}" for name in variables(param)})
    for source in [*ROOT.glob("outbox/**/*.py"), *ROOT.glob("transports/**/*.py"),
                   *ROOT.glob("examples/*.py")]:
        for match in READS.finditer(source.read_text()):
            name = match.group(1) or match.group(2)
            if name not in NOT_PROCESS_ENVIRONMENT:
                read.setdefault(name, str(source.relative_to(ROOT)))
    assert len(read) > 60  # the walk and the scan found what they should
    assert {name: where for name, where in read.items() if name not in documented} == {}


def test_a_0_1_name_still_works_for_one_release_with_one_warning_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'app.db'}"
    runner = CliRunner()
    assert runner.invoke(app, ["init-db", "--db", url]).exit_code == 0
    old = runner.invoke(app, ["status", "--db", url], env={"OUTBOX_JSON": "1"})
    assert old.exit_code == 0, old.stderr
    assert json.loads(old.stdout)["stuck"] == []  # still read: the status came as JSON
    assert old.stderr.splitlines() == [
        "warning: environment variable OUTBOX_JSON is deprecated and stops working in the next release; "
        "use OUTBOX_STATUS_JSON"]
    both = runner.invoke(app, ["status", "--db", url], env={"OUTBOX_JSON": "1", "OUTBOX_STATUS_JSON": "0"})
    assert both.exit_code == 0 and "nothing stuck" in both.stdout  # the new name wins
    assert both.stderr.splitlines()[0].endswith("(ignored: OUTBOX_STATUS_JSON is set)")
    new = runner.invoke(app, ["status", "--db", url], env={"OUTBOX_STATUS_JSON": "1"})
    assert json.loads(new.stdout)["stuck"] == [] and new.stderr == ""
