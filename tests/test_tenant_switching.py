"""``outbox relay --tenants`` hands the interpreter lock to a waiting thread within a millisecond.

A quiet tenant's message passes through many threads of the fleet's process,
each waiting for the lock a backlog's worker holds: CPython's default switch
interval (5 ms) was paid at each step (docs/tenants.md, *The interpreter
lock*).
"""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from outbox.cli import _relay as relay_cli
from outbox.cli import app
from outbox.tenants import TenantRelay


def test_tune_switch_interval_sets_a_millisecond() -> None:
    """In a fresh interpreter: it changes a process-wide setting, never this test run's."""
    code = ("import sys, outbox.tenants as t; before = sys.getswitchinterval(); t.tune_switch_interval(); "
            "print(before, sys.getswitchinterval())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(float, out.stdout.split())
    assert before == 0.005 and abs(after - 0.001) < 1e-9


def test_the_fleet_command_runs_its_tenants_with_the_short_switch_interval(tmp_path, monkeypatch) -> None:
    seen: list[float] = []
    monkeypatch.setattr(TenantRelay, "run", lambda self, **_: seen.append(sys.getswitchinterval()))
    monkeypatch.setattr(relay_cli, "tune_gc_for_batches", lambda: None)  # not this test run's heap
    spec = tmp_path / "tenants.json"
    spec.write_text(json.dumps(["acme"]))
    before = sys.getswitchinterval()
    try:
        result = CliRunner().invoke(app, [
            "relay", "--db", f"sqlite:///{tmp_path / 'fleet.db'}", "--bootstrap-servers", "127.0.0.1:9",
            "--tenants", f"file:{spec}"])
    finally:
        sys.setswitchinterval(before)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1 and abs(seen[0] - 0.001) < 1e-9  # 1 ms (docs/tenants.md, *The interpreter lock*)
