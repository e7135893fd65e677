"""Layers run one way: ``transports`` is the lowest package and stands alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = ["transports", "transports.kafka", "transports.kafka_python", "transports.memory",
           "transports.testing"]
FRAMEWORK = ("outbox", "sqlalchemy", "pydantic", "prometheus_client")


@pytest.mark.parametrize("module", MODULES)
def test_a_transport_loads_nothing_of_the_framework(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"loaded = sorted(m for m in {FRAMEWORK!r} if m in sys.modules)\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_the_framework_reexports_the_transport_errors() -> None:
    import outbox
    import transports._errors as low

    shared = ("OutboxError", "ConfigurationError", "TransportError", "RetriableTransportError",
              "InvalidTopicError")
    for name in shared:
        assert getattr(outbox, name) is getattr(low, name)


def test_console_and_ops_read_the_inbox_through_its_public_admin_api() -> None:
    """``outbox.console`` and ``outbox.ops`` import no private module of ``outbox.inbox``."""
    import ast
    import pathlib

    import outbox

    root = pathlib.Path(outbox.__file__).parent
    private = []
    for package in ("console", "ops"):
        for path in sorted((root / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    parts = node.module.split(".")
                    if "inbox" in parts and any(p.startswith("_") for p in parts[parts.index("inbox") + 1:]):
                        private.append(f"{path.relative_to(root)}: from {'.' * node.level}{node.module}")
    assert private == []
