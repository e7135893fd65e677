"""Benchmark: the Spark audit over 20,000, 1,000,000 and 4,000,000 outbox + inbox rows on PostgreSQL.

Run: ``.venv/bin/python tests/benchmarks/bench_spark.py [--sizes 20000,1000000,4000000]``.
Starts a throwaway PostgreSQL (``outbox.testing.local_postgres``), seeds both
tables with COPY (one message in 10,000 never consumed), runs the audit on
``local[2]`` and, in the same database, the single SQL query that computes
the lost count, and writes the ``spark`` section of docs/benchmarks.md.

Sizes up to ``SMALL`` rows are timed as a user runs a daily audit: the whole
``outbox spark audit`` command in a fresh process, JVM and session start
included, ``RUNS`` times on a fresh, empty class-archive directory (what a
user gets by default) and ``RUNS`` times with the driver's AppCDS archive
written by ``outbox spark warm-up`` (whose own time is reported too); the
table shows both medians. Larger sizes time ``audit()`` in a session that is
already up. Rows of sizes not measured are kept from the previous run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import DOC, markdown_table, write_section

from outbox import Outbox, create_engine
from outbox.spark import audit, spark_session
from outbox.testing import FAST_SETTINGS, fresh_database, local_postgres

AS_OF = datetime(2026, 1, 10, tzinfo=UTC)
LOST_EVERY = 10_000
KEYS = 50_000
SMALL = 100_000
RUNS = 3
CLASS_CACHE_ENV = "OUTBOX_SPARK_CLASS_CACHE"  # a fresh directory per benchmark run

LOST_SQL = """
SELECT count(*) FROM outbox_messages o
WHERE o.status = 'published' AND o.published_at < :deadline
  AND NOT EXISTS (SELECT 1 FROM inbox_messages i
                  WHERE i.consumer_group = 'billing' AND i.message_id = o.message_id)
"""


def seed(url: str, n: int) -> float:
    """COPY n outbox rows and n-n/LOST_EVERY inbox rows; return seconds taken."""
    started = time.perf_counter()
    engine = create_engine(url)
    Outbox(engine).create_tables()
    start = AS_OF - timedelta(seconds=n // 10 + 3600)
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cur:
            with cur.copy("COPY outbox_messages (id, message_id, topic, key, seq, shard, payload, "
                          "content_type, headers, created_at, available_at, attempts, status, "
                          "published_at) FROM STDIN") as copy:
                for i in range(n):
                    created = (start + timedelta(microseconds=i * 100_000)).isoformat()
                    lag = 30_000 + i % 40_000
                    published = (start + timedelta(microseconds=i * 100_000 + lag)).isoformat()
                    key = i % KEYS
                    copy.write(
                        f"{i + 1}\t{_id(i)}\t{'orders' if i % 2 else 'payments'}\tk{key}\t{i // KEYS + 1}"
                        f"\t{key % 16}\t\\\\x7b7d\tapplication/json\t{{}}\t{created}\t{created}\t1"
                        f"\tpublished\t{published}\n"
                    )
            with cur.copy("COPY inbox_messages (consumer_group, message_id, topic, key, seq, "
                          "received_at, processed_at, deliveries, outcome) FROM STDIN") as copy:
                for i in range(n):
                    if i % LOST_EVERY == 7:
                        continue
                    done = (start + timedelta(microseconds=i * 100_000 + 90_000 + i % 70_000)).isoformat()
                    key = i % KEYS
                    copy.write(f"billing\t{_id(i)}\t{'orders' if i % 2 else 'payments'}\tk{key}"
                               f"\t{i // KEYS + 1}\t{done}\t{done}\t1\tprocessed\n")
        raw.commit()
    finally:
        raw.close()
    with engine.begin() as conn:
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()
    return time.perf_counter() - started


def _id(i: int) -> uuid.UUID:
    return uuid.UUID(int=(i * 0x9E3779B97F4A7C15 + 12345) % (1 << 128))


def one_query(url: str) -> tuple[int, float]:
    engine = create_engine(url)
    started = time.perf_counter()
    with engine.connect() as conn:
        lost = conn.execute(sa.text(LOST_SQL), {"deadline": AS_OF - timedelta(minutes=15)}).scalar_one()
    elapsed = time.perf_counter() - started
    engine.dispose()
    return lost, elapsed


def audit_command(url: str, out: str, class_cache: str | None = None) -> tuple[int, float]:
    """``outbox spark audit`` in its own process, as a scheduled job runs it; (lost, seconds)."""
    command = [str(Path(sys.executable).parent / "outbox"), "spark", "audit", "--outbox-db", url,
               "--out", out, "--sla", "15m", "--as-of", AS_OF.isoformat(), "--master", "local[2]"]
    env = dict(os.environ) if class_cache is None else {**os.environ, CLASS_CACHE_ENV: class_cache}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - started
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return json.loads((Path(out) / "summary.json").read_text())["totals"]["lost"], elapsed


def warm_up(class_cache: str) -> float:
    """``outbox spark warm-up`` in its own process; seconds."""
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "outbox"), "spark", "warm-up"],
                          capture_output=True, text=True, env={**os.environ, CLASS_CACHE_ENV: class_cache})
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-2000:]
    return elapsed


def small_audits(url: str, out: str) -> tuple[int, str, str]:
    """The command RUNS times without a class archive, then RUNS times with one from warm-up.

    Returns (lost, the audit cell with both medians, a note with every run and the warm-up's time).
    """
    medians, notes = [], []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("without the class archive", "with it"):
            if label == "with it":
                load = os.getloadavg()[0]
                notes.append(f"`outbox spark warm-up` took {warm_up(cache):.1f} s at load {load:.1f}")
            runs = []
            for _ in range(RUNS):
                load = os.getloadavg()[0]
                lost, elapsed = audit_command(url, out, cache)
                runs.append((elapsed, load))
            medians.append(sorted(e for e, _ in runs)[len(runs) // 2])
            notes.append(f"{label}: " + ", ".join(f"{e:.1f} s at load {ld:.1f}" for e, ld in runs))
    cell = f"{medians[1]:.1f} s with the class archive, {medians[0]:.1f} s without"
    return lost, cell, f"medians of {RUNS} runs; " + "; ".join(notes)


def kept_rows(sizes: list[int]) -> tuple[list[list[str]], str | None, str | None]:
    """Table rows of sizes not measured now, the earlier session start and scaling line, from the doc."""
    text = DOC.read_text() if DOC.exists() else ""
    section = re.search(r"<!-- bench:spark -->(.*?)<!-- /bench:spark -->", text, re.S)
    if section is None:
        return [], None, None
    rows = []
    for line in section.group(1).splitlines():
        size = re.match(r"\| ([\d,]+) \+", line)
        if size and int(size.group(1).replace(",", "")) not in sizes:
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    startup = re.search(r"its start took ([\d.]+) s", section.group(1))
    scaling = re.search(r"^Scaling: .*$", section.group(1), re.M)
    return rows, startup and startup.group(1), scaling and scaling.group(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,1000000,4000000")
    parser.add_argument("--no-write", action="store_true", help="print, don't update docs")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    spark, startup = None, 0.0
    with local_postgres(FAST_SETTINGS | {"shared_buffers": "512MB", "work_mem": "64MB"}) as server:
        for n in sizes:
            if n > SMALL and spark is None:
                started = time.perf_counter()
                spark = spark_session("local[2]", config={
                    "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "8",
                    "spark.driver.memory": "4g",
                }, log_level="ERROR")
                startup = time.perf_counter() - started
            with fresh_database(server) as url, tempfile.TemporaryDirectory() as out:
                seeded = seed(url, n)
                print(f"{n:,} rows each seeded in {seeded:.1f} s", flush=True)
                load = os.getloadavg()[0]
                note = ""
                cell = ""
                if n <= SMALL:
                    spark_lost, cell, note = small_audits(url, out)
                    elapsed = 0.0
                else:
                    started = time.perf_counter()
                    result = audit(url, out_dir=out, sla="15m", as_of=AS_OF, spark=spark, partitions=8)
                    elapsed = time.perf_counter() - started
                    spark_lost = result.totals["lost"]
                sql_lost, sql_time = one_query(url)
            expected = len(range(7, n, LOST_EVERY))
            assert spark_lost == sql_lost == expected, (spark_lost, sql_lost, expected)
            cell = cell or f"{elapsed:.1f} s"
            print(f"{n:,}: audit {cell}, one SQL query {sql_time:.2f} s, lost {spark_lost}", flush=True)
            results.append((n, seeded, elapsed, sql_time, spark_lost, load, note, cell))
    kept, earlier_startup, earlier_scaling = kept_rows(sizes)
    rows = kept + [[f"{n:,} + {n - e:,}" + (f" ({note})" if note else ""), cell, f"{q:.2f} s",
                    f"{e:,}", f"{s:.0f} s", f"{ld:.1f}"] for n, s, _, q, e, ld, note, cell in results]
    rows.sort(key=lambda row: int(row[0].split(" ")[0].replace(",", "")))
    started_in = f"{startup:.1f}" if spark is not None else earlier_startup or "?"
    body = [
        "## Spark audit (PostgreSQL, `local[2]`)",
        "",
        "Outbox + inbox rows in one database (so the single SQL query can run too), one consumer "
        f"group, one message in {LOST_EVERY:,} never consumed. The audit time is end to end: "
        "partitioned reads by Python tasks (Arrow), all findings, Parquet, JSON, chart. "
        f"Up to {SMALL:,} rows it is the whole `outbox spark audit` command in a fresh process, "
        "JVM and SparkSession start included (a daily audit as a scheduler runs it), without and "
        "with the driver's class archive written by `outbox spark warm-up`; above, "
        f"`audit()` in a session that was already up (its start took {started_in} s). The SQL "
        "query computes only the lost count. Rows of sizes not given to `--sizes` are kept "
        "from the previous run.",
        "",
        markdown_table(["rows (outbox + inbox)", "audit", "one SQL query (lost count)", "lost found",
                        "seeding (COPY)", "load average at start"], rows),
        "",
        "The machine is shared (2 cores); the load average column shows how busy it was when "
        "each audit started. The first audit of a session also pays for starting Spark's Python "
        "workers.",
    ]
    large = [r for r in results if r[0] > SMALL]
    if len(large) >= 2:
        ratio = large[-1][2] / large[0][2]
        body += ["", f"Scaling: the {large[-1][0]:,}-row audit took {ratio:.2f}x the "
                     f"{large[0][0]:,}-row audit (target ≤ 4.5; linear is 4.0)."]
    elif earlier_scaling:
        body += ["", earlier_scaling]
    text = "\n".join(body)
    print(text)
    if not args.no_write:
        write_section("spark", text)


if __name__ == "__main__":
    main()
