"""The README's demo command, run exactly as written, and its claims checked independently."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]


def readme_command(name: str) -> str:
    """The first command line in the README that starts with ``name``."""
    block = re.search(r"```console\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    for line in block.splitlines():
        command = line.split("#")[0].strip()
        if command.startswith(name):
            return command
    raise AssertionError(f"README's first console block has no {name} command")


@pytest.mark.slow
@pytest.mark.any_kafka
def test_readme_demo_command(tmp_path):
    command = readme_command("scripts/demo")
    result = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "all checks passed" in output
    assert re.search(r"lost events\s+│\s+0 │", output), output[-3000:]
    assert re.search(r"per-key order violations\s+│\s+0 │", output)
    assert "SIGKILL relay" in output and "ALERT key_parked" in output
    for noise in ("Using incubator modules", "log4j", "NativeCodeLoader", "setLogLevel", "WARN "):
        assert noise not in output, output[-3000:]  # the JVM's start-up lines stay out

    work = ROOT / "demo-output"
    with sa.create_engine(f"sqlite:///{work / 'orders.db'}").connect() as conn:
        statuses = dict(conn.execute(sa.text(
            "SELECT status, count(*) FROM outbox_messages GROUP BY status")).all())
    assert statuses == {"published": 900}
    with sa.create_engine(f"sqlite:///{work / 'billing.db'}").connect() as conn:
        shipped = conn.scalar(sa.text("SELECT count(*) FROM invoices WHERE state = 'shipped'"))
        keys_parked = conn.scalar(sa.text("SELECT count(*) FROM inbox_keys WHERE parked"))
        applied = conn.scalar(sa.text("SELECT count(DISTINCT message_id) FROM inbox_messages"))
    assert (shipped, keys_parked, applied) == (300, 0, 900)
