"""The relay's commit→ack latency beside ``outbox housekeeping run`` with several settings, alternating.

``bench_retention.py`` pairs a run without retention with one beside it; this
one runs any number of settings round after round in one sitting (one durable
local PostgreSQL, the embedded broker), so that neighbouring windows see the
same load, and says what each window cost the database besides: WAL written,
checkpoints, and the seconds an autovacuum worker spent on the outbox table (sampled).

    python tests/benchmarks/bench_retention_ab.py --rounds 4 --table plain \\
        without= idle="--older-than 3650d" default="--older-than 1d"

Each setting is ``name=ARGS``: the arguments of ``outbox housekeeping run`` (``NAME=VALUE``
words among them are put in its environment); ``name=`` alone: no old rows and no retention;
``name=SEED``: the old rows but no retention (what seeding alone costs). Prints each window's
p50/p99/max, then every setting's p99 in every round and its ratio to the first setting's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's outbox, not the installed one
from bench_relay import pending, start_relays, stop, wait_leased
from bench_retention import emptied, partitioned_by_day, seed_old, settle, write_at_rate

from outbox import Outbox, create_engine
from outbox.testing import local_postgres
from transports.kafka import embedded_kafka

TREE = Path(__file__).resolve().parents[2]
STATS = """
SELECT pg_current_wal_insert_lsn() - '0/0',
       (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)"""


def stats(engine: sa.Engine) -> tuple[int, int]:
    """WAL written so far (bytes) and checkpoints begun (counted when they end)."""
    with engine.connect() as conn:
        wal, checkpoints = conn.execute(sa.text(STATS)).one()
    return int(wal), int(checkpoints)


def window(url: str, servers: str, options: argparse.Namespace, args: list[str] | None,
           fresh: Callable[[sa.Engine], None]) -> tuple[float, ...]:
    engine = create_engine(url)
    fresh(engine)
    outbox = Outbox(engine)
    if args is not None:
        seed_old(engine, options.rows, pending_rows=0)
        if options.settle:
            settle(engine)
    relays = start_relays(url, servers, 1, "--poll-interval", "5")
    committed: dict[str, float] = {}
    retention = None
    try:
        wait_leased(engine, 1)
        time.sleep(1)
        before = stats(engine)
        watching = threading.Event()
        seen: list[str] = []

        def watch() -> None:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                while not watching.wait(0.1):
                    seen.extend(conn.execute(sa.text(
                        "SELECT query FROM pg_stat_activity WHERE backend_type = 'autovacuum worker' "
                        "AND query LIKE '%outbox_messages%'")).scalars())

        watcher = threading.Thread(target=watch)
        watcher.start()
        if args:
            env = {**os.environ, "PYTHONPATH": str(TREE)}
            words = []
            for word in args:
                name, sep, value = word.partition("=")
                if sep and name.isupper():
                    env[name] = value
                else:
                    words.append(word)
            retention = subprocess.Popen([sys.executable, "-m", "outbox", "housekeeping", "run", "--db", url,
                                          *words], stdout=subprocess.DEVNULL, cwd=TREE, env=env)
        write_at_rate(outbox, options.rate, options.seconds, committed)
        ran_through = retention is None or retention.poll() is None
        while pending(engine):
            time.sleep(0.1)
        after = stats(engine)
        watching.set()
        watcher.join()
    finally:
        stop(relays)
        if retention is not None:
            retention.wait()
    with engine.connect() as conn:
        acked = conn.execute(sa.text(
            "SELECT message_id, published_at FROM outbox_messages WHERE topic = 'latency'")).all()
        left = conn.execute(sa.text("SELECT count(*) FROM outbox_messages WHERE topic = 'old'")).scalar_one()
    ms = sorted((at.timestamp() - committed[str(mid)]) * 1000 for mid, at in acked)
    q = statistics.quantiles(ms, n=100)
    engine.dispose()
    return (q[49], q[98], ms[-1], os.getloadavg()[0], (after[0] - before[0]) / 1e6, after[1] - before[1],
            len(seen) / 10, float(left), float(ran_through))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rows", type=int, default=500_000, help="old published rows seeded")
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--table", choices=["plain", "partitioned"], default="plain")
    parser.add_argument("--settle", action="store_true",
                        help="VACUUM and CHECKPOINT after seeding, as rows kept for days would be")
    parser.add_argument("settings", nargs="+")
    options = parser.parse_args()
    settings: dict[str, list[str] | None] = {}
    for spec in options.settings:
        name, _, args = spec.partition("=")
        settings[name] = None if not args else [] if args == "SEED" else shlex.split(args)
    fresh = emptied if options.table == "plain" else partitioned_by_day
    p99s: dict[str, list[float]] = {name: [] for name in settings}
    with local_postgres() as url, embedded_kafka() as servers:
        Outbox(create_engine(url)).create_tables()
        for n in range(options.rounds):
            for name, args in settings.items():
                p50, p99, most, load, wal, cps, avs, left, through = window(
                    url, servers, options, args, fresh)
                p99s[name].append(p99)
                print(f"{options.table} round {n + 1} {name}: p50/p99/max {p50:.1f}/{p99:.1f}/{most:.0f} ms "
                      f"load {load:.1f}; WAL {wal:.0f} MB, checkpoints {cps}, autovacuum seen {avs:.1f} s, "
                      f"old rows left {left:,.0f}{'' if through else ' (retention ended early)'}",
                      flush=True)
    first = next(iter(p99s.values()))
    for name, values in p99s.items():
        print(f"{name}: p99 {', '.join(f'{v:.1f}' for v in values)} ms; ÷ {next(iter(p99s))} "
              f"{', '.join(f'{v / f:.2f}' for v, f in zip(values, first, strict=True))}")


if __name__ == "__main__":
    main()
