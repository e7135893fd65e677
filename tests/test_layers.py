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
