"""``python -m outbox …`` run inside the test's own process, as a fresh interpreter would run it.

A subprocess costs a second and more of interpreter start and imports, for a
command that fails in milliseconds. ``outbox_in_process`` runs the same entry
point (``outbox/__main__.py``, through ``runpy`` like ``python -m``), with what
a fresh ``python -m outbox`` process would have: ``sys.argv``, the working
directory first on ``sys.path``, the root logger without handlers at WARNING
(so ``configure_logging`` installs its handler, as in the process), Python's
default warning filters with warnings printed on stderr, and ``cli._errors``
naming no database yet. It returns what ``subprocess.run`` would: the exit
status (``sys.exit``'s code; 1 and a traceback for an exception that escapes)
and stdout/stderr, captured at the file descriptors by pytest's ``capfd``.

Whatever the command changes in the process is put back afterwards: the
environment, the working directory, ``sys.argv``, ``sys.path`` and its
importer cache, modules imported from the working directory (an inbox app),
signal handlers, ``sys.excepthook`` (typer installs its own), loggers and
``cli._errors``'s module state; a database connection it made and left in the
pool of an engine it did not dispose is closed, as a process's exit would close
it. A thread it left running, or a garbage collector it froze, would outlive
the test: that fails the run instead.

Tests that prove something about the process itself (its start, imports,
signals, exit) keep running it as a subprocess.
"""

from __future__ import annotations

import gc
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import sqlalchemy as sa

from outbox.cli import _errors

FRESH_DATABASE, FRESH_SECRETS = "the database", list[str]()  # cli._errors before a command named one
# A fresh interpreter's warning filters (no -W, no PYTHONWARNINGS), in the order it lists them.
FRESH_FILTERS: list[tuple[Literal["default", "ignore"], type[Warning], str | None]] = [
    ("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None)]


def outbox_in_process(capfd: pytest.CaptureFixture[str], *args: str,
                      cwd: Path) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, "-m", "outbox", *args], cwd=cwd, capture_output=True,
    text=True)``, run in this process."""
    assert "PYTHONWARNINGS" not in os.environ and not sys.flags.dev_mode, "the fresh filters would differ"
    capfd.readouterr()  # what came before is not the command's
    with _as_a_fresh_process(list(args), cwd):
        try:
            runpy.run_module("outbox", run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exit:
            status = _exit_status(exit.code)
        except Exception:  # the interpreter prints an uncaught exception and exits 1
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([sys.executable, "-m", "outbox", *args], status, out, err)


def _exit_status(code: Any) -> int:
    """The process's exit status for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


@contextmanager
def _as_a_fresh_process(args: list[str], cwd: Path) -> Iterator[None]:
    environment, directory = dict(os.environ), os.getcwd()
    argv, argv_list, path, path_list = sys.argv[:], sys.argv, sys.path[:], sys.path
    importers, modules, excepthook = set(sys.path_importer_cache), set(sys.modules), sys.excepthook
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
    loggers = _loggers()
    named = _errors._database, _errors._secrets
    threads, threshold, frozen = set(threading.enumerate()), gc.get_threshold(), gc.get_freeze_count()
    native_threads = _native_threads()
    root = logging.getLogger()
    opened: list[weakref.ref[Any]] = []  # the database connections the command made

    def made(dbapi_connection: Any, record: Any) -> None:
        opened.append(weakref.ref(record))
    sa.event.listen(sa.pool.Pool, "connect", made)
    try:
        root.handlers[:] = []
        root.setLevel(logging.WARNING)
        _errors._database, _errors._secrets = FRESH_DATABASE, list(FRESH_SECRETS)
        os.chdir(cwd)
        sys.argv = ["-m", *args]  # runpy puts outbox/__main__.py's path first, as python -m does
        sys.path.insert(0, os.getcwd())  # python -m: the working directory is importable
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(FRESH_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = _print_warning
            yield
    finally:
        sa.event.remove(sa.pool.Pool, "connect", made)
        for record in filter(None, (ref() for ref in opened)):
            if record.dbapi_connection is not None and not record.in_use:
                record.close()  # pooled by an engine the command did not dispose: a process's exit closes it
        for name in set(sys.modules) - modules:  # an app of the working directory (another test's
            # has the same name), not a module of a package imported before (``outbox``'s lazy imports)
            if name.partition(".")[0] not in modules and _under(sys.modules[name], cwd):
                del sys.modules[name]
        for entry in set(sys.path_importer_cache) - importers:
            del sys.path_importer_cache[entry]
        sys.argv, sys.path, sys.excepthook = argv_list, path_list, excepthook
        sys.argv[:], sys.path[:] = argv, path
        os.chdir(directory)
        for variable in set(os.environ) - set(environment):
            del os.environ[variable]
        os.environ.update((k, v) for k, v in environment.items() if os.environ.get(k) != v)
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        _restore_loggers(loggers)
        _errors._database, _errors._secrets = named
        gc.set_threshold(*threshold)
    assert gc.get_freeze_count() == frozen, "the command froze the garbage collector (tune_gc_for_batches)"
    _no_thread_left(threads, native_threads)


def _print_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: Any = None, line: str | None = None) -> None:
    """What the interpreter's own ``warnings.showwarning`` does: write it to stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _loggers() -> dict[str, tuple[int, list[logging.Handler], bool, bool]]:
    every = {"": logging.getLogger()} | {
        name: logger for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)}
    return {name: (logger.level, logger.handlers[:], logger.propagate, logger.disabled)
            for name, logger in every.items()}


def _restore_loggers(saved: dict[str, tuple[int, list[logging.Handler], bool, bool]]) -> None:
    """The loggers that were there before as they were (a logger made since is a module's own)."""
    for name, (level, handlers, propagate, disabled) in saved.items():
        logger = logging.getLogger(name or None)
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()  # basicConfig's handler, on capfd's stderr
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled


def _no_thread_left(before: set[threading.Thread], native_before: int) -> None:
    """No Python thread the command started, and no native one (a librdkafka client's), still runs."""
    deadline = time.monotonic() + 5
    while (left := [t for t in threading.enumerate() if t not in before and t.is_alive()]) or \
            _native_threads() > native_before:
        assert time.monotonic() < deadline, \
            f"the command left threads running: {left}, {_native_threads() - native_before} native"
        time.sleep(0.05)


def _native_threads() -> int:
    """The process's threads as the kernel counts them (0 where there is no /proc)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:
        return 0


def _under(module: Any, directory: Path) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).resolve().is_relative_to(directory.resolve())
