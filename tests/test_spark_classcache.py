"""The driver JVM's class archive: written once under a name that fits the installation, then mapped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from outbox.spark import _classcache as classcache
from outbox.spark._session import FAST_START

pytestmark = pytest.mark.spark


def test_first_run_dumps_then_later_runs_map(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path))
    options, mapped, dump = classcache.java_options(FAST_START, {})
    assert mapped is None and dump is not None and dump.parent == tmp_path
    assert options.startswith(FAST_START) and f'"-XX:ArchiveClassesAtExit={dump}"' in options

    # A stand-in JVM that writes its archive when its stdin closes, as the gateway does.
    jvm = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read(); open({str(dump)!r}, 'w')"],
                           stdin=subprocess.PIPE)
    classcache.finish(jvm, dump)

    options, mapped, again = classcache.java_options(FAST_START, {})
    assert again is None and mapped is not None and mapped.is_file()
    assert list(tmp_path.iterdir()) == [mapped]
    assert f'"-XX:SharedArchiveFile={mapped}"' in options
    other = classcache.java_options(FAST_START, {"spark.driver.memory": "8g"})
    assert other[1] is None  # other driver settings: another archive


def test_a_failed_dump_leaves_nothing_and_an_empty_setting_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path))
    _, _, dump = classcache.java_options(FAST_START, {})
    assert dump is not None
    jvm = subprocess.Popen([sys.executable, "-c", f"open({str(dump)!r}, 'w'); raise SystemExit(1)"],
                           stdin=subprocess.PIPE)
    classcache.finish(jvm, dump)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(classcache.CACHE_ENV, "")
    assert classcache.java_options(FAST_START, {}) == (FAST_START, None, None)


def test_archives_unused_for_a_month_go_when_a_new_one_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path))
    old, dead = tmp_path / "driver-0000000000000000.jsa", tmp_path / "driver-x.jsa.1-ab.tmp"
    for path in (old, dead):
        path.write_bytes(b"")
        os.utime(path, (time.time() - 40 * 86400,) * 2)
    _, _, dump = classcache.java_options(FAST_START, {})
    assert dump is not None and not old.exists() and not dead.exists()
