"""What a failed command prints, and its exit status: the one place that decides both.

Every command is registered on a ``Typer`` from this module, which wraps it in
``reporting``, and ``main`` sends click's own usage errors (a missing option)
to the same ``report``. Whatever a command raises ends here as one line on
stderr, ``error: <what is wrong> (<what to do>)``, and an exit status: 2 for
usage and configuration (retrying the same command line cannot help: a bad
option, URL, driver, missing tables, a wrong prefix, an unknown id, a bad
``-X`` setting), 1 for runtime failures (the database or the
broker did not answer, anything unexpected). The traceback is printed only
when Python logging is at DEBUG (``--log-level DEBUG``), because an operator
needs the sentence, and a developer the traceback.

Database errors carry no URL, so the command names the database it opens with
``naming(url)`` and the message repeats it (password hidden).
"""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import sqlalchemy as sa
import typer

from ..core._errors import ConfigurationError, OutboxError, SchemaError
from ..core._outage import is_database_outage
from ..core._secrets import database_secrets, database_url, scrub
from ._options import from_environment, warn_deprecated

USAGE, RUNTIME = 2, 1
STUCK = 3  # ``outbox status`` ran fine and found something stuck (a health check's "unhealthy")
_database = "the database"  # the URL of the database the command opened, for messages
_secrets: list[str] = []  # the forms its credentials can take in a message (``database_secrets``)


def safe_url(url: str) -> str:
    """The URL as it may appear in a message: password and secret query values hidden, parseable or not."""
    return database_url(url)


def naming(url: str) -> str:
    """Remember the database this command works on, so errors can name it; returns it printable."""
    global _database, _secrets
    _database = safe_url(url)
    _secrets = database_secrets(url)
    return _database


def hidden(text: str) -> str:
    """``text`` with the credentials of the database this command works on masked.

    A driver's message can repeat pieces of a password that URL parsing cut
    (an unescaped ``@`` moves them into the host name), so every message and
    traceback passes through here.
    """
    return scrub(text, _secrets)


F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


def reporting(command: Callable[P, R], renamed: list[tuple[str, str]] | None = None) -> Callable[P, R]:
    """``command``, with whatever it raises turned into ``report``'s line and exit status.

    ``renamed``: (variable, deprecated variable) pairs to warn about when the old one is set.
    """
    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        warn_deprecated(renamed or [])
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            raise typer.Exit(report(exc)) from None
    return run


class Typer(typer.Typer):
    """``typer.Typer`` whose commands report errors through ``reporting`` and read the environment.

    (``_options.from_environment``: every option also from an ``OUTBOX_…`` variable.)
    """

    def __init__(self, *args: Any, env_namespace: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_namespace = env_namespace  # the group's name; None: each command's own name

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        register = super().command(*args, **kwargs)
        name = args[0] if args else kwargs.get("name")

        def registered(command: F) -> F:
            namespace = self.env_namespace or name or command.__name__.replace("_", "-")
            renamed = from_environment(command, namespace)
            # typer's signature wants ``command``'s own type back: the wrapper has its
            # signature (``reporting`` keeps it), but a function object of its own.
            return register(cast(F, reporting(command, renamed)))
        return registered


def database_name() -> str:
    """The database this command works on, as named in messages."""
    return _database


def explain(exc: BaseException) -> tuple[str, int]:
    """(one-line message, exit status) for anything a command raised."""
    if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # click's usage errors
        context = getattr(exc, "ctx", None)
        hint = f" (see `{context.command_path} --help`)" if context is not None else ""
        message = exc.format_message()  # empty when the help was printed instead (no arguments)
        return (f"{message}{hint}" if message else ""), exc.exit_code
    if isinstance(exc, SchemaError):
        return f"{_database}: {exc}", USAGE
    if isinstance(exc, ConfigurationError):
        return str(exc), USAGE
    if isinstance(exc, OutboxError):
        return str(exc), RUNTIME
    if isinstance(exc, sa.exc.NoSuchModuleError):
        return (f"unknown database dialect or driver in {_database} (use e.g. "
                "postgresql+psycopg://user@host/db or sqlite:///file.db)"), USAGE
    if isinstance(exc, sa.exc.ArgumentError):
        return f"invalid database URL {_database}: {_first_line(exc)}", USAGE
    if isinstance(exc, ImportError):
        return _import_error(exc), USAGE
    if isinstance(exc, sa.exc.DBAPIError):
        reason = _first_line(exc.orig or exc)
        if is_database_outage(exc):
            return f"cannot reach {_database}: {reason} (is it running, and is --db right?)", RUNTIME
        if _missing_table(reason):
            return (f"{reason} in {_database} (run `outbox init-db`, or check "
                    "--prefix/--schema)"), USAGE
        return f"{_database}: {reason}", RUNTIME
    if _is_kafka_error(exc):
        return f"Kafka: {_first_line(exc)}", RUNTIME
    return f"{type(exc).__name__}: {_first_line(exc)} (--log-level DEBUG shows the traceback)", RUNTIME


def _import_error(exc: ImportError) -> str:
    """A missing module, by whose it is: ours (a broken installation), an extra's (its message says
    what to install), else the database driver the URL names (the one import a command makes for
    its URL). Before, every one was blamed on the database driver."""
    name = exc.name or "a module"
    if name.split(".")[0] in {"outbox", "transports"}:
        return f"cannot import {name}: {_first_line(exc)} (the installation is broken: reinstall it)"
    if "pip install" in str(exc):
        return _first_line(exc)
    return (f"cannot import {name} for {_database}: {_first_line(exc)} "
            f"(install the database driver this URL names)")


def report(exc: BaseException) -> int:
    """Print ``exc`` as ``error: …`` on stderr (with the traceback at DEBUG); return the exit status."""
    message, status = explain(exc)
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        print(hidden("".join(traceback.format_exception(exc))), file=sys.stderr, end="")
    if message:
        print(f"error: {hidden(message)}", file=sys.stderr, flush=True)
    return status


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _missing_table(reason: str) -> bool:
    lowered = reason.lower()
    return "no such table" in lowered or ("relation" in lowered and "does not exist" in lowered)


def _is_kafka_error(exc: Any) -> bool:
    return type(exc).__module__.startswith(("confluent_kafka", "cimpl", "kafka"))
