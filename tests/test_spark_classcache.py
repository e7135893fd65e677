"""The driver JVM's class archive: written only by ``outbox spark warm-up``, then mapped by every run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _spark_seed import AS_OF, build, seed

from outbox.spark import _classcache as classcache
from outbox.spark._session import FAST_START

# A group of its own: every JVM here is an ``outbox spark`` process, none is the worker's
# session; one worker keeps the module's warm-up fixture.
pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark-classcache")]
OUTBOX = str(Path(sys.executable).parent / "outbox")


def test_a_run_without_an_archive_maps_none_and_writes_none(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path / "cache"))
    assert classcache.java_options(FAST_START, {}) == (FAST_START, None, None)
    assert not (tmp_path / "cache").exists()


def test_the_warm_up_path_dumps_then_runs_map(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path))
    with classcache.writing():
        options, mapped, dump = classcache.java_options(FAST_START, {})
    assert mapped is None and dump is not None and dump.parent == tmp_path
    assert options.startswith(FAST_START) and f'"-XX:ArchiveClassesAtExit={dump}"' in options
    assert classcache.java_options(FAST_START, {})[2] is None  # outside writing(): no dump

    # A stand-in JVM that writes its archive when its stdin closes, as the gateway does.
    jvm = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read(); open({str(dump)!r}, 'w')"],
                           stdin=subprocess.PIPE)
    classcache.finish_at_exit(jvm, dump)
    [archive] = classcache.finish_pending()
    assert archive == classcache.archive_path(FAST_START, {})

    options, mapped, again = classcache.java_options(FAST_START, {})
    assert again is None and mapped == archive and list(tmp_path.iterdir()) == [archive]
    assert f'"-XX:SharedArchiveFile={archive}"' in options
    other = classcache.java_options(FAST_START, {"spark.driver.memory": "8g"})
    assert other == (FAST_START, None, None)  # other driver settings: another archive, none yet


def test_a_failed_dump_leaves_nothing_and_an_empty_setting_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path))
    _, _, dump = classcache.java_options(FAST_START, {}, write=True)
    assert dump is not None
    jvm = subprocess.Popen([sys.executable, "-c", f"open({str(dump)!r}, 'w'); raise SystemExit(1)"],
                           stdin=subprocess.PIPE)
    assert classcache.finish(jvm, dump) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(classcache.CACHE_ENV, "")
    assert classcache.java_options(FAST_START, {}, write=True) == (FAST_START, None, None)


def test_archives_unused_for_a_month_go_when_a_new_one_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(classcache.CACHE_ENV, str(tmp_path))
    old, dead = tmp_path / "driver-0000000000000000.jsa", tmp_path / "driver-x.jsa.1-ab.tmp"
    for path in (old, dead):
        path.write_bytes(b"")
        os.utime(path, (time.time() - 40 * 86400,) * 2)
    _, _, dump = classcache.java_options(FAST_START, {}, write=True)
    assert dump is not None and not old.exists() and not dead.exists()


# -- the real JVM: one warm-up for the module, audits as a scheduler runs them ----------------------


@pytest.fixture(scope="module")
def scene(java_home, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("classcache")
    seed(build(n=2_000, keys=20), f"sqlite:///{root / 'outbox.db'}", f"sqlite:///{root / 'inbox.db'}")
    return root


def run(root: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # cwd: a JVM that crashes on a damaged archive leaves its hs_err file there
    return subprocess.run([OUTBOX, "spark", *args], capture_output=True, text=True, cwd=root,
                          env={**os.environ, classcache.CACHE_ENV: str(cache)}, timeout=600)


def audit(root: Path, cache: Path) -> str:
    done = run(root, cache, "audit", "--outbox-db", f"sqlite:///{root / 'outbox.db'}",
               "--inbox-db", f"sqlite:///{root / 'inbox.db'}", "--out", str(root / "audit"),
               "--sla", "10m", "--as-of", AS_OF.isoformat(), "--master", "local[2]")
    assert done.returncode == 1, done.stderr[-3000:]  # the scenario has lost messages
    return done.stdout


@pytest.fixture(scope="module")
def warmed(scene) -> tuple[Path, subprocess.CompletedProcess[str]]:
    cache = scene / "cache"
    return cache, run(scene, cache, "warm-up")


@pytest.mark.slow
def test_warm_up_writes_an_archive_the_next_audit_maps_and_a_damaged_one_is_discarded(scene, warmed):
    """One JVM audit with the archive mapped, one with it damaged: the second starts without it
    (discarded, nothing written in its place) and is the reference the first must equal, so
    the module pays for no third audit of its own."""
    cache, done = warmed
    assert done.returncode == 0, done.stderr[-3000:]
    [archive] = cache.iterdir()
    assert archive.name.endswith(".jsa") and archive.stat().st_size > 50_000_000
    assert f"class archive written: {archive}" in done.stderr and done.stdout == ""
    again = run(scene, cache, "warm-up")
    assert again.returncode == 0 and "class archive already in place" in again.stderr

    long_ago = time.time() - 86400
    os.utime(archive, (long_ago, long_ago))
    mapped = audit(scene, cache)
    assert archive.stat().st_mtime > long_ago + 3600  # mapped: java_options marked it in use
    assert list(cache.iterdir()) == [archive]

    # Damaged: half of it, put in its place. Not truncated in place: the mapped audit's JVM is
    # still exiting after its command returned, and a mapped file cut short under it kills it
    # (SIGBUS) before it removes its blockmgr-* and spark-* directories from /tmp.
    damaged = archive.with_name("damaged.tmp")
    with archive.open("rb") as whole, damaged.open("wb") as half:
        half.write(whole.read(archive.stat().st_size // 2))
    os.replace(damaged, archive)
    without = audit(scene, cache)
    assert list(cache.iterdir()) == []  # discarded; nothing new written either
    assert "PROBLEM:" in without and mapped == without
