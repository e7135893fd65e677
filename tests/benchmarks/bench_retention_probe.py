"""What retention's settings cost a relay beside it, in windows short enough to pair under load.

``bench_retention.py`` compares whole 15-second relay runs with and without a
retention; on a shared machine one run's p99 moves with what else runs. This
one keeps a single durable local PostgreSQL and, every 2 ms, a probe that does
what the relay's hot path does to the database (a read of the pending index,
then a one-row update and a durable commit, which flushes every byte of WAL
written before it). It times the probe for ``--seconds`` alone and beside an
``outbox housekeeping run`` with each setting given, round after round,
alternating, so that neighbouring windows see the same load. The old rows are
re-seeded (and a CHECKPOINT taken: rows kept for days sit on pages checkpointed
since) when fewer than 700,000 are left.

    python tests/benchmarks/bench_retention_probe.py --rounds 4 \\
        alone= batch5000="--batch-size 5000 --duty 0.5" batch1000="--batch-size 1000 --duty 0.5"

Each setting is ``name=ARGS`` (the arguments given to ``outbox housekeeping run``;
``name=`` alone: no retention). Prints each window's probe p50/p99/max, the rows
deleted meanwhile and the load, then the median p99 of each setting.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's outbox, not the installed one
from bench_retention import seed_old

from outbox import Outbox, create_engine
from outbox.testing import local_postgres

TREE = Path(__file__).resolve().parents[2]
SEED, RESEED_BELOW = 1_500_000, 700_000


def probe(engine: sa.Engine, seconds: float) -> tuple[float, float, float]:
    """p50/p99/max ms of the relay-like round trip, repeated every 2 ms for ``seconds``."""
    took = []
    with engine.connect() as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            conn.execute(sa.text("SELECT id FROM outbox_messages WHERE status = 'pending' "
                                 "ORDER BY shard, id LIMIT 100")).all()
            conn.execute(sa.text("UPDATE probe SET v = v + 1 WHERE id = 1"))
            conn.commit()
            took.append((time.perf_counter() - started) * 1000)
            time.sleep(0.002)
    q = statistics.quantiles(took, n=100)
    return q[49], q[98], max(took)


def old_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM outbox_messages WHERE status = 'published'")).scalar_one())


def window(engine: sa.Engine, url: str, args: list[str] | None, seconds: float) -> tuple[float, ...]:
    """The probe's p50/p99/max alone (``args`` None) or beside a retention run with ``args``, and
    the rows it deleted meanwhile. The window opens once the run deleted its first batch."""
    if old_rows(engine) < RESEED_BELOW:
        seed_old(engine, SEED, pending_rows=0)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("CHECKPOINT"))
    before = old_rows(engine)
    run = None
    if args is not None:
        run = subprocess.Popen([sys.executable, "-m", "outbox", "housekeeping", "run", "--db", url,
                                "--older-than", "1d", *args], stdout=subprocess.DEVNULL, cwd=TREE,
                               env={**os.environ, "PYTHONPATH": str(TREE)})
        deadline = time.monotonic() + 60
        while old_rows(engine) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        before = old_rows(engine)
    try:
        p50, p99, most = probe(engine, seconds)
    finally:
        if run is not None:
            run.send_signal(signal.SIGTERM)  # it stops between two batches
            run.wait(60)
    return p50, p99, most, before - old_rows(engine)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("settings", nargs="+",
                        help="name=ARGS of `outbox housekeeping run`; name= alone: no retention")
    options = parser.parse_args()
    settings: dict[str, list[str] | None] = {}
    for spec in options.settings:
        name, _, args = spec.partition("=")
        settings[name] = shlex.split(args) if args else None
    p99s: dict[str, list[float]] = {name: [] for name in settings}
    with local_postgres() as url:
        engine = create_engine(url)
        Outbox(engine).create_tables()
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE probe (id int PRIMARY KEY, v bigint)"))
            conn.execute(sa.text("INSERT INTO probe VALUES (1, 0)"))
        for n in range(options.rounds):
            for name, args in settings.items():
                p50, p99, most, deleted = window(engine, url, args, options.seconds)
                p99s[name].append(p99)
                print(f"round {n + 1} {name}: probe p50/p99/max {p50:.2f}/{p99:.2f}/{most:.1f} ms, "
                      f"{deleted / options.seconds:,.0f} rows/s deleted (load {os.getloadavg()[0]:.1f})",
                      flush=True)
        engine.dispose()
    for name, values in p99s.items():
        print(f"{name}: median p99 {statistics.median(values):.2f} ms "
              f"(every round: {', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
