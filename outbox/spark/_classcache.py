"""A class-data-sharing archive for the driver JVM: written by ``outbox spark warm-up``, mapped by every run.

Starting the driver JVM and the SparkSession is mostly loading, parsing and
verifying some ten thousand classes from Spark's jars. A JVM started with an
archive of them (AppCDS, ``-XX:SharedArchiveFile``) maps them ready-made: on
two cores the session and its first job take about half the time.

A run maps the archive when there is one and never writes one: writing
(``-XX:ArchiveClassesAtExit``) makes the JVM's exit wait for a ~190 MB file,
which where nothing survives a run (a fresh container per job) would be paid
by every run for nothing. ``outbox spark warm-up`` writes it on purpose: its
JVM records the classes of a small audit, and the command waits for the JVM's
exit and moves the file into place, so no run ever maps a half-written
archive. The archive fits one Java runtime, one set of Spark jars and one set
of driver options, so its file name carries a hash of them; after an upgrade
runs find none until the next warm-up. One the JVM cannot start with is
deleted, and the start retried without it. ``OUTBOX_SPARK_CLASS_CACHE`` names
the directory (default ``~/.cache/outbox-spark``); set it empty to use no archive.
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
from collections.abc import Iterator, Mapping
from pathlib import Path

CACHE_ENV = "OUTBOX_SPARK_CLASS_CACHE"
# The JVM's unified logging prints to stdout by default: the dump's notices
# (skipped classes) must not end up among a command's output.
QUIET = "-Xlog:cds*=off"
STALE_SECONDS = 3600  # an unfinished dump this old belongs to a process that died
UNUSED_SECONDS = 30 * 86400  # an archive no run mapped for this long is for an old installation


_write = False


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Within it, a driver JVM that starts writes an archive at its exit (``outbox spark warm-up``)."""
    global _write
    _write = True
    try:
        yield
    finally:
        _write = False


def archive_path(base: str, settings: Mapping[str, str]) -> Path | None:
    """Where the archive for these driver options lives (it may not exist); None when turned off."""
    folder = _folder()
    return None if folder is None else folder / f"driver-{_fingerprint(base, settings)}.jsa"


def java_options(base: str, settings: Mapping[str, str], *,
                 write: bool | None = None) -> tuple[str, Path | None, Path | None]:
    """``(options, mapped, dump)``: ``base`` plus the options that map or write the archive.

    ``mapped`` is the archive the JVM maps, if one exists (``discard`` it
    should the JVM not start). Only with ``write`` (default: inside
    ``writing()``, as ``outbox spark warm-up`` runs) does the JVM write a new
    one at its exit, to ``dump`` (hand it to ``finish_at_exit``).
    """
    write = _write if write is None else write
    archive = archive_path(base, settings)
    if archive is None:
        return base, None, None
    if not write:
        if not archive.is_file():
            return base, None, None
        with contextlib.suppress(OSError):
            os.utime(archive)  # marks it in use, see _remove_stale
        return f'{base} "-XX:SharedArchiveFile={archive}" {QUIET}', archive, None
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return base, None, None
    _remove_stale(archive.parent)
    # One name per JVM: a process may start another after stopping its first.
    dump = archive.with_name(f"{archive.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    return f'{base} "-XX:ArchiveClassesAtExit={dump}" {QUIET}', None, dump


def discard(archive: Path) -> None:
    """Remove an archive the JVM could not start with; ``outbox spark warm-up`` writes a new one."""
    with contextlib.suppress(OSError):
        archive.unlink()


_pending: list[tuple[subprocess.Popen[bytes], Path | None]] = []
_at_exit = False  # _finish registered to run at the process's exit


def finish_at_exit(jvm: subprocess.Popen[bytes] | None, dump: Path | None) -> None:
    """At the process's exit: end the JVM and wait for it; place its archive if it writes one
    (``dump``; ``finish_pending`` places it earlier).

    Waited for with no archive to write too: a command that returned while its JVM was still
    ending left that JVM to whatever came next. A scheduler that ends the command's process group,
    or a warm-up that replaces the archive it still maps (it died of SIGBUS), killed it before its
    shutdown hooks removed its scratch directories (``blockmgr-*`` and ``spark-*``, some 10 MB a
    run, left in the temporary directory for ever)."""
    global _at_exit
    if jvm is not None:
        if not _at_exit:
            atexit.register(_finish, writing_only=False)
            _at_exit = True
        _pending.append((jvm, dump))


def finish_pending() -> list[Path]:
    """``finish`` every JVM ``finish_at_exit`` was given that writes an archive; the archives now in
    place. One that writes none is left to the process's exit: it may run the session the process
    goes on using (a test run's, beside a warm-up)."""
    return _finish(writing_only=True)


def _finish(*, writing_only: bool) -> list[Path]:
    done = []
    for jvm, dump in [(j, d) for j, d in _pending if d is not None or not writing_only]:
        _pending.remove((jvm, dump))
        archive = finish(jvm, dump)
        if archive is not None:
            done.append(archive)
    return done


def finish(jvm: subprocess.Popen[bytes], dump: Path | None) -> Path | None:
    """End the JVM and wait for it; rename a complete dump (exit code 0) to the archive's name."""
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
        return None  # left to _remove_stale
    if dump is None:
        return None
    archive = dump.with_name(dump.name.split(".jsa.")[0] + ".jsa")
    with contextlib.suppress(OSError):
        if jvm.returncode == 0 and dump.is_file():
            os.replace(dump, archive)
            return archive
        dump.unlink(missing_ok=True)
    return None


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
