"""One convention across the command line: ``--version``, one error prefix, an ``init-db`` that
says what it did."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

import outbox
from outbox import _version
from outbox.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_version_is_the_installed_distributions():
    installed = importlib.metadata.version("transactional-outbox")
    assert outbox.__version__ == installed
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"outbox {installed}\n"


def test_a_source_tree_without_metadata_says_so(tmp_path, monkeypatch):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    _version.version.cache_clear()
    try:
        ours = _version.version()
    finally:
        _version.version.cache_clear()
    assert ours.endswith("+source") and ours.removesuffix("+source") == importlib.metadata.distribution(
        "transactional-outbox").version
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "someone-else"\nversion = "9.9"\n')
    assert _version.source_version(other) == "0+unknown"
    other.write_text("not toml [")
    assert _version.source_version(other) == "0+unknown"
    assert _version.source_version(tmp_path / "missing.toml") == "0+unknown"


@pytest.mark.slow  # a process per entry point: 5-30 s
def test_every_entry_point_reports_a_usage_error_as_one_error_line():
    """`outbox …` and `python -m outbox.spark …` (spark-submit's entry) alike: `error: …`, exit 2."""
    for entry in (["-m", "outbox", "spark", "audit", "--nope"], ["-m", "outbox.spark", "audit", "--nope"]):
        result = subprocess.run([sys.executable, *entry], capture_output=True, text=True, timeout=60,
                                cwd=ROOT)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: No such option: --nope"), line
        assert line.endswith("outbox spark audit --help`)"), line


def test_init_db_says_what_it_created_and_what_existed(tmp_path):
    url = f"sqlite:///{tmp_path / 'app.db'}"
    first = runner.invoke(app, ["init-db", "--db", url])
    assert first.exit_code == 0 and "created" in first.output and "existed" not in first.output
    again = runner.invoke(app, ["init-db", "--db", url])
    assert again.exit_code == 0, again.output
    assert "all tables exist already; nothing created" in again.output and "created inbox" not in again.output
    with sa.create_engine(url).begin() as conn:
        conn.execute(sa.text("DROP TABLE inbox_held"))
    partly = runner.invoke(app, ["init-db", "--db", url])
    assert partly.exit_code == 0, partly.output
    said = " ".join(partly.output.split())
    assert "created inbox_held; existed already: inbox_keys," in said and "outbox_messages" in said
