"""Retention without a JVM, against ``outbox spark archive``, and the relay's latency while it runs.

All in one run, against a durable local PostgreSQL (``local_postgres()``) and
the embedded Kafka-protocol broker:

- built-in retention: ``outbox housekeeping run --older-than 1d`` in a fresh
  process deleting ``--rows`` old published rows (and nothing else: as many
  pending rows stay); rows/s and the process's peak RSS.
- Spark archive: ``outbox spark archive --retention 1d`` on ``--spark-rows``
  rows (smaller: it is slow), rows/s. Ratio: retention rows/s / archive rows/s.
- relay commit→ack latency: writers commit ``--rate`` messages/s (one per
  transaction) for ``--seconds`` with a relay process running, alternately
  without and with a retention process deleting ``--rows`` rows beside it
  (``--pairs`` pairs); p50/p99/max of each, and the ratio of the p99 medians.

    python tests/benchmarks/bench_retention.py [--rows N] [--spark-rows N] [--pairs N]
- partitioned: on a table made by ``init-db --partitioned``, one retention
  pass retiring a settled day of ``--partition-rows`` rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's outbox, not the installed one
from _report import TREE, markdown_table, write_section
from bench_relay import PAYLOAD, pending, start_relays, stop, wait_leased

from outbox import Outbox, create_engine
from outbox.housekeeping import DEFAULT_DUTY, partition_outbox, run_retention
from outbox.housekeeping._retention import DEFAULT_BATCH_SIZE
from outbox.testing import local_postgres
from transports.kafka import embedded_kafka

DAY = timedelta(days=1)
MEASURED = """
import resource, sys
from outbox.cli import main
try:
    main(sys.argv[1:], prog_name="outbox")
finally:
    print(f"maxrss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
"""


RETAINER = """
import sys
from outbox import create_engine
from outbox.housekeeping import run_retention
engine = create_engine(sys.argv[1])
with engine.connect():
    pass
print("ready", flush=True)
sys.stdin.readline()
report = run_retention(engine, older_than='1d', duty=float(sys.argv[2]), batch_size=int(sys.argv[3]))
print(f"deleted {report.total}", flush=True)
"""
"""One retention pass in a process that has started (imported, connected) and waits for a line."""


def seed_old(engine: sa.Engine, published: int, pending_rows: int = 10_000) -> None:
    """``published`` rows published 30 days ago, and ``pending_rows`` old pending ones delayed
    for days (retention must leave them; the relay does not send them yet)."""
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO outbox_messages (message_id, topic, key, seq, shard, payload, content_type,
                headers, created_at, available_at, attempts, status, published_at)
            SELECT gen_random_uuid(), 'old', NULL, NULL, 0, :payload, 'application/json', '{}',
                   now() - interval '30 days',
                   CASE WHEN g <= :pending THEN now() + interval '10 days'
                        ELSE now() - interval '30 days' END,
                   0,
                   CASE WHEN g <= :pending THEN 'pending' ELSE 'published' END,
                   CASE WHEN g <= :pending THEN NULL ELSE now() - interval '30 days' END
            FROM generate_series(1, :total) AS g"""),
            {"payload": PAYLOAD, "pending": pending_rows, "total": published + pending_rows})
        conn.execute(sa.text("ANALYZE outbox_messages"))


def settle(engine: sa.Engine) -> None:
    """Vacuum and checkpoint the table, as rows kept for days were long ago: no autovacuum of
    freshly seeded rows in a window, and every delete changes a page checkpointed since."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM (ANALYZE) outbox_messages"))
        conn.execute(sa.text("CHECKPOINT"))


def run_retention_process(url: str) -> tuple[float, int, int]:
    """(seconds, rows deleted, peak RSS in MB) of one ``outbox housekeeping run --duty 1`` (no rest:
    nothing else uses the database)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURED, "housekeeping", "run", "--db", url,
                           "--older-than", "1d", "--duty", "1"], capture_output=True, text=True, check=True,
                          cwd=TREE)
    seconds = time.perf_counter() - started
    deleted = int(done.stdout.strip().splitlines()[-1].split(":")[1].split()[0].replace(",", ""))
    rss = int(done.stderr.strip().splitlines()[-1].split("=")[1]) // 1024
    return seconds, deleted, rss


def run_spark_archive(url: str) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "outbox", "spark", "archive", "--db", url,
                               "--archive-dir", root, "--retention", "1d", "--log-level", "ERROR"],
                              capture_output=True, text=True, check=True, cwd=TREE)
        seconds = time.perf_counter() - started
    line = next(x for x in done.stdout.splitlines() if x.startswith("outbox_messages:"))
    return seconds, int(line.split("deleted")[1].strip().replace(",", ""))


def emptied(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox_messages"))


def write_at_rate(outbox: Outbox, rate: int, seconds: float, committed: dict[str, float]) -> None:
    """Two writers committing ``rate`` messages a second between them for ``seconds``, one per
    transaction; ``committed`` gets each message's id and the time its commit returned."""
    lock = threading.Lock()

    def write(w: int) -> None:
        interval, start = 2 / rate, time.perf_counter()
        for n in range(int(rate * seconds / 2)):
            if (delay := start + n * interval - time.perf_counter()) > 0:
                time.sleep(delay)
            with outbox._sessions() as session, session.begin():
                message_id = outbox.publish(session, "latency", PAYLOAD, key=f"w{w}-{n % 500}")
            with lock:
                committed[str(message_id)] = time.time()

    writers = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()


def latency(url: str, servers: str, rate: int, seconds: float, beside: int, duty: float,
            fresh: Callable[[sa.Engine], None] = emptied, *, retain: bool = True,
            batch_size: int = DEFAULT_BATCH_SIZE) -> tuple[float, float, float, float]:
    """p50/p99/max commit→ack ms of ``rate`` msg/s beside ``beside`` old published rows, with a
    retention pass deleting them (``retain``) or not, and the 1-minute load average at the end;
    ``fresh`` empties the table first."""
    engine = create_engine(url)
    fresh(engine)
    outbox = Outbox(engine)
    # Both runs of a pair hold the same old rows, vacuumed and checkpointed as rows kept for days
    # are: the autovacuum of rows seeded a moment ago is the seeding's cost, not retention's.
    seed_old(engine, beside, pending_rows=0)
    settle(engine)
    relays = start_relays(url, servers, 1, "--poll-interval", "5")
    committed: dict[str, float] = {}
    retention = None
    vacuums = autovacuums(engine)
    try:
        wait_leased(engine, 1)
        time.sleep(1)
        if retain:
            # The pass runs in a process started before the window, as a service's scheduler or
            # ``outbox relay --retention`` runs it: starting a command for it (importing the
            # package, about 0.6 s of CPU) is a process start beside the relay, not retention.
            retention = subprocess.Popen([sys.executable, "-c", RETAINER, url, str(duty), str(batch_size)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=TREE)
            assert retention.stdin is not None and retention.stdout is not None
            if retention.stdout.readline().strip() != "ready":
                raise RuntimeError("the retention process did not start")
            retention.stdin.write("go\n")
            retention.stdin.flush()

        write_at_rate(outbox, rate, seconds, committed)
        still_running = retention is not None and retention.poll() is None
        while pending(engine):
            time.sleep(0.1)
    finally:
        stop(relays)
        if retention is not None:
            retention.wait()
    if retain and not still_running:
        print("  note: retention ended before the writers did", flush=True)
    if (ran := autovacuums(engine) - vacuums):
        print(f"  note: {ran} autovacuum or autoanalyze run(s) of the outbox ended in the window", flush=True)
    with engine.connect() as conn:
        acked = conn.execute(sa.text(
            "SELECT message_id, published_at FROM outbox_messages WHERE topic = 'latency'")).all()
    ms = sorted((at.timestamp() - committed[str(mid)]) * 1000 for mid, at in acked)
    q = statistics.quantiles(ms, n=100)
    engine.dispose()
    return q[49], q[98], ms[-1], os.getloadavg()[0]


def autovacuums(engine: sa.Engine) -> int:
    """Autovacuum and autoanalyze runs of the outbox (and its partitions) so far: one in a window
    is the database cleaning up after retention, on its own schedule."""
    with engine.connect() as conn:
        return int(conn.scalar(sa.text(
            "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_user_tables "
            "WHERE relname LIKE 'outbox_messages%'")))


def partitioned_by_day(engine: sa.Engine) -> None:
    """``outbox_messages`` made anew, partitioned by day (today and a week ahead, as ``init-db
    --partitioned`` makes it) with one more day 30 days back: the rows ``seed_old`` dates then fill
    it, and retention drops it whole (the steady state of a partitioned outbox: old days are
    dropped, today's rows are sent)."""
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE outbox_messages"))
    outbox = Outbox(engine)
    outbox.create_tables()
    partition_outbox(engine, outbox.tables)
    old = (datetime.now(UTC) - 30 * DAY).replace(hour=0, minute=0, second=0, microsecond=0)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE outbox_messages_p{old:%Y%m%d} PARTITION OF outbox_messages "
                             f"FOR VALUES FROM ('{old.isoformat()}') TO ('{(old + DAY).isoformat()}')"))


Run = tuple[float, float, float, float]
"""p50, p99, max ms and the load average at the end of one run (``latency``)."""
Pair = tuple[Run, Run, Run | None]
"""Without retention, during it, and (``--null``) a second run without it just after."""


def latency_pairs(url: str, servers: str, args: argparse.Namespace, label: str,
                  fresh: Callable[[sa.Engine], None]) -> list[Pair]:
    """``--pairs`` pairs: without retention, then during it; with ``--null`` a third run without
    it, whose p99 against the first is what the ratio reads when retention changes nothing."""
    pairs: list[Pair] = []
    for n in range(args.pairs):
        without = latency(url, servers, args.rate, args.seconds, args.latency_rows, args.duty, fresh,
                          retain=False)
        during = latency(url, servers, args.rate, args.seconds, args.latency_rows, args.duty, fresh,
                         batch_size=args.batch_size)
        again = (latency(url, servers, args.rate, args.seconds, args.latency_rows, args.duty, fresh,
                         retain=False) if args.null else None)
        pairs.append((without, during, again))
        null = f"; again without {again[1]:.1f} ms: {again[1] / without[1]:.2f}x" if again else ""
        print(f"{label} pair {n + 1}: without p50/p99/max {without[0]:.1f}/{without[1]:.1f}/"
              f"{without[2]:.0f} ms (load {without[3]:.1f}), during retention {during[0]:.1f}/"
              f"{during[1]:.1f}/{during[2]:.0f} ms (load {during[3]:.1f}): {during[1] / without[1]:.2f}x"
              + null, flush=True)
    return pairs


def pairs_table(pairs: list[Pair]) -> str:
    null = any(again for _, _, again in pairs)
    return markdown_table(
        ["pair", "without p50 / p99 / max ms (load)", "during p50 / p99 / max ms (load)",
         "p99 during / without"] + (["again without: p99 / first without's (null)"] if null else []),
        [[str(i + 1), "{:.1f} / {:.1f} / {:.0f} ({:.1f})".format(*w),
          "{:.1f} / {:.1f} / {:.0f} ({:.1f})".format(*d), f"{d[1] / w[1]:.2f}x"]
         + ([f"{a[1]:.1f} ms: {a[1] / w[1]:.2f}x" if a else ""] if null else [])
         for i, (w, d, a) in enumerate(pairs)])


def partition_drop(engine: sa.Engine, rows: int) -> tuple[float, int]:
    """Seconds of a retention pass that retires one settled day of ``rows`` rows on a partitioned table."""
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE outbox_messages"))
    outbox = Outbox(engine)
    outbox.create_tables()
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    partition_outbox(engine, outbox.tables, now=today - 3 * DAY, ahead_days=10)
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO outbox_messages (message_id, topic, shard, payload, content_type, headers,
                created_at, available_at, attempts, status, published_at)
            SELECT gen_random_uuid(), 'old', 0, :payload, 'application/json', '{}',
                   :day + g * interval '1 millisecond' * (86400000.0 / :rows), :day, 0, 'published', :day
            FROM generate_series(0, :rows - 1) AS g"""), {"payload": PAYLOAD, "rows": rows,
                                                          "day": today - 3 * DAY})
        conn.execute(sa.text("ANALYZE outbox_messages"))
    started = time.perf_counter()
    result = run_retention(outbox, older_than="1d")
    seconds = time.perf_counter() - started
    day = f"outbox_messages_p{today - 3 * DAY:%Y%m%d}"
    assert result.partitions is not None and day in result.partitions.dropped, result.partitions
    assert result.total == 0 and not result.partitions.kept, result
    return seconds, result.partitions.dropped[day]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--spark-rows", type=int, default=100_000)
    parser.add_argument("--latency-rows", type=int, default=2_000_000,
                        help="rows the retention beside the latency runs deletes")
    parser.add_argument("--partition-rows", type=int, default=1_000_000, help="rows in the day dropped")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--duty", type=float, default=DEFAULT_DUTY,
                        help="the retention beside the relay: share of its time spent deleting")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="the retention beside the relay: rows a batch deletes")
    parser.add_argument("--null", action="store_true",
                        help="a second run without retention after each pair's run during it: the ratio "
                             "when retention changes nothing")
    parser.add_argument("--tables", default="plain,partitioned",
                        help="with --latency-only: the tables measured, plain and/or partitioned")
    parser.add_argument("--latency-only", action="store_true",
                        help="only the latency pairs, printed; docs/benchmarks.md is not written")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    if args.latency_only:
        with local_postgres() as url, embedded_kafka() as servers:
            Outbox(create_engine(url)).create_tables()
            if "plain" in args.tables:
                latency_pairs(url, servers, args, "plain", emptied)
            if "partitioned" in args.tables:
                latency_pairs(url, servers, args, "partitioned", partitioned_by_day)
        return
    with local_postgres() as url, embedded_kafka() as servers:
        engine = create_engine(url)
        Outbox(engine).create_tables()
        seed_old(engine, args.rows)
        seconds, deleted, rss = run_retention_process(url)
        own = deleted / seconds
        print(f"retention: {deleted:,} rows in {seconds:.1f} s ({own:,.0f} rows/s), RSS {rss} MB", flush=True)
        with engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE outbox_messages"))
        seed_old(engine, args.spark_rows)
        spark_seconds, spark_deleted = run_spark_archive(url)
        spark = spark_deleted / spark_seconds
        print(f"spark archive: {spark_deleted:,} rows in {spark_seconds:.1f} s ({spark:,.0f} rows/s)",
              flush=True)
        pairs = latency_pairs(url, servers, args, "plain", emptied)
        parted = latency_pairs(url, servers, args, "partitioned", partitioned_by_day)
        drop_seconds, dropped = partition_drop(engine, args.partition_rows)
        print(f"partitioned: a day of {dropped:,} rows retired in {drop_seconds:.3f} s", flush=True)
        engine.dispose()
    load = (load_before, os.getloadavg()[0])
    ratios = [d[1] / w[1] for w, d, _ in pairs]
    parted_ratios = [d[1] / w[1] for w, d, _ in parted]
    command = (f"python tests/benchmarks/bench_retention.py --rows {args.rows} "
               f"--spark-rows {args.spark_rows} --latency-rows {args.latency_rows} "
               f"--partition-rows {args.partition_rows} --pairs {args.pairs}"
               + (f" --duty {args.duty:g}" if args.duty != DEFAULT_DUTY else ""))
    verdict = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731
    body = f"""## Retention: built-in vs Spark archive, and the relay beside it

`{command}`:
durable local PostgreSQL, the embedded broker, one run (load average {load[0]:.1f} → {load[1]:.1f}).
The issue asks for 5,000,000 rows; this run deleted {args.rows:,}, and the
Spark archive ran on {args.spark_rows:,} rows (JVM start included, as an operator runs it).

{markdown_table(["job", "rows", "seconds", "rows/s", "peak RSS"], [
        ["`outbox housekeeping run --duty 1`", f"{deleted:,}", f"{seconds:.1f}", f"**{own:,.0f}**",
         f"{rss} MB"],
        ["`outbox spark archive`", f"{spark_deleted:,}", f"{spark_seconds:.1f}", f"{spark:,.0f}",
         "not measured"],
    ])}

Ratio retention / archive: **{own / spark:.1f}x** (target ≥ 4x: {verdict(own >= 4 * spark)}).
The archive's rate here includes its JVM start on few rows; against the issue's measurement of the
archive on 5,000,000 rows (13.7k rows/s, JVM start amortised), retention's rate is
**{own / 13_700:.1f}x** — the fairer comparison.
Retention's memory: {rss} MB (target < 200 MB: {verdict(rss < 200)}).

Relay commit→ack latency at {args.rate} msg/s for {args.seconds:.0f} s, without and with a
retention pass (`run_retention(older_than="1d", duty={args.duty:g})`) deleting {args.latency_rows:,}
old published rows beside it, alternating; the load average (1 min) at the end of each run in
brackets. Both runs of a pair hold the same old rows, vacuumed and checkpointed before the relay
starts (as rows kept for days are). The pass runs in a process started, imported and connected
before the window opens, as a service's scheduler or `outbox relay --retention` runs it: a command
started for each pass (`outbox housekeeping run`) also costs its start, about 0.6 s of CPU
importing the package, once per pass. Plain table:

{pairs_table(pairs)}

Partitioned table (`partition_outbox`, a day a partition; the old rows fill one day, which the
retention drops whole):

{pairs_table(parted)}

p99 during / without, every pair: plain {", ".join(f"{r:.2f}x" for r in ratios)}; partitioned
{", ".join(f"{r:.2f}x" for r in parted_ratios)} (target ≤ 1.5x in every pair:
{verdict(max(ratios + parted_ratios) <= 1.5)}). On a shared 2-core machine one run's p99 moves
from one minute to the next with what else runs: read every pair and its load.

Partitioned table (`init-db --partitioned`): a retention pass (`run_retention(older_than="1d")`)
that retires a settled day of {dropped:,} rows (and an empty one) took **{drop_seconds:.3f} s** (target < 1 s:
{verdict(drop_seconds < 1)}): a detach, a check for an unpublished row, a drop.
"""
    write_section("retention", body)


if __name__ == "__main__":
    main()
