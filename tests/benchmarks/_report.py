"""Writes one benchmark's results into its own section of docs/benchmarks.md.

Each benchmark owns the text between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``, so benchmarks can be re-run one at a time without
overwriting each other's tables.
"""

from __future__ import annotations

import platform
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

TREE = Path(__file__).resolve().parents[2]
"""This benchmark's tree. Its child processes run there: ``python -m outbox`` puts the working
directory first on ``sys.path``, so a relay started from another checkout ran that checkout's code,
whatever ``PYTHONPATH`` said (an A/B of a branch against main measured main twice)."""
DOC = TREE / "docs" / "benchmarks.md"


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    cpus = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{platform.python_implementation()} {platform.python_version()}, {cpus} cores"


def write_section(name: str, body: str) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    footer = f"_Measured {stamp} on {machine()}._"
    block = f"<!-- bench:{name} -->\n{body.strip()}\n\n{footer}\n<!-- /bench:{name} -->"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    print(f"wrote section {name!r} of {DOC}")
