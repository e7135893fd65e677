"""``outbox relay``, ``outbox failed list|retry|skip`` and ``outbox stats``."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from transports._logsafe import safe_logger

from ..core._alerts import LoggingAlertSink, WebhookAlertSink
from ..core._cloudevents import CloudEvents
from ..core._errors import ConfigurationError
from ..core._gc import tune_gc_for_batches
from ..core._outage import OutageBackoff, OutageTracker, OutageWording, is_database_outage
from ..core._stopping import StopLatch, stop_signals
from ..core._tenant import TenantShare
from ..core._terminal import stdout_console
from ..housekeeping import parse_period, run_retention
from ..producer import Outbox
from ..relay import (
    DEFAULT_MAX_SHARD_PRODUCERS,
    MOST_SHARD_PRODUCERS,
    backlog,
    failed_rows,
    retry_failed,
    skip_failed,
)
from ..relay._exactly_once import DEFAULT_PROGRESS_TOPIC
from ..relay._progress import largest_batch
from ..relay._settings import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_BYTES, MAX_MAX_BATCH_BYTES
from . import app
from ._db import open_outbox, pooled_options
from ._errors import Typer, database_name, hidden
from ._housekeeping import every_seconds, retention_every_option, start_retention
from ._listing import json_option, print_json, print_table
from ._options import (
    BOOTSTRAP_SERVERS,
    BY,
    DB,
    KAFKA_CONFIG,
    LOG_LEVEL,
    METRICS_HOST,
    PREFIX,
    REASON,
    SCHEMA,
    TENANT_HEADER,
    TENANTS,
    configure_logging,
    operator,
    parse_kafka_config,
)

TOPIC = typer.Option(None, help="Only this topic.")

log = safe_logger("outbox.relay")

failed_app = Typer(help="Rows that failed permanently and block their key.", no_args_is_help=True,
                   env_namespace="failed")
app.add_typer(failed_app, name="failed")


@app.command("relay")
def relay(
    db: str = DB,
    bootstrap_servers: str = BOOTSTRAP_SERVERS,
    kafka_config: list[str] = KAFKA_CONFIG,
    metrics_port: int | None = typer.Option(
        None, help="Serve /metrics (Prometheus), /healthz and /readyz on this port."),
    metrics_host: str = METRICS_HOST,
    worker_id: str | None = typer.Option(None, help="Unique name of this relay (default: host-pid-random)."),
    batch_size: int | None = typer.Option(
        None, help="Rows per batch (default 5000; 1000 with --tenants)."),
    max_batch_bytes: int = typer.Option(
        DEFAULT_MAX_BATCH_BYTES, min=1, max=MAX_MAX_BATCH_BYTES,
        help="Bytes of payload and headers per batch, plus one row (default 64 MiB)."),
    lease_ttl: float | None = typer.Option(
        None, help="Seconds a shard lease lasts without renewal (default 10; 30 with --tenants)."),
    poll_interval: float | None = typer.Option(
        None, help="Seconds between polls when nothing wakes the relay (default 0.5; 5 per tenant with "
                   "--tenants)."),
    shards: int | None = typer.Option(
        None, help="Expected shard count; the database's is used, and another is an error."),
    webhook: str | None = typer.Option(None, help="POST alerts as JSON to this URL (default: log them)."),
    key_stuck_after: float = typer.Option(
        300.0, min=0.001, help="Seconds a key's head may keep being retried before one key_stuck alert."),
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    log_level: str = LOG_LEVEL,
    retention: str | None = typer.Option(
        None, "--retention", help="Also delete published rows older than this (e.g. 7d), on a thread of "
                                  "its own (docs/operations.md, 'Housekeeping')."),
    retention_every: str = retention_every_option(),
    cloudevents: bool = typer.Option(
        False, "--cloudevents", help="Also send the CloudEvents binary-mode ce_* headers "
                                     "(docs/cloudevents.md)."),
    cloudevents_source: str | None = typer.Option(
        None, help="The ce_source of every record (a URI-reference; default outbox://<database "
                   "incarnation>); implies --cloudevents."),
    exactly_once: bool = typer.Option(
        False, "--exactly-once", help="Each shard's batch one Kafka transaction: no crash or zombie relay "
                                      "sends a record twice to read_committed consumers (docs/relay.md)."),
    delivery_timeout: float = typer.Option(
        30.0, min=1.0, max=3600.0,
        help="Seconds the relay waits for the broker to take a batch (with --exactly-once: a transaction) "
             "before it gives it up and sends it again: raise it for a broker slower than that "
             "(docs/relay.md)."),
    progress_topic: str = typer.Option(
        DEFAULT_PROGRESS_TOPIC, help="With --exactly-once: the compacted topic of the shards' progress "
                                     "records (created if missing)."),
    tenants: str | None = TENANTS,
    tenant_header: str | None = TENANT_HEADER,
    workers: int = typer.Option(
        8, min=1, max=64, help="With --tenants: worker threads, each with two connections of the pool "
                               "(docs/tenants.md)."),
    producers: int = typer.Option(
        2, min=1, max=64, help="With --tenants: Kafka producers the workers share, one publish at a "
                               "time each; more are made, up to one per worker, while the broker holds "
                               "every one (docs/tenants.md)."),
    max_shard_producers: int | None = typer.Option(
        None, min=1, max=MOST_SHARD_PRODUCERS,
        help=f"With --tenants --exactly-once: shard producers open at once, at most (default "
             f"{DEFAULT_MAX_SHARD_PRODUCERS}); a shard beyond them waits its turn (docs/tenants.md)."),
    tenant_share: str | None = typer.Option(
        None, metavar="K/N",
        help="With --tenants: serve share K (0 to N-1) of N processes' tenants, each tenant in one "
             "process by its name; without it every process serves a part of every tenant's shards "
             "(docs/tenants.md)."),
    tenant_labels: int = typer.Option(
        100, min=0, help="With --tenants: the first this many tenants label metrics by name, later ones "
                         "share the label _other; 0: no tenant label (docs/tenants.md)."),
    transaction_pooled: bool = typer.Option(
        False, "--transaction-pooled", help="PostgreSQL is reached through a pooler in transaction mode "
                                            "(PgBouncer's): set the fetch's settings per transaction, never "
                                            "on a session the pooler hands to other clients, and prepare "
                                            "no statement (docs/operations.md)."),
) -> None:
    """Publish outbox rows to Kafka until SIGTERM/SIGINT, then drain and exit 0."""
    from transports.kafka import KafkaTransport

    from ..ops import relay_readiness, serve_health
    from ..relay import Relay, refuse_smaller_producer, relay_metrics

    configure_logging(log_level)
    settings = parse_kafka_config(kafka_config)
    cloudevents_mode = (CloudEvents(source=cloudevents_source)
                        if cloudevents or cloudevents_source is not None else None)
    retention_period = None if retention is None else parse_period(retention, "retention")
    every = every_seconds(retention_every)
    if batch_size is None and exactly_once:
        # The default is the library's choice: one that fits the progress record under a
        # lowered message.max.bytes, rather than a refusal of a setting nobody gave.
        fits = largest_batch(KafkaTransport.max_record_bytes_for(settings))
        default = FLEET_BATCH_SIZE if tenants is not None else DEFAULT_BATCH_SIZE
        batch_size = max(1, min(default, fits)) if fits < default else None
    if max_shard_producers is not None and (tenants is None or not exactly_once):
        # The single relay keeps one producer per shard it owns; only a fleet's are shared and capped.
        raise typer.BadParameter("caps a tenant fleet's transactional producers: it needs --tenants and "
                                 "--exactly-once", param_hint="--max-shard-producers")
    share = _tenant_share(tenant_share, tenants)
    if tenants is not None:
        if schema is not None:
            raise typer.BadParameter("--tenants names the schemas; leave --schema out", param_hint="--schema")
        capped = {} if max_shard_producers is None else {"max_shard_producers": max_shard_producers}
        _relay_tenants(
            db, tenants, tenant_header, settings, bootstrap_servers, workers=workers, producers=producers,
            prefix=prefix,
            worker_id=worker_id, batch_size=FLEET_BATCH_SIZE if batch_size is None else batch_size,
            max_batch_bytes=max_batch_bytes,
            lease_ttl=FLEET_LEASE_TTL if lease_ttl is None else lease_ttl,
            poll_interval=FLEET_POLL_INTERVAL if poll_interval is None else poll_interval,
            webhook=webhook, key_stuck_after=key_stuck_after, cloudevents=cloudevents_mode or False,
            metrics_port=metrics_port, metrics_host=metrics_host, retention=retention_period, every=every,
            tenant_labels=tenant_labels, exactly_once=exactly_once, progress_topic=progress_topic,
            transaction_pooled=transaction_pooled, delivery_timeout=delivery_timeout, share=share, **capped)
        return
    elif tenant_header is not None:
        raise typer.BadParameter("a tenant header needs --tenants", param_hint="--tenant-header")
    latch = StopLatch()
    with stop_signals(latch):
        outbox = open_outbox(db, prefix, schema, shards, check=False, transaction_pooled=transaction_pooled)
        if not _wait_for_tables(outbox, latch.asked):
            return  # stopped before the database ever answered
        # Refused before the producer exists: it would start connecting, and logging, at once.
        refuse_smaller_producer(KafkaTransport.max_record_bytes_for(settings),
                                KafkaTransport.max_record_setting_for(settings),
                                outbox.load_schema().max_record_bytes)
        transport = KafkaTransport(settings, bootstrap_servers=bootstrap_servers,
                                   delivery_timeout=delivery_timeout)
        worker = Relay(
            outbox, transport, worker_id=worker_id,
            batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            max_batch_bytes=max_batch_bytes, lease_ttl=10.0 if lease_ttl is None else lease_ttl,
            poll_interval=0.5 if poll_interval is None else poll_interval,
            alert=WebhookAlertSink(webhook) if webhook else LoggingAlertSink(),
            backlog_metrics=metrics_port is not None, key_stuck_after=key_stuck_after,
            cloudevents=cloudevents_mode or False, exactly_once=exactly_once, progress_topic=progress_topic,
        )
        latch.hand_to(worker.stop)
        if metrics_port is not None:
            relay_metrics()  # registered before the first scrape
            serve_health(metrics_port, relay_readiness(worker), host=metrics_host)
        tune_gc_for_batches()
        housekeeper = None if retention_period is None else start_retention(
            lambda stop: run_retention(outbox, older_than=retention_period, stop=stop), every)
        try:
            worker.run()
        finally:
            if housekeeper is not None:
                housekeeper.stop()
            transport.close(1.0)  # nothing is outstanding after run(), unless a stuck batch was left behind


def _tenant_share(text: str | None, tenants: str | None) -> TenantShare | None:
    """``--tenant-share``'s share, refused without ``--tenants`` or when not K/N."""
    if text is None:
        return None
    if tenants is None:
        raise typer.BadParameter("shares a tenant fleet among processes: it needs --tenants",
                                 param_hint="--tenant-share")
    try:
        return TenantShare.parse(text)
    except ConfigurationError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tenant-share") from None


FLEET_LEASE_TTL = 30.0
"""A --tenants relay's lease TTL: one process renews every tenant's leases, each in its turn."""
FLEET_BATCH_SIZE = 1000
"""A --tenants relay's batch size: its workers serve tenants a batch at a time, in turns; a
larger batch would hold a worker longer from the others (one relay: ``DEFAULT_BATCH_SIZE``)."""
FLEET_POLL_INTERVAL = 5.0
"""A --tenants relay polls each tenant this often: notifications wake them (PostgreSQL); a poll of
500 tenants every 0.5 s would be 1,000 fetches a second of nothing."""

TENANT_HEADER_ROOM = 256
"""Bytes a --tenants relay's producer allows above the default record limit, for the tenant header."""


def _relay_tenants(db: str, spec: str, tenant_header: str | None, settings: dict[str, str],
                   bootstrap_servers: str, *, workers: int, producers: int, prefix: str, webhook: str | None,
                   metrics_port: int | None, metrics_host: str, retention: timedelta | None, every: float,
                   tenant_labels: int, transaction_pooled: bool, delivery_timeout: float,
                   share: TenantShare | None, **tuning: Any) -> None:
    """``outbox relay --tenants``: one ``TenantRelay`` for every tenant of ``spec`` (docs/tenants.md).

    Unless ``message.max.bytes`` is given, the producers allow the default
    record limit plus room for the tenant header, so tenants whose tables keep
    the default limit can be served with a header.
    """
    from transports.kafka import KafkaTransport
    from transports.kafka._settings import sets_property

    from ..core._engine import create_engine
    from ..housekeeping import tenant_retention_pass
    from ..ops import serve_health, tenant_relay_readiness
    from ..relay import relay_metrics, tenant_relay_metrics
    from ..tenants import (
        TenantLabels,
        TenantRelay,
        fleet_kafka_settings,
        parse_tenants,
        shared,
        tune_switch_interval,
    )

    settings = fleet_kafka_settings(settings)
    if tenant_header is not None and not sets_property(settings, "message.max.bytes"):
        limit = KafkaTransport.max_record_bytes_for(settings) + TENANT_HEADER_ROOM
        settings = {**settings, "message.max.bytes": str(limit)}
    latch = StopLatch()
    with stop_signals(latch):
        # A worker's fetch and its writer's write may each hold a connection (TenantRelay's default).
        engine = create_engine(db, pool_size=2 * workers + 2, max_overflow=0,
                               **pooled_options(db, transaction_pooled))
        def producer() -> KafkaTransport:
            return KafkaTransport(settings, bootstrap_servers=bootstrap_servers,
                                  delivery_timeout=delivery_timeout)
        fleet = TenantRelay(
            parse_tenants(spec, engine), producer, share=share, database=engine, workers=workers,
            producers=producers,
            tenant_header=tenant_header, prefix=prefix,
            metrics=tenant_relay_metrics(TenantLabels(tenant_labels) if tenant_labels else None),
            alert=WebhookAlertSink(webhook) if webhook else LoggingAlertSink(),
            transaction_pooled=transaction_pooled, **tuning)
        latch.hand_to(fleet.stop)
        if metrics_port is not None:
            relay_metrics()
            serve_health(metrics_port, tenant_relay_readiness(fleet), host=metrics_host)
        tune_gc_for_batches()
        tune_switch_interval()  # a quiet tenant's thread gets the lock back from a backlog's in 1 ms, not 5
        housekeeper = None if retention is None else start_retention(
            tenant_retention_pass(fleet.source if share is None else shared(fleet.source, share), engine,
                                  prefix=prefix, older_than=retention), every)
        try:
            fleet.run()
        finally:
            if housekeeper is not None:
                housekeeper.stop()
            fleet.close()
            engine.dispose()


def _wait_for_tables(outbox: Outbox, stop: threading.Event) -> bool:
    """Check the tables, waiting for a database that does not answer yet; False if stopped first.

    The relay's rule, from start-up on: an unreachable database may come back,
    so it is waited out (one line when it starts, one when it ends), as
    ``Relay.run`` and ``outbox inbox run`` do; what can never work (no tables,
    a wrong prefix or schema) is an error at once. ``stop`` (SIGTERM/SIGINT) ends the wait.
    """
    database = OutageTracker(
        f"database {database_name()}", log=log, backoff=OutageBackoff(first=0.2),
        wording=OutageWording(down="%s unreachable (%s); waiting for it before starting "
                                   "(check --db if this persists)",
                              up="%s reachable again after %.1f s; starting"),
        detail=lambda exc: hidden(str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]))
    while not stop.is_set():
        try:
            outbox.load_schema()
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            stop.wait(database.failed(exc))
        else:
            database.answered()
            return True
    return False


@failed_app.command("list")
def failed_list(db: str = DB, topic: str | None = TOPIC, prefix: str = PREFIX,
                schema: str | None = SCHEMA, as_json: bool = json_option()) -> None:
    """Show failed rows, oldest first (the first 1000; the last line says when there are more)."""
    found = failed_rows(open_outbox(db, prefix, schema), topic=topic, limit=FAILED_PAGE + 1)
    more, found = len(found) > FAILED_PAGE, found[:FAILED_PAGE]
    if as_json:
        print_json({"message_id": r.message_id, "topic": r.topic, "key": r.key, "seq": r.seq,
                    "attempts": r.attempts, "last_error": r.last_error, "created_at": r.created_at}
                   for r in found)
    else:
        print_table(("message id", "topic", "key", "seq", "attempts", "error", "created"),
                    ((r.message_id, r.topic, r.key, r.seq, r.attempts, (r.last_error or "")[:80],
                      f"{r.created_at:%Y-%m-%d %H:%M:%S}") for r in found),
                    empty="no failed rows")
    if more:
        typer.echo(f"more than {FAILED_PAGE} failed rows; the first {FAILED_PAGE} are shown "
                   "(narrow with --topic)", err=True)


FAILED_PAGE = 1000


def _ids_or_all(message_ids: list[str], all_: bool) -> list[str] | None:
    if bool(message_ids) == all_:
        raise typer.BadParameter("give message ids or --all (not both)")
    return None if all_ else message_ids


@failed_app.command("retry")
def failed_retry(message_ids: list[str] = typer.Argument(None, help="Message ids (UUIDs) of failed rows."),
                 all_: bool = typer.Option(False, "--all", help="Every failed row (of --topic, if given)."),
                 by: str = BY, reason: str = REASON,
                 db: str = DB, topic: str | None = TOPIC, prefix: str = PREFIX,
                 schema: str | None = SCHEMA) -> None:
    """Send failed rows again, in their place in their key's order; the rows keep who and why."""
    who, why = operator(by, reason)
    count = retry_failed(open_outbox(db, prefix, schema), _ids_or_all(message_ids or [], all_), topic=topic,
                         by=who, reason=why)
    Console().print(f"{count} row(s) pending again (retried by {who}: {why})", markup=False)


@failed_app.command("skip")
def failed_skip(message_ids: list[str] = typer.Argument(None, help="Message ids (UUIDs) of failed rows."),
                all_: bool = typer.Option(False, "--all", help="Every failed row (of --topic, if given)."),
                by: str = BY, reason: str = REASON,
                db: str = DB, topic: str | None = TOPIC, prefix: str = PREFIX,
                schema: str | None = SCHEMA) -> None:
    """Never send these failed rows; their keys' later rows flow again; the rows keep who and why."""
    who, why = operator(by, reason)
    count = skip_failed(open_outbox(db, prefix, schema), _ids_or_all(message_ids or [], all_), topic=topic,
                        by=who, reason=why)
    Console().print(f"{count} row(s) skipped (by {who}: {why})", markup=False)


@app.command("stats")
def stats(db: str = DB, prefix: str = PREFIX, schema: str | None = SCHEMA,
          as_json: bool = json_option()) -> None:
    """Backlog per topic and shard: pending, failed, oldest pending age."""
    rows = backlog(open_outbox(db, prefix, schema))
    if as_json:
        print_json({"topic": r.topic, "shard": r.shard, "pending": r.pending, "failed": r.failed,
                    "oldest_pending": r.oldest_pending} for r in rows)
        return
    now = datetime.now(UTC)
    table = Table("topic", "shard", "pending", "failed", "oldest pending age")
    for row in rows:
        age = f"{(now - row.oldest_pending).total_seconds():.1f} s" if row.oldest_pending else ""
        table.add_row(Text(row.topic), str(row.shard), str(row.pending), str(row.failed), age)
    table.add_section()
    table.add_row("total", "", str(sum(r.pending for r in rows)), str(sum(r.failed for r in rows)), "")
    stdout_console().print(table)
