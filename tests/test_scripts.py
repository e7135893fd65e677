"""scripts/setup: the demo installs only what it uses, and a busy package manager is waited for, then named.

The script runs with a PATH of its own: the few tools it calls, and stand-ins for
``id`` (root) and ``apt-get`` (another apt holds the lock), so nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("dirname", "ls", "mktemp", "grep", "cat", "rm")
BUSY_APT = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/apt-get.calls"
echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)" >&2
exit 100
"""


def _bin(tmp_path: Path, apt: str | None = None) -> Path:
    """A directory for PATH: the real tools the script needs, nothing it checks for (java, cc, …)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (directory / tool).symlink_to(found)
    (directory / "id").write_text("#!/bin/sh\necho 0\n")
    if apt is not None:
        (directory / "apt-get").write_text(apt)
    for stub in directory.iterdir():
        if not stub.is_symlink():
            stub.chmod(0o755)
    return directory


def _setup(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash
    own = {"PATH": str(directory), "HOME": os.environ.get("HOME", "/"), **env}
    return subprocess.run([bash, str(ROOT / "scripts" / "setup"), *args], capture_output=True, text=True,
                          timeout=60, env=own)


def test_the_demo_installs_only_what_it_uses_and_the_tests_everything(tmp_path):
    directory = _bin(tmp_path)
    demo = _setup(directory, "--demo", "--dry-run")
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.splitlines() == ["system packages: openjdk-17-jre-headless",
                                        "python extras: kafka,console,spark"]
    full = _setup(directory, "--dry-run")
    assert full.returncode == 0, full.stderr
    packages = set(full.stdout.splitlines()[0].removeprefix("system packages: ").split())
    # (PostgreSQL and MariaDB are also found at fixed paths, so whether they are listed depends on the host)
    assert {"libmariadb-dev", "build-essential", "faketime", "chromium", "chromium-driver",
            "openjdk-17-jre-headless"} <= packages
    assert full.stdout.splitlines()[1] == "python extras: all,dev"
    assert "\nscripts/setup --demo\n" in (ROOT / "scripts" / "demo").read_text()


def test_a_busy_package_manager_is_waited_for_then_explained_in_one_line(tmp_path):
    directory = _bin(tmp_path, apt=BUSY_APT)
    result = _setup(directory, "--demo", APT_LOCK_WAIT="7")
    assert result.returncode == 1, (result.returncode, result.stderr)
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith("another apt/dpkg still holds the package lock after 7 s"), line
    assert "openjdk-17-jre-headless" in line
    calls = (directory / "apt-get.calls").read_text().splitlines()
    assert calls == ["-o DPkg::Lock::Timeout=7 update -qq"]  # apt itself waited; nothing installed after
