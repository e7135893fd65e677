"""``outbox spark audit|archive|replay|warm-up``: the Spark jobs from a shell or a CI step.

Exit codes: 0 all well, 1 the audit found lost or out-of-order messages (so a
pipeline can gate on it) or a job failed, 2 bad input. PySpark is imported
only when a command runs, so the rest of the CLI works without the ``spark``
extra. Only the report goes to stdout; progress and errors go to stderr, which
under ``spark-submit`` means the JVM's stderr (spark-submit pipes the Python
process's stdout and stderr into its own stdout).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from ..core._errors import ConfigurationError, OutboxError
from . import app
from ._errors import Typer
from ._options import PREFIX, SCHEMA

spark_app = Typer(help="Spark jobs over the outbox and inbox: audit, archive, replay; "
                       "warm-up writes the driver's class archive.",
                  no_args_is_help=True, env_namespace="spark")
app.add_typer(spark_app, name="spark")


class _JvmStderr:
    """A text stream onto spark-submit's stderr, through the JVM that started this process."""

    def write(self, text: str) -> int:
        from pyspark import SparkContext

        SparkContext._ensure_initialized()  # connects to spark-submit's gateway; starts nothing
        assert SparkContext._jvm is not None
        SparkContext._jvm.System.err.print(text)
        return len(text)

    def flush(self) -> None:
        from pyspark import SparkContext

        if SparkContext._jvm is not None:
            SparkContext._jvm.System.err.flush()


def _stderr_console() -> Console:
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        return Console(file=_JvmStderr(), force_terminal=False)  # type: ignore[arg-type]
    return Console(stderr=True)


console = _stderr_console()

MASTER = typer.Option(None, help="Spark master; default: spark-submit's, else local[*].")
SHARED = typer.Option(False, "--shared-storage",
                      help="Declare the path mounted at the same place on every node (needed "
                           "on a non-local master).")
LOG_LEVEL = typer.Option("WARN", help="Spark's log level: ERROR, WARN, INFO or DEBUG "
                                      "(INFO and DEBUG also show the JVM's start-up notices).")
KEYS = typer.Option(None, help="Replay only this key (repeat for more).")


def _jobs() -> Any:
    try:
        import outbox.spark as jobs
    except ImportError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)  # "[spark]" stays
        raise typer.Exit(2) from None
    return jobs


@contextmanager
def _progress(total: bool) -> Iterator[Callable[..., None]]:
    """A live progress line; the callback takes (description[, done, total])."""
    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("checking arguments", total=None)

        def update(description: str, done: int | None = None, of: int | None = None) -> None:
            bar.update(task, description=description, completed=done or 0, total=of)

        try:
            yield update
        except OutboxError as exc:  # named by the job: no traceback
            bar.stop()
            console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2 if isinstance(exc, ConfigurationError) else 1) from None


def _session(master: str | None, log_level: str) -> Callable[[], Any]:
    """Build the session only when the job asks for it, after its arguments and tables are checked.

    No web UI: the command's process, and with it the UI, ends with the job;
    starting it costs about a second. Nor the ``outbox_table`` data source,
    which the jobs do not read through (registering it costs two).
    """
    return lambda: _jobs().spark_session(master, log_level=log_level, data_source=False,
                                         config={"spark.ui.enabled": "false"})


def _wire(jobs: Any, bootstrap: str | None, topics: list[str] | None, options: list[str] | None,
          exactly_once: bool) -> Any:
    """The ``Wire`` the --wire-* options describe, None without --wire-bootstrap."""
    if bootstrap is None:
        if topics or options or exactly_once:
            raise ConfigurationError("--wire-topic, --wire-option and --wire-exactly-once need "
                                     "--wire-bootstrap (the Kafka cluster to read)")
        return None
    settings: dict[str, str] = {}
    for option in options or []:
        name, equals, value = option.partition("=")
        if not equals or not name.strip():
            raise ConfigurationError(f"--wire-option takes NAME=VALUE, got {option.split('=')[0]!r}")
        settings[name.strip()] = value
    return jobs.Wire(bootstrap, topics=tuple(topics or ()), options=settings,
                     exactly_once=exactly_once)


@spark_app.command("audit")
def audit_command(
    outbox_db: str = typer.Option(..., help="SQLAlchemy URL of the producer database."),
    inbox_db: str | None = typer.Option(None, help="URL of the consumer database (default: outbox-db)."),
    out: str = typer.Option("outbox-audit", help="Output directory (summary, report, chart, Parquet)."),
    window: str | None = typer.Option(None, help="Messages created in the last DURATION (24h, 7d)."),
    since: str | None = typer.Option(None, help="Window start, ISO-8601 (with --until)."),
    until: str | None = typer.Option(None, help="Window end, ISO-8601 (default: now)."),
    sla: str = typer.Option("15m", help="A published message not consumed after this is lost."),
    group: str | None = typer.Option(None, help="Audit only this consumer group."),
    event_type: str | None = typer.Option(None, help="Audit only the messages of this event type."),
    as_of: str | None = typer.Option(None, help="Audit as if it were this ISO-8601 time (default: now)."),
    partitions: int | None = typer.Option(None, help="Read partitions per table = DB connections."),
    master: str | None = MASTER,
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    shared_storage: bool = SHARED,
    log_level: str = LOG_LEVEL,
    wire_bootstrap: str | None = typer.Option(
        None, help="Also read the topics themselves (read_committed) from this Kafka cluster, "
                   "host:port[,host:port]: missing, duplicated, reordered, foreign records."),
    wire_topic: list[str] | None = typer.Option(
        None, help="Topic to read with --wire-bootstrap (repeat for more; default: every topic "
                   "of the audited outbox rows)."),
    wire_option: list[str] | None = typer.Option(
        None, help="Kafka consumer setting for the wire read, NAME=VALUE (security.protocol, "
                   "sasl.jaas.config …; repeat for more)."),
    wire_exactly_once: bool = typer.Option(
        False, "--wire-exactly-once", help="A duplicate on the wire fails the audit (the relay "
                                           "runs --exactly-once)."),
) -> None:
    """Compare outbox and inbox (and the topics, with --wire-bootstrap); exit 1 when any
    message is lost or out of order."""
    jobs = _jobs()
    if window is not None and (since or until):
        console.print("[red]error:[/red] give either --window or --since/--until")
        raise typer.Exit(2)
    span: Any = window
    if since or until:
        span = (since or "1970-01-01T00:00:00Z", until or as_of or datetime.now(UTC).isoformat())
    with _progress(total=False) as step:
        wire = _wire(jobs, wire_bootstrap, wire_topic, wire_option, wire_exactly_once)
        result = jobs.audit(outbox_db, inbox_db, out_dir=out, window=span, sla=sla, group=group,
                            event_type=event_type, as_of=as_of, partitions=partitions,
                            spark=_session(master, log_level),
                            prefix=prefix, schema=schema, progress=step,
                            shared_storage=shared_storage, wire=wire)
        step("done")
    print(result.path("report.md").read_text())
    if not result.ok:
        raise typer.Exit(1)


@spark_app.command("archive")
def archive_command(
    db: str = typer.Option(..., help="SQLAlchemy URL of the outbox database."),
    archive_dir: str = typer.Option(..., help="Archive root (shared by all Spark executors)."),
    retention: str = typer.Option(..., help="Archive published rows created longer ago than this (30d)."),
    inbox_db: str | None = typer.Option(None, help="Inbox database URL (default: --db)."),
    dedup_window: str | None = typer.Option(None, help="Also archive inbox rows processed longer ago."),
    chunk_rows: int = typer.Option(50_000, help="Rows per chunk (one Spark task, one commit)."),
    delete_batch: int = typer.Option(1_000, help="Rows deleted per database transaction."),
    master: str | None = MASTER,
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    shared_storage: bool = SHARED,
    log_level: str = LOG_LEVEL,
) -> None:
    """Move old rows to Parquet, then delete them; safe to kill and re-run."""
    jobs = _jobs()
    with _progress(total=True) as step:
        result = jobs.archive(db, archive_dir, retention=retention, inbox_url=inbox_db,
                              dedup_window=dedup_window, chunk_rows=chunk_rows,
                              delete_batch=delete_batch, spark=_session(master, log_level),
                              prefix=prefix, schema=schema, progress=step,
                              shared_storage=shared_storage)
    for table, rows in result.archived.items():
        print(f"{table}: archived {rows:,}, deleted {result.deleted[table]:,}")
    if result.recovered_chunks or result.debris_removed:
        print(f"finished {result.recovered_chunks} chunk(s) of an interrupted run, "
              f"removed {result.debris_removed} uncommitted file(s)")


@spark_app.command("replay")
def replay_command(
    archive_dir: str = typer.Option(..., help="Archive root written by `outbox spark archive`."),
    db: str = typer.Option(..., help="SQLAlchemy URL of the outbox database to publish into."),
    topic: str = typer.Option(..., help="Topic to replay."),
    key: list[str] | None = KEYS,
    since: str | None = typer.Option(None, help="Only messages created at or after, ISO-8601."),
    until: str | None = typer.Option(None, help="Only messages created before, ISO-8601."),
    batch: int = typer.Option(500, help="Messages per transaction."),
    master: str | None = MASTER,
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    shared_storage: bool = SHARED,
    log_level: str = LOG_LEVEL,
) -> None:
    """Publish archived messages again as new messages, each key in its original order."""
    jobs = _jobs()
    with _progress(total=False) as step:
        result = jobs.replay(archive_dir, db, topic=topic, keys=key or None, since=since, until=until,
                             batch=batch, spark=_session(master, log_level), prefix=prefix,
                             schema=schema, progress=lambda n: step(f"replayed {n:,}"),
                             shared_storage=shared_storage)
    print(f"replayed {result.replayed:,} message(s) of {topic} "
          f"({len(result.per_key)} key(s)) with header {jobs.REPLAY_HEADER!r}")


@spark_app.command("warm-up")
def warm_up_command(
    force: bool = typer.Option(False, "--force", help="Write a new archive even if one is in place."),
    log_level: str = LOG_LEVEL,
) -> None:
    """Write the driver JVM's class archive, so later commands start Spark in about half the time.

    Run once per installation or upgrade (in a Dockerfile: RUN outbox spark warm-up);
    takes about a minute and ~190 MB in OUTBOX_SPARK_CLASS_CACHE.
    """
    _jobs()
    from outbox.spark._warmup import warm_up

    with _progress(total=False) as step:
        archive, written = warm_up(force=force, log_level=log_level, progress=step)
        step("done")
    size = archive.stat().st_size / 1e6
    if written:
        console.print(f"class archive written: {archive} ({size:.0f} MB)", soft_wrap=True, markup=False)
    else:
        console.print(f"class archive already in place: {archive} ({size:.0f} MB); "
                      "--force writes a new one", soft_wrap=True, markup=False)
