"""A class-data-sharing archive for the driver JVM: built by the first run, mapped by the next.

Starting the driver JVM and the SparkSession is mostly loading, parsing and
verifying some ten thousand classes from Spark's jars. A JVM started with an
archive of them (AppCDS, ``-XX:SharedArchiveFile``) maps them ready-made: on
two cores the session and its first job take about half the time.

The archive fits one Java runtime, one set of Spark jars and one set of
driver options, so its file name carries a hash of them; an upgrade makes a
new one. A run that finds none has its JVM write one when it exits
(``-XX:ArchiveClassesAtExit``), waits for that at the end of the process and
moves the file into place, so no run ever maps a half-written archive (one
the JVM cannot start with is deleted, and the start retried without it). That
first run takes 40 to 55 s longer on two shared cores: recording and writing the
classes is slow, but it is paid once. ``OUTBOX_SPARK_CLASS_CACHE`` names the directory
(default ``~/.cache/outbox-spark``); set it empty to use no archive.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "OUTBOX_SPARK_CLASS_CACHE"
# The JVM's unified logging prints to stdout by default: the dump's notices
# (skipped classes) must not end up among a command's output.
QUIET = "-Xlog:cds*=off"
STALE_SECONDS = 3600  # an unfinished dump this old belongs to a process that died
UNUSED_SECONDS = 30 * 86400  # an archive no run mapped for this long is for an old installation


def java_options(base: str, settings: Mapping[str, str]) -> tuple[str, Path | None, Path | None]:
    """``(options, mapped, dump)``: ``base`` plus the options that map or write the archive.

    ``mapped`` is the archive the JVM maps, if any (``discard`` it should the
    JVM not start); ``dump`` is where the JVM writes a new one at its exit,
    if it does (hand it to ``finish_at_exit``).
    """
    folder = _folder()
    if folder is None:
        return base, None, None
    archive = folder / f"driver-{_fingerprint(base, settings)}.jsa"
    if archive.is_file():
        with contextlib.suppress(OSError):
            os.utime(archive)  # marks it in use, see _remove_stale
        return f'{base} "-XX:SharedArchiveFile={archive}" {QUIET}', archive, None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return base, None, None
    _remove_stale(folder)
    # One name per JVM: a process may start another after stopping its first.
    dump = folder / f"{archive.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    return f'{base} "-XX:ArchiveClassesAtExit={dump}" {QUIET}', None, dump


def discard(archive: Path) -> None:
    """Remove an archive the JVM could not start with; the next run writes a new one."""
    with contextlib.suppress(OSError):
        archive.unlink()


def finish_at_exit(jvm: subprocess.Popen[bytes] | None, dump: Path | None) -> None:
    """At the process's exit, let the JVM end (it dumps then) and move its archive into place."""
    if jvm is not None and dump is not None:
        atexit.register(finish, jvm, dump)


def finish(jvm: subprocess.Popen[bytes], dump: Path) -> None:
    """End the JVM, wait for its dump, and rename a complete one (exit code 0) to the archive's name."""
    from pyspark import SparkContext

    if SparkContext._active_spark_context is not None:
        # Stopped first, or its accumulator server reports the JVM's exit as an error.
        with contextlib.suppress(Exception):
            SparkContext._active_spark_context.stop()
    if jvm.poll() is None and jvm.stdin is not None:
        with contextlib.suppress(OSError):
            jvm.stdin.close()  # the gateway JVM exits normally when its stdin closes
    try:
        jvm.wait(timeout=300)
    except subprocess.TimeoutExpired:
        return  # left to _remove_stale
    with contextlib.suppress(OSError):
        if jvm.returncode == 0 and dump.is_file():
            os.replace(dump, dump.with_name(dump.name.split(".jsa.")[0] + ".jsa"))
        else:
            dump.unlink(missing_ok=True)


def _folder() -> Path | None:
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "outbox-spark"


def _fingerprint(base: str, settings: Mapping[str, str]) -> str:
    """A hash of what the archive depends on: the java binary, Spark's jars, the driver settings."""
    from pyspark.find_spark_home import _find_spark_home

    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java") or "java"
    parts = [base, os.path.realpath(java), *_stat(Path(os.path.realpath(java)))]
    jars = Path(_find_spark_home()) / "jars"
    for jar in sorted(jars.glob("*.jar")) if jars.is_dir() else []:
        parts += [jar.name, *_stat(jar)]
    parts += [f"{k}={v}" for k, v in sorted(settings.items()) if k.startswith("spark.driver.")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _stat(path: Path) -> list[str]:
    try:
        info = path.stat()
    except OSError:
        return ["missing"]
    return [str(info.st_size), str(info.st_mtime_ns)]


def _remove_stale(folder: Path) -> None:
    """Dumps of processes that died, and archives of installations no longer used (190 MB each)."""
    for pattern, age in (("*.tmp", STALE_SECONDS), ("driver-*.jsa", UNUSED_SECONDS)):
        for leftover in folder.glob(pattern):
            with contextlib.suppress(OSError):
                if time.time() - leftover.stat().st_mtime > age:
                    leftover.unlink()
