"""Options shared by several commands, so each is spelled, documented and parsed one way.

Every option is also read from an environment variable, shown in ``--help``:
a container or a systemd unit configures a worker without a shell line. An
option every command means the same by (``--db``, ``--bootstrap-servers``) is
``OUTBOX_`` and its name (``OUTBOX_DB``); any other is namespaced by its
command (``parked list --topic`` → ``OUTBOX_PARKED_TOPIC``, ``demo --port`` →
``OUTBOX_DEMO_PORT``). ``from_environment`` assigns the names when a command
is registered, so no command can forget one; docs/configuration.md lists them. Options
that choose *what an operator action hits* (``--all``, ``--force``,
``--upgrade``, ``--reshard``, ``--new-incarnation``, ``--by``, ``--reason``) are read from the command
line only: a variable left in an environment must never widen a retry or a
skip to every row.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import typer
from typer.models import OptionInfo

ENV_PREFIX = "OUTBOX_"
COMMAND_LINE_ONLY = frozenset({"all", "force", "upgrade", "reshard", "new-incarnation", "by", "reason",
                               "help"})
# Options that mean the same to every command that has them keep the short name;
# every other option is namespaced by its command (``OUTBOX_PARKED_TOPIC``), so a
# variable set for one command never changes what another does.
SHARED = frozenset({"db", "inbox-db", "prefix", "schema", "bootstrap-servers", "kafka-config", "log-level",
                    "metrics-port", "metrics-host", "group", "shards", "app"})
# Variables introduced with their namespaced name: no 0.1 name to carry over.
NO_OLD_NAME = frozenset({"OUTBOX_PARKED_JSON", "OUTBOX_PARKED_TSV", "OUTBOX_FAILED_JSON",
                         "OUTBOX_STATS_JSON"})
_assigned: dict[int, tuple[str, str | None]] = {}  # id(option) -> (its variable, the deprecated one)


def env_name(flag: str, namespace: str = "") -> str:
    """``--bootstrap-servers`` → ``OUTBOX_BOOTSTRAP_SERVERS``; ``parked --topic`` → ``OUTBOX_PARKED_TOPIC``.

    ``--outbox-db`` → ``OUTBOX_DB``. ``namespace`` is the command group (``parked``,
    ``spark``) or the top-level command (``relay``, ``demo``); shared options ignore it.
    """
    stem = flag.lstrip("-").removeprefix("outbox-")
    if stem not in SHARED and namespace:
        stem = f"{namespace}-{stem}"
    return ENV_PREFIX + stem.upper().replace("-", "_")


def from_environment(command: Callable[..., Any], namespace: str) -> list[tuple[str, str]]:
    """Give each option of ``command`` without an environment variable its ``OUTBOX_…`` one.

    Returns the (variable, deprecated variable) pairs of the command: until 0.4 the
    0.1 read namespaced options from the bare name (``OUTBOX_TOPIC``), which still
    works for one release, with a warning (``warn_deprecated``).
    """
    renamed = []
    for name, parameter in inspect.signature(command).parameters.items():
        info = parameter.default
        if not isinstance(info, OptionInfo):
            continue
        flag = next((d for d in info.param_decls or () if d.startswith("--")), "--" + name.replace("_", "-"))
        if flag.lstrip("-") in COMMAND_LINE_ONLY:
            continue
        if id(info) in _assigned:  # one option object shared by several commands
            variable, old = _assigned[id(info)]
            if variable != env_name(flag, namespace):
                raise RuntimeError(f"option {flag} is shared by commands of other namespaces; "
                                   f"give each command its own typer.Option")
        elif info.envvar is not None:
            continue  # named by hand (OUTBOX_CONSOLE_PORT, OUTBOX_DEV_BROKERS)
        else:
            variable, bare = env_name(flag, namespace), env_name(flag)
            old = bare if bare != variable and variable not in NO_OLD_NAME else None
            info.envvar = [variable, old] if old else variable
            info.show_envvar = True
            _assigned[id(info)] = (variable, old)
        if old:
            renamed.append((variable, old))
    return renamed


def warn_deprecated(renamed: list[tuple[str, str]]) -> None:
    """One line on stderr for each deprecated variable set in the environment."""
    import os
    import sys

    for variable, old in renamed:
        if old in os.environ:
            ignored = f" (ignored: {variable} is set)" if variable in os.environ else ""
            print(f"warning: environment variable {old} is deprecated and stops working in the next "
                  f"release; use {variable}{ignored}", file=sys.stderr, flush=True)


DB = typer.Option(..., "--db", help="SQLAlchemy database URL, e.g. postgresql+psycopg://… or sqlite:///app.db")
PREFIX = typer.Option("", "--prefix", help="Table name prefix.")
SCHEMA = typer.Option(None, "--schema", help="Database schema of the tables.")
BOOTSTRAP_SERVERS = typer.Option(
    ..., "--bootstrap-servers", envvar=["OUTBOX_BOOTSTRAP_SERVERS", "KAFKA_BOOTSTRAP_SERVERS"],
    help="Kafka brokers, host:port,…")

KAFKA_CONFIG = typer.Option(
    [], "--kafka-config", "-X",
    help="KEY=VALUE Kafka setting: a kafka-python-ng name (linger_ms) or a librdkafka key "
         "(linger.ms). Repeat for several.",
)


def parse_kafka_config(pairs: list[str]) -> dict[str, str]:
    """``["linger.ms=5", …]`` → ``{"linger.ms": "5", …}``; a pair without '=' is a usage error."""
    config = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {_setting_name_of(pair)}",
                                     param_hint="--kafka-config")
        config[name.strip()] = value
    return config


METRICS_HOST = typer.Option(
    "0.0.0.0", "--metrics-host",
    help="Address the --metrics-port server listens on: 0.0.0.0 (every IPv4 interface, what a "
         "Kubernetes probe of the pod IP needs), :: (IPv6 too), 127.0.0.1 (this host only) or "
         "one interface's address.")

def _setting_name_of(pair: str) -> str:
    """What of a malformed ``-X`` pair may be echoed: its start if that names a setting, else nothing.

    A mistyped separator (``sasl.password:…``) or a bare value (a password given
    without its key) must not print the value.
    """
    from transports.kafka._settings import KAFKA_PYTHON_NAMES

    start = re.match(r"[\w.-]*", pair)
    name = start.group() if start else ""
    if "." in name or name in KAFKA_PYTHON_NAMES:
        return repr(name + ("…" if len(name) < len(pair) else ""))
    return f"a value of {len(pair)} character(s) without '=' (not shown: it may be a secret)"


BY = typer.Option(..., "--by", help="Who acts (kept with the record, like the console's operator).")
REASON = typer.Option(..., "--reason", help="Why (kept with the record; the console demands one too).")


def operator(by: str, reason: str) -> tuple[str, str]:
    """(who, why) of an operator action, both non-empty: every action is recorded with them."""
    who, why = by.strip(), reason.strip()
    if not who:
        raise typer.BadParameter("say who acts: it is recorded with the action", param_hint="--by")
    if not why:
        raise typer.BadParameter("say why: every action is recorded with a reason", param_hint="--reason")
    return who, why


LOG_LEVEL = typer.Option("INFO", "--log-level", help="Python log level (DEBUG, INFO, WARNING …).")


def configure_logging(level: str) -> None:
    """One log format for every long-running command (relay, inbox)."""
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
