"""``audit``: does every message the outbox produced reach every consumer group, once and in order?

Reads the outbox (producer database) and the inbox tables (consumer database,
which may be a different one), compares them in Spark and writes, into
``out_dir``: ``summary.json``, ``report.md``, ``chart.png`` and one Parquet
dataset per finding (``lost/``, ``duplicates/``, ``out_of_order/``) listing
every message concerned. Given a ``Wire``, it also reads the topics themselves
(``_wire``) and adds ``wire_missing/``, ``wire_duplicates/``,
``wire_out_of_order/`` and ``wire_foreign/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from ..core._envelope import utcnow
from ..core._errors import ConfigurationError, OutboxError
from ..core._validation import checked_event_type
from . import _findings as find
from . import _wire as wire_audit
from . import _wire_findings as wire_find
from ._chart import draw_chart, preload_matplotlib
from ._report import build_summary, wire_summary, write_report
from ._session import SessionFactory, session_from
from ._source import estimate_rows, portable_url, read_table
from ._storage import local_path, require_shared, uri
from ._tablemap import check_table, table_for
from ._window import Window, parse_duration, parse_instant
from ._wire import Wire

OUTBOX_COLUMNS = ["message_id", "topic", "key", "seq", "status", "created_at", "published_at", "event_type"]

DETAILS = ("lost", "duplicates", "out_of_order")
INBOX_TABLES = ("inbox_messages", "inbox_parked", "inbox_held")
# Up to this many outbox rows, generating and compiling Java code for each
# stage (whole-stage codegen) costs more than it saves: seconds per stage kind.
SMALL_INPUT = 100_000


class AuditOutputError(OutboxError, RuntimeError):
    """What the executors wrote is not where the driver reads it (out_dir not shared)."""


@dataclass(frozen=True)
class AuditResult:
    """What the audit found; ``ok`` is False when any message is lost or out of order (or, with a
    ``Wire``, missing or out of order on the topic, or duplicated there under ``exactly_once``)."""

    summary: dict[str, Any]
    out_dir: Path

    @property
    def ok(self) -> bool:
        return bool(self.summary["ok"])

    @property
    def totals(self) -> dict[str, int]:
        totals: dict[str, int] = self.summary["totals"]
        return totals

    def path(self, name: str) -> Path:
        """Where an output lives: ``"lost"``, ``"summary.json"``, ``"chart.png"`` …"""
        return self.out_dir / name


def audit(
    outbox_url: str,
    inbox_url: str | None = None,
    *,
    out_dir: str | Path,
    window: Window | timedelta | str | tuple[Any, Any] | None = None,
    sla: timedelta | str | float = "15m",
    group: str | None = None,
    event_type: str | None = None,
    as_of: datetime | str | None = None,
    spark: SparkSession | SessionFactory | None = None,
    partitions: int | None = None,
    prefix: str = "",
    schema: str | None = None,
    progress: Callable[[str], None] | None = None,
    shared_storage: bool = False,
    wire: Wire | None = None,
) -> AuditResult:
    """Audit the messages created in ``window`` against what each consumer group did.

    ``inbox_url`` defaults to ``outbox_url`` (both sides in one database).
    ``window`` is a duration back from ``as_of`` ("24h"), a (since, until)
    pair or None for everything. A message is *lost* for a group when it was
    published more than ``sla`` before ``as_of`` and the group neither
    processed, parked nor holds it. ``group`` limits the audit to one consumer
    group; otherwise every group the inbox has seen is audited for every
    topic it has consumed. ``event_type`` limits it to the messages of that
    event type (each finding then among them: a message of another type
    processed in between does not count as out of order). ``as_of`` defaults to now.

    Arguments and tables are checked before ``spark`` (a session, or a
    function that builds one) is used. ``out_dir`` is made absolute here; on
    a master other than ``local`` it must be storage every node mounts at
    that path, which ``shared_storage=True`` declares (refused otherwise).

    ``wire`` (a ``Wire``) also reads the topics themselves, read_committed, and
    reports what is missing, duplicated, out of order or foreign there
    (``_wire``); a default session then gets Spark's Kafka source on its class path.
    """
    step = progress or (lambda _message: None)
    now = utcnow() if as_of is None else parse_instant(as_of, "as_of")
    span = Window.parse(window, now=now)
    sla_delta = parse_duration(sla, "SLA")
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigurationError(f"group must be a non-empty string, got {group!r}")
    if event_type is not None:
        try:
            event_type = checked_event_type(event_type)[0]
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    out = local_path(out_dir, "out_dir")
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"out_dir {out} exists and is not a directory")
    if wire is not None and not isinstance(wire, Wire):
        raise ConfigurationError(f"wire must be a Wire, got {type(wire).__name__}")
    inbox_url = inbox_url or outbox_url
    step("checking tables")
    for url, name in ((outbox_url, "outbox_messages"), *((inbox_url, n) for n in INBOX_TABLES)):
        check_table(portable_url(url), table_for(name, prefix, schema))
    incarnation = None
    if wire is not None:
        incarnation = wire_audit.incarnation(portable_url(outbox_url), prefix, schema)
        wire_audit.check_reachable(wire.bootstrap)

    def table(url: str, name: str, columns: list[str], time_column: str, upper: bool) -> DataFrame:
        return read_table(
            session, url, name, columns=columns, time_column=time_column, since=span.since,
            until=span.until if upper else None, partitions=partitions, prefix=prefix, schema=schema,
        )

    # matplotlib's import (a second or two) overlaps the JVM's start; Python
    # only waits on the JVM meanwhile.
    preload_matplotlib()
    small = estimate_rows(portable_url(outbox_url), table_for("outbox_messages", prefix, schema)) \
        <= SMALL_INPUT
    step("starting Spark")
    session = session_from(spark)
    require_shared(session, out, "out_dir", shared_storage)
    outbox = table(outbox_url, "outbox_messages", OUTBOX_COLUMNS, "created_at", True)
    if event_type is not None:
        # Consumer-side rows join the outbox's (find.consumed): filtered here, they follow.
        outbox = outbox.where(F.col("event_type") == event_type)
    # Consumption of a message happens after its creation, so rows received
    # before the window starts cannot belong to it; there is no upper bound.
    inbox = table(inbox_url, "inbox_messages", find.INBOX, "received_at", False)
    parked = table(inbox_url, "inbox_parked", ["consumer_group", "message_id"], "first_failure_at", False)
    held = table(inbox_url, "inbox_held", ["consumer_group", "message_id"], "received_at", False)
    if group is not None:
        only = F.col("consumer_group") == group
        inbox, parked, held = inbox.where(only), parked.where(only), held.where(only)

    # Independent Spark jobs run side by side: on small inputs most of their
    # time is the driver planning and compiling, which then overlaps.
    with _codegen(session, enabled=not small), ThreadPoolExecutor(5, "audit") as pool:
        summary = _run(session, pool, out, outbox, inbox, parked, held, now=now, span=span,
                       sla=sla_delta, group=group, event_type=event_type, step=step,
                       wire=wire, incarnation=incarnation)
    return AuditResult(summary=summary, out_dir=out)


def _run(session: SparkSession, pool: ThreadPoolExecutor, out: Path, outbox: DataFrame,
         inbox: DataFrame, parked: DataFrame, held: DataFrame, *, now: datetime, span: Window,
         sla: timedelta, group: str | None, event_type: str | None,
         step: Callable[[str], None], wire: Wire | None = None,
         incarnation: str | None = None) -> dict[str, Any]:
    """The Spark part of ``audit``: counts, findings, chart and report written into ``out``."""
    step("reading outbox and inbox")
    outbox = outbox.cache()
    # One join of everything the consumer side knows about a message against the
    # outbox, instead of one per table: each join shuffles the whole outbox.
    joined = find.consumed(find.consumer_side(inbox, parked, held), outbox).cache()
    rows = joined.where(F.col("kind") == find.Seen.INBOX.value)
    topics_job = pool.submit(_collect, find.topic_counts(outbox))
    groups = pool.submit(_collect, find.group_counts(joined)).result()
    topics = topics_job.result()
    pairs = session.createDataFrame(sorted((g["consumer_group"], g["topic"]) for g in groups),
                                    "consumer_group string, topic string")
    seen = joined.select("consumer_group", "message_id")

    step("finding lost, duplicated and out-of-order messages")
    out.mkdir(parents=True, exist_ok=True)
    details = {
        "lost": find.lost(outbox, pairs, seen, now, sla.total_seconds()),
        "duplicates": find.duplicates(rows),
        "out_of_order": find.out_of_order(rows),
    }
    firsts = [t["first_created_us"] for t in topics if t["first_created_us"] is not None]
    start = datetime.fromtimestamp(min(firsts) / 1e6, UTC) if firsts else span.since
    bucket_seconds = max(1.0, (now - start).total_seconds() / 120)
    produced, processed = find.timeline(outbox, rows, start, bucket_seconds)
    written = {name: pool.submit(_write, frame, out / name) for name, frame in details.items()}
    timeline = [pool.submit(_collect, frame) for frame in (produced, processed)]
    tables = {name: job.result() for name, job in written.items()}
    buckets = [job.result() for job in timeline]
    found = {name: _count(table, ["consumer_group", "topic"]) for name, table in tables.items()}
    bad_keys = _count(tables["out_of_order"].group_by(
        ["consumer_group", "topic", "key"]).aggregate([]), ["consumer_group", "topic"])

    wire_found = None
    if wire is not None:
        # After the outbox's first job: every row it saw published is on the topic by now.
        wire_found = _audit_wire(session, pool, out, wire, outbox, span=span, event_type=event_type,
                                 incarnation=incarnation, topics=[t["topic"] for t in topics], step=step)

    step("drawing the chart")
    summary = build_summary(as_of=now, window=span, sla=sla, group=group, event_type=event_type,
                            topics=topics,
                            groups=groups, found=found, bad_keys=bad_keys, wire=wire_found)
    draw_chart(out / "chart.png", summary, buckets[0], buckets[1], start, bucket_seconds)
    write_report(out, summary)
    for frame in (outbox, joined):
        frame.unpersist()
    return summary


def _audit_wire(session: SparkSession, pool: ThreadPoolExecutor, out: Path, wire: Wire,
                outbox: DataFrame, *, span: Window, event_type: str | None, incarnation: str | None,
                topics: list[str], step: Callable[[str], None]) -> dict[str, Any]:
    """Read the topics read_committed, write the wire findings, and return their summary."""
    step("reading the topics")
    audited = list(wire.topics) or sorted(topics)
    if not audited:
        return wire_summary([], {}, {}, {}, exactly_once=wire.exactly_once)
    records = wire_audit.read_wire(session, wire.bootstrap, audited, wire.options).cache()
    rows = outbox.where(F.col("topic").isin(audited))
    details = wire_find.findings(records, rows, span=span, incarnation=incarnation,
                                  event_type=event_type)
    read = pool.submit(_collect, records.groupBy("topic").count())
    order = {"wire_foreign": ["topic", "partition", "offset"]}
    written = {name: pool.submit(_write, frame, out / name, order.get(name, ["topic", "key", "seq"]))
               for name, frame in details.items()}
    tables = {name: job.result() for name, job in written.items()}
    counts = {row["topic"]: int(row["count"]) for row in read.result()}
    records.unpersist()
    found = {name: _count_by(table, "topic") for name, table in tables.items()}
    copies = tables["wire_duplicates"].group_by(["topic"]).aggregate([("copies", "sum"), ([], "count_all")])
    found["wire_extra_copies"] = {r["topic"]: r["copies_sum"] - r["count_all"] for r in copies.to_pylist()}
    bad_keys = _count_by(tables["wire_out_of_order"].group_by(["topic", "key"]).aggregate([]), "topic")
    return wire_summary(audited, counts, found, bad_keys, exactly_once=wire.exactly_once)


def _collect(frame: DataFrame) -> list[dict[str, Any]]:
    return [row.asDict() for row in frame.collect()]


def _write(frame: DataFrame, path: Path,
           order: list[str] | None = None) -> pa.Table:
    """One finding as one sorted Parquet file, read back as the driver sees it."""
    # repartition, not coalesce, so the join above stays parallel.
    frame.repartition(1).sortWithinPartitions(*(order or ["consumer_group", "topic", "key", "seq"])) \
        .write.mode("overwrite").parquet(uri(path))
    return _read_back(path)


@contextmanager
def _codegen(session: SparkSession, *, enabled: bool) -> Iterator[None]:
    """Whole-stage codegen on or off for the audit's queries, the session's setting restored after."""
    key = "spark.sql.codegen.wholeStage"
    before = session.conf.get(key, "true") or "true"
    session.conf.set(key, str(enabled).lower())
    try:
        yield
    finally:
        session.conf.set(key, before)


def _read_back(path: Path) -> pa.Table:
    """A finding's Parquet dataset as the driver sees it; written by the executors, it must be here."""
    parts = list(path.glob("part-*.parquet"))
    if not parts:
        raise AuditOutputError(
            f"the executors wrote {path.name}/ but the driver finds no data file in {path}: "
            "out_dir is not on storage shared by driver and executors"
        )
    return pq.read_table(parts)


def _count_by(table: pa.Table, column: str) -> dict[str, int]:
    counts = table.group_by([column]).aggregate([([], "count_all")]).to_pylist()
    return {r[column]: r["count_all"] for r in counts}


def _count(table: pa.Table, by: list[str]) -> dict[tuple[str, str], int]:
    counts = table.group_by(by).aggregate([([], "count_all")]).to_pylist()
    return {(r[by[0]], r[by[1]]): r["count_all"] for r in counts}
