"""A hot key against spread keys of the inbox, quiet and beside busy-loop processes.

Run: ``.venv/bin/python tests/benchmarks/bench_hot_key_load.py [--hogs 6 --rounds 2]``.
Prints, per round, one connection's ``SELECT 1`` round trip (p50/p99) and, for a
per-message handler and a batch handler, the rate of 6,000 messages over 1,000 keys
and over one key. Issue 39 asked whether a hot key's collapse under CPU contention
(0.09x of spread keys) is the physics of one key's sequential chain: a key's messages
are applied one after another on one worker, so its rate is one over its round trips,
which contention lengthens, while spread keys overlap theirs. Writes no docs: the
explanation is kept by hand in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inbox import Inbox, business, embedded_kafka, inbox_rate, local_postgres


def busy_loop() -> None:
    while True:
        pass


def round_trip_ms(db: str, count: int = 400) -> tuple[float, float]:
    """p50 and p99 of ``SELECT 1`` on one connection: what one sequential chain pays per step."""
    engine = create_engine(db)
    times = []
    with engine.connect() as connection:
        for _ in range(count):
            started = time.perf_counter()
            connection.execute(text("select 1"))
            times.append((time.perf_counter() - started) * 1000)
    engine.dispose()
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=6, help="busy-loop processes in a loaded round")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of a quiet and a loaded round")
    parser.add_argument("--messages", type=int, default=6_000)
    args = parser.parse_args()
    settings = (("@inbox.handler 200x8", {"concurrency": 8, "batch_size": 200}),
                ("@inbox.batch_handler 500x2", {"concurrency": 2, "batch_size": 500, "batch_handler": True}))
    with local_postgres() as db, embedded_kafka() as servers:
        engine = create_engine(db)
        Inbox(engine, group="setup").create_tables()
        business.create_all(engine)
        engine.dispose()
        for hogs in [0, args.hogs] * args.rounds:
            procs = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(hogs)]
            for proc in procs:
                proc.start()
            try:
                time.sleep(3)
                p50, p99 = round_trip_ms(db)
                print(f"busy loops {hogs}, load {os.getloadavg()[0]:.1f}: SELECT 1 p50 {p50:.2f} ms, "
                      f"p99 {p99:.2f} ms", flush=True)
                for label, kwargs in settings:
                    spread = inbox_rate(servers, db, args.messages, 1000, **kwargs)  # type: ignore[arg-type]
                    hot = inbox_rate(servers, db, args.messages, 1, **kwargs)  # type: ignore[arg-type]
                    print(f"  {label}: 1,000 keys {spread:,.0f} msg/s, one key {hot:,.0f} msg/s "
                          f"({hot / spread:.2f}x)", flush=True)
            finally:
                for proc in procs:
                    proc.kill()


if __name__ == "__main__":
    main()
