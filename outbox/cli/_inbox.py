"""``outbox inbox run`` and ``outbox parked list|replay|discard``: the consumer and its runbook.

``inbox run`` imports your ``Inbox`` like ``uvicorn app:app`` imports an app.
``parked list`` and ``parked discard`` need only the database and the group;
``parked replay`` runs your handlers, so it takes the app too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from transports._logsafe import safe_logger

from ..core._gc import tune_gc_for_batches
from ..core._identity import tables_identity
from ..core._stopping import StopLatch, stop_signals
from ..core._terminal import stdout_console
from ..housekeeping import run_retention
from ..inbox import DiscardRefusedError, Inbox, NotParkedError, ParkedActions
from ..tenants import parse_tenants
from . import app
from ._db import existing_database, open_engine
from ._errors import Typer
from ._housekeeping import dedup_retention, every_seconds, retention_every_option, start_retention
from ._listing import json_option, print_json, print_table
from ._options import (
    BOOTSTRAP_SERVERS,
    BY,
    KAFKA_CONFIG,
    LOG_LEVEL,
    METRICS_HOST,
    PREFIX,
    REASON,
    SCHEMA,
    TENANT,
    TENANT_HEADER,
    TENANTS,
    configure_logging,
    operator,
    parse_kafka_config,
)

audit = safe_logger("outbox.cli.audit")

inbox_app = Typer(help="Run the consumer inbox.", no_args_is_help=True, env_namespace="inbox")
parked_app = Typer(help="Inspect, replay and discard parked messages.", no_args_is_help=True,
                   env_namespace="parked")
app.add_typer(inbox_app, name="inbox")
app.add_typer(parked_app, name="parked")

APP_HELP = "Your Inbox as MODULE:ATTRIBUTE, e.g. billing.consumer:inbox (imported like uvicorn's app)."


def load_inbox(target: str) -> Inbox:
    """Import ``MODULE:ATTRIBUTE`` and check that it is an ``Inbox``."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise typer.BadParameter(f"expected MODULE:ATTRIBUTE, got {target!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like uvicorn: the current directory is importable
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise typer.BadParameter(f"cannot import {target!r}: {exc}") from exc
    if not isinstance(found, Inbox):
        raise typer.BadParameter(f"{target!r} is a {type(found).__name__}, not an outbox.Inbox")
    existing_database(found.engine.url.render_as_string(hide_password=False))
    return found


def _inbox(db: str | None, group: str | None, target: str | None, prefix: str = "",
           schema: str | None = None, *, tenants: str | None = None, tenant_header: str | None = None,
           tenant: str | None = None) -> Inbox:
    """The app's ``Inbox`` (``--app``), or one on ``--db``/``--group``/``--prefix``/``--schema``.

    With ``--tenants`` (and ``--tenant-header``) it serves those tenants
    (``_serving``); ``--tenant`` needs tenants, from there or from the app.
    """
    if target:
        inbox = load_inbox(target)
        if group and group != inbox.group:
            raise typer.BadParameter(f"--group {group!r} differs from the app's group {inbox.group!r}")
        # Each option given (an empty --prefix is none) must name the app's tables, as the server says.
        if not _apps_tables(inbox, prefix, schema):
            raise typer.BadParameter("--prefix/--schema differ from the app's tables; the app's Inbox "
                                     "names its tables, so leave them out with --app")
    else:
        if not db or not group:
            raise typer.BadParameter("give --db and --group, or --app MODULE:ATTRIBUTE")
        inbox = Inbox(open_engine(db), group=group, prefix=prefix, schema=schema)
    _serving(inbox, tenants, tenant_header)
    if tenant is not None and inbox.router is None:
        raise typer.BadParameter("--tenant needs --tenants (or an app whose Inbox serves tenants)")
    return inbox


def _apps_tables(inbox: Inbox, prefix: str, schema: str | None) -> bool:
    """Whether ``--prefix``/``--schema`` (the app's where not given) name the app's tables as the server
    says (``tables_identity``, as the console compares an inbox's tables with its own), not as spelled:
    the default schema by name (``public``; ``main`` on SQLite) is an app's ``schema=None``, and SQLite
    (and MySQL/MariaDB with ``lower_case_table_names`` 1 or 2) take a schema's or table's name in any
    case. On PostgreSQL ``PUBLIC`` and ``OUT_`` stay other names: a name with capitals is sent quoted,
    so the server does not fold it."""
    own = inbox.tables
    given_prefix, given_schema = prefix or own.prefix, own.schema if schema is None else schema
    if (given_prefix, given_schema) == (own.prefix, own.schema):
        return True
    return bool(inbox.run_database(lambda: tables_identity(inbox.engine, given_schema, given_prefix)
                                   == tables_identity(inbox.engine, own.schema, own.prefix)))


def _serving(inbox: Inbox, tenants: str | None, tenant_header: str | None) -> None:
    """``--tenants SPEC --tenant-header NAME``: make ``inbox`` serve those tenants (docs/tenants.md).

    Without a header (listing and discarding need none), no message names a
    tenant: replaying one parked as ``tenant_unknown`` then says so.
    """
    if tenants is None:
        if tenant_header is not None and inbox.router is None:
            raise typer.BadParameter("--tenant-header needs --tenants")
        return
    if inbox.router is not None:
        raise typer.BadParameter("the app's Inbox serves tenants already: leave out --tenants")
    source = parse_tenants(tenants, inbox.engine)
    inbox.serve_tenants(source, tenant_header=tenant_header,
                        tenant_of=None if tenant_header is not None else _named_by_nothing)


def _named_by_nothing(message: object) -> None:
    """No ``--tenant-header``: the tenant of a message cannot be told."""
    return None


@inbox_app.command("run")
def run(
    target: str = typer.Argument(..., metavar="MODULE:ATTRIBUTE", help=APP_HELP),
    bootstrap_servers: str = BOOTSTRAP_SERVERS,
    group: str | None = typer.Option(None, help="Kafka consumer group id (default: the inbox's group)."),
    kafka_config: list[str] = KAFKA_CONFIG,
    metrics_port: int | None = typer.Option(
        None, help="Serve /metrics (Prometheus), /healthz and /readyz on this port."),
    metrics_host: str = METRICS_HOST,
    log_level: str = LOG_LEVEL,
    retention: str | None = typer.Option(
        None, "--retention", help="Also delete this group's dedup records whose message is older than "
                                  "this (at least the Inbox's dedup_window), on a thread of its own."),
    retention_every: str = retention_every_option(),
    tenants: str | None = TENANTS,
    tenant_header: str | None = TENANT_HEADER,
) -> None:
    """Consume the inbox's topics until SIGTERM/SIGINT, then commit and leave the group.

    How many keys run at once and how many messages one transaction carries
    are the app's Inbox(concurrency=..., batch_size=...): 8 and 500 unless it
    sets them (docs/consumer.md, "Choosing the settings").

    With ``--tenants`` and ``--tenant-header``, one consumer serves every
    tenant: each message is applied in the schema or database of the tenant
    its header names (docs/tenants.md).
    """
    configure_logging(log_level)
    from transports.kafka import KafkaSource

    latch = StopLatch()
    with stop_signals(latch):  # from here on a SIGTERM stops, even before inbox.run()
        every = every_seconds(retention_every)
        inbox = load_inbox(target)
        if tenants is not None and tenant_header is None and inbox.router is None:
            raise typer.BadParameter("--tenants needs --tenant-header, the header naming each record's "
                                     "tenant")
        _serving(inbox, tenants, tenant_header)
        latch.hand_to(inbox.stop)
        window = None if retention is None else dedup_retention(inbox, retention)
        source = KafkaSource(bootstrap_servers=bootstrap_servers, group_id=group or inbox.group,
                             topics=inbox.topics, settings=parse_kafka_config(kafka_config))
        if metrics_port is not None:
            from ..ops import inbox_readiness, serve_health

            serve_health(metrics_port, inbox_readiness(inbox.engine, source, inbox.run_database),
                         host=metrics_host)
        Console(stderr=True).print(f"inbox [bold]{escape(inbox.group)}[/bold] consuming "
                                   f"{escape(', '.join(inbox.topics))}")
        tune_gc_for_batches()
        housekeeper = None if window is None else start_retention(
            lambda stop: run_retention(inbox.engine, tables=inbox.tables, group=inbox.group,
                                       dedup_window=window, stop=stop), every)
        try:
            inbox.run(source)
        finally:
            if housekeeper is not None:
                housekeeper.stop()


DB = typer.Option(None, "--db", help="SQLAlchemy database URL of the inbox tables (or --app).")
GROUP = typer.Option(None, "--group", help="The inbox's consumer group.")
APP = typer.Option(None, "--app", help=APP_HELP)


@parked_app.command("list")
def list_parked(
    db: str | None = DB, group: str | None = GROUP, target: str | None = APP,
    topic: str | None = typer.Option(None, help="Only this topic."),
    key: str | None = typer.Option(None, help="Only this key."),
    prefix: str = PREFIX, schema: str | None = SCHEMA,
    tenants: str | None = TENANTS, tenant: str | None = TENANT,
    as_json: bool = json_option(),
    tsv: bool = typer.Option(False, "--tsv", help="One tab-separated line per message and a count line "
                                                 "(0.1's format, for existing scripts)."),
) -> None:
    """Show parked messages, per key in seq order, with why they were parked."""
    if as_json and tsv:
        raise typer.BadParameter("give --json or --tsv, not both")
    inbox = _inbox(db, group, target, prefix, schema, tenants=tenants, tenant=tenant)
    parked = ParkedActions(inbox, audit=audit, tenant=tenant).parked(topic, key)
    if as_json:
        print_json({"message_id": p.message_id, "topic": p.topic, "key": p.key, "seq": p.seq,
                    "reason": p.reason, "attempts": p.attempts, "first_failure_at": p.first_failure_at,
                    "last_failure_at": p.last_failure_at, "partition": p.partition, "offset": p.offset,
                    "error": p.error} for p in parked)
        return
    if tsv:
        for p in parked:
            typer.echo(f"{p.topic}\t{p.key or '-'}\tseq={p.seq if p.seq is not None else '-'}\t"
                       f"{p.reason}\tattempts={p.attempts}\t{p.last_failure_at:%Y-%m-%d %H:%M:%S}\t"
                       f"{p.message_id}\t{_first_line(p.error)}")
        typer.echo(f"{len(parked)} parked message(s)")
        return
    print_table(("topic", "key", "seq", "reason", "attempts", "last failure", "message id", "error"),
                ((p.topic, p.key, p.seq, p.reason, p.attempts, f"{p.last_failure_at:%Y-%m-%d %H:%M:%S}",
                  p.message_id, _first_line(p.error)) for p in parked),
                empty="no parked messages")
    stdout_console().print(f"{len(parked)} parked message(s)")


def _first_line(error: str | None) -> str:
    return error.splitlines()[0] if error else ""


@parked_app.command("replay")
def replay(
    topic: str | None = typer.Argument(None, help="The topic of the key to replay."),
    key: str | None = typer.Argument(None, help="Omit to replay the topic's unkeyed messages."),
    target: str = typer.Option(..., "--app", help=APP_HELP),
    group: str | None = GROUP,
    all_keys: bool = typer.Option(
        False, "--all", help="Replay every parked key of the group (of TOPIC, if given), one after "
                             "another; a key that fails again stays parked and the others go on."),
    by: str = BY, reason: str = REASON,
    log_level: str = LOG_LEVEL,
    tenants: str | None = TENANTS, tenant_header: str | None = TENANT_HEADER,
    tenant: str | None = TENANT,
) -> None:
    """Re-run a key's parked messages in seq order with the app's (fixed) handlers.

    ``--tenant``: the key of that tenant. Without it, on an inbox serving
    tenants, the key's messages parked as ``tenant_unknown`` go to their
    tenants (which must be served now).

    Who and why go to the ``outbox.cli.audit`` log with each key's outcome
    (``ParkedActions``, which the console's replay uses too).
    """
    configure_logging(log_level)
    who, why = operator(by, reason)
    if topic is None and not all_keys:
        raise typer.BadParameter("give TOPIC [KEY] to replay one key, or --all")
    if key is not None and all_keys:
        raise typer.BadParameter("give a KEY or --all, not both")
    inbox = _inbox(None, group, target, tenants=tenants, tenant_header=tenant_header, tenant=tenant)
    actions = ParkedActions(inbox, audit=audit, tenant=tenant)
    console = Console()
    if not all_keys:
        assert topic is not None
        result = actions.replay_key(topic, key, by=who, reason=why)
        console.print(f"applied {result.applied}, still parked {result.remaining}")
        console.print(f"replayed by {who}: {why}", markup=False)
        if not result.unparked:
            console.print(f"[red]stopped: {escape(str(result.error))}[/red]")
            raise typer.Exit(1)
        console.print(f"[green]key {escape(repr(key))} unparked[/green]" if key is not None
                      else "[green]no unkeyed message left parked[/green]")
        return
    # Each key is its own replay: one that fails again must not keep the others parked.
    replayed = actions.replay(actions.lanes(topic), by=who, reason=why)
    stopped = 0
    for done in replayed:
        name = escape(done.name)
        if done.result is None:
            console.print(f"{name}: nothing parked any more (replayed or discarded meanwhile)")
        elif done.result.unparked:
            console.print(f"{name}: applied {done.result.applied}, [green]unparked[/green]")
        else:
            stopped += 1
            console.print(f"{name}: applied {done.result.applied}, still parked {done.result.remaining}: "
                          f"[red]{escape(str(done.result.error))}[/red]")
    console.print(f"{len(replayed) - stopped} of {len(replayed)} key(s) unparked")
    console.print(f"replayed by {who}: {why}", markup=False)
    if stopped:
        raise typer.Exit(1)


@parked_app.command("discard")
def discard(
    message_id: str = typer.Argument(
        ..., help="Id (UUID) of the parked message, as `outbox parked list` shows it."),
    by: str = typer.Option(..., help="Who discards it (kept with the record)."),
    reason: str = typer.Option(..., help="Why (kept with the record)."),
    db: str | None = DB, group: str | None = GROUP, target: str | None = APP,
    prefix: str = PREFIX, schema: str | None = SCHEMA,
    tenants: str | None = TENANTS, tenant: str | None = TENANT,
) -> None:
    """Skip one parked message for good; its key moves on past it (``--tenant``: in that tenant)."""
    inbox = _inbox(db, group, target, prefix, schema, tenants=tenants, tenant=tenant)
    try:
        ParkedActions(inbox, audit=audit, tenant=tenant).discard(message_id, by=by, reason=reason)
    except (NotParkedError, DiscardRefusedError):
        raise  # the state of the key forbids it now: exit 1 (see _errors)
    except ValueError as exc:  # a malformed id, an empty --by or --reason
        raise typer.BadParameter(str(exc)) from None
    Console().print(f"discarded {message_id}; run `outbox parked replay` for the rest of its key")
