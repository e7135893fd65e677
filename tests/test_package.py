"""The wheel carries what type checkers and licence scanners look for."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow  # builds a wheel with pip: 5-30 s
def test_the_wheel_ships_py_typed_and_the_license(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("transactional_outbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"outbox/py.typed", "transports/py.typed", "outbox/core/_schema.py"} <= names
    assert {"outbox/console/templates/base.html", "outbox/console/templates/key.html"} <= names
    (license_file,) = [n for n in names if n.endswith("/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()


def test_tune_gc_for_batches_freezes_what_is_loaded_and_raises_the_thresholds() -> None:
    """In a fresh interpreter: it changes process-wide settings, never this test run's."""
    import subprocess
    import sys

    code = ("import gc, outbox; before = gc.get_freeze_count(); outbox.tune_gc_for_batches(); "
            "print(before, gc.get_freeze_count() > 10_000, gc.get_threshold())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split(maxsplit=2) == ["0", "True", "(10000, 20, 20)\n"]
