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
                    "metrics-port", "metrics-host", "group", "shards", "app", "tenants", "tenant-header",
                    "tenant"})
# The names 0.1 read these options from (its rule: ``OUTBOX_`` and the bare option
# name). They still work for one release, with a warning; delete this in the next.
RENAMED_IN_0_2 = {
    "OUTBOX_CONSOLE_READ_ONLY": "OUTBOX_READ_ONLY",
    "OUTBOX_CONSOLE_STUCK_AFTER": "OUTBOX_STUCK_AFTER",
    "OUTBOX_DEMO_CONSOLE": "OUTBOX_CONSOLE",
    "OUTBOX_DEMO_ORDERS": "OUTBOX_ORDERS",
    "OUTBOX_DEMO_PORT": "OUTBOX_PORT",
    "OUTBOX_DEMO_WORKDIR": "OUTBOX_WORKDIR",
    "OUTBOX_FAILED_TOPIC": "OUTBOX_TOPIC",
    "OUTBOX_INIT_DB_MAX_RECORD_BYTES": "OUTBOX_MAX_RECORD_BYTES",
    "OUTBOX_PARKED_KEY": "OUTBOX_KEY",
    "OUTBOX_PARKED_TOPIC": "OUTBOX_TOPIC",
    "OUTBOX_RELAY_BATCH_SIZE": "OUTBOX_BATCH_SIZE",
    "OUTBOX_RELAY_KEY_STUCK_AFTER": "OUTBOX_KEY_STUCK_AFTER",
    "OUTBOX_RELAY_LEASE_TTL": "OUTBOX_LEASE_TTL",
    "OUTBOX_RELAY_POLL_INTERVAL": "OUTBOX_POLL_INTERVAL",
    "OUTBOX_RELAY_WEBHOOK": "OUTBOX_WEBHOOK",
    "OUTBOX_RELAY_WORKER_ID": "OUTBOX_WORKER_ID",
    "OUTBOX_SPARK_ARCHIVE_DIR": "OUTBOX_ARCHIVE_DIR",
    "OUTBOX_SPARK_AS_OF": "OUTBOX_AS_OF",
    "OUTBOX_SPARK_BATCH": "OUTBOX_BATCH",
    "OUTBOX_SPARK_CHUNK_ROWS": "OUTBOX_CHUNK_ROWS",
    "OUTBOX_SPARK_DEDUP_WINDOW": "OUTBOX_DEDUP_WINDOW",
    "OUTBOX_SPARK_DELETE_BATCH": "OUTBOX_DELETE_BATCH",
    "OUTBOX_SPARK_KEY": "OUTBOX_KEY",
    "OUTBOX_SPARK_MASTER": "OUTBOX_MASTER",
    "OUTBOX_SPARK_OUT": "OUTBOX_OUT",
    "OUTBOX_SPARK_PARTITIONS": "OUTBOX_PARTITIONS",
    "OUTBOX_SPARK_RETENTION": "OUTBOX_RETENTION",
    "OUTBOX_SPARK_SHARED_STORAGE": "OUTBOX_SHARED_STORAGE",
    "OUTBOX_SPARK_SINCE": "OUTBOX_SINCE",
    "OUTBOX_SPARK_SLA": "OUTBOX_SLA",
    "OUTBOX_SPARK_TOPIC": "OUTBOX_TOPIC",
    "OUTBOX_SPARK_UNTIL": "OUTBOX_UNTIL",
    "OUTBOX_SPARK_WINDOW": "OUTBOX_WINDOW",
    "OUTBOX_STATUS_JSON": "OUTBOX_JSON",
    "OUTBOX_STATUS_STUCK_AFTER": "OUTBOX_STUCK_AFTER",
}
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

    Returns the (variable, deprecated variable) pairs of the command: 0.1 read
    namespaced options from the bare name (``OUTBOX_TOPIC``), which still works for
    one release, with a warning (``warn_deprecated``; ``RENAMED_IN_0_2``).
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
            variable = env_name(flag, namespace)
            old = RENAMED_IN_0_2.get(variable)
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
TENANTS = typer.Option(
    None, "--tenants", help="Serve many tenants: like:PATTERN (schemas of --db; % is the one wildcard), "
                            "file:PATH (JSON), query:SQL, or schema names separated by commas "
                            "(docs/tenants.md).")
TENANT_HEADER = typer.Option(
    None, "--tenant-header", help="The record header that names the tenant (docs/tenants.md).")
TENANT = typer.Option(None, "--tenant", help="Only this tenant (of --tenants).")
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
