"""The wheel carries what type checkers and licence scanners look for."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_the_wheel_ships_py_typed_and_the_license(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("transactional_outbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"outbox/py.typed", "transports/py.typed", "outbox/_schema.py"} <= names
    (license_file,) = [n for n in names if n.endswith("/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()
