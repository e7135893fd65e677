"""The README's and docs' Python code blocks run, so the docs cannot rot.

All ```python blocks of one file run in order in one namespace, in a scratch
directory. Shell sessions are written as ```console and are not run here; the
commands they show are exercised by their own tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    namespace: dict = {"__name__": f"docs.{doc.stem}"}
    for number, match in enumerate(BLOCK.finditer(doc.read_text()), 1):
        code = compile(match.group(1), f"{doc.name} block {number}", "exec")
        exec(code, namespace)


def test_links_between_docs_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+\.md)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
