"""This tree's inbox against another commit's, in one sitting: is there a regression?

Run: ``.venv/bin/python tests/benchmarks/bench_inbox_against.py REV [--rounds N]``.
``git archive REV`` is unpacked into a temporary directory; one throwaway
PostgreSQL cluster (a database per tree, tables made by each tree's own code)
and one embedded Kafka-protocol broker serve both. Each round runs the plain
consumer baseline, then the batch-handler and the per-message-handler rows of
``bench_inbox`` for both trees, each in a fresh process whose working directory
is its tree, alternating which tree goes first, then the baseline again. On a
shared machine single runs move by a third from one minute to the next; the
per-round ratio new / REV of the same row, and its median, are what to read.
``--hot`` adds both rows with every message on one key; ``--messages`` sets the
count of each inbox row (the baseline runs at most 20,000). Prints the table;
writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import sqlalchemy as sa

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))

from outbox.testing import local_postgres  # noqa: E402
from transports.kafka import embedded_kafka  # noqa: E402

SETUP = ("import sys, os; sys.path.insert(0, os.getcwd()); from outbox import Inbox, create_engine; "
         "from tests.inbox_support import business; e = create_engine(sys.argv[1]); "
         "Inbox(e, group='setup').create_tables(); business.create_all(e)")
RUN = ("import sys, os; sys.path.insert(0, os.getcwd()); sys.path.insert(0, 'tests/benchmarks'); "
       "import bench_inbox as b; servers, db, row, n, keys = sys.argv[1:6]; n, keys = int(n), int(keys); "
       "print(b.baseline(servers, db, min(n, 20_000)) if row == 'baseline' else "
       "b.inbox_rate(servers, db, n, keys, concurrency=8, batch_size=200) if row == 'handler' else "
       "b.inbox_rate(servers, db, n, keys, concurrency=2, batch_size=500, batch_handler=True))")
ROWS = ("batch handler", "handler")
HOT_ROWS = ("batch handler, one key", "handler, one key")


def run(tree: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", *args], cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr.strip().splitlines()[-1]}")
    return (done.stdout.strip().splitlines() or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare with, e.g. 70151f6")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--hot", action="store_true",
                        help="also run both rows with every message on one key")
    args = parser.parse_args()
    rows = ROWS + (HOT_ROWS if args.hot else ())
    with tempfile.TemporaryDirectory() as tmp, local_postgres() as url, embedded_kafka() as servers:
        other = Path(tmp)
        archive = subprocess.run(["git", "archive", args.rev], cwd=HERE, capture_output=True, check=True)
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(other, filter="data")
        trees = {"this": HERE, args.rev: other}
        urls = {}
        with sa.create_engine(url, isolation_level="AUTOCOMMIT").connect() as conn:
            for i, name in enumerate(trees):
                conn.execute(sa.text(f"CREATE DATABASE tree{i}"))
                urls[name] = url.rsplit("/", 1)[0] + f"/tree{i}"
        for name, tree in trees.items():
            run(tree, SETUP, urls[name])
        results = []
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            n = str(args.messages)
            base = [float(run(HERE, RUN, servers, urls["this"], "baseline", n, "1000"))]
            rates = {}
            for row in rows:
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for name in order:
                    rates[name, row] = float(run(
                        trees[name], RUN, servers, urls[name],
                        "batch" if row.startswith("batch handler") else "handler", n,
                        "1" if row.endswith("one key") else "1000"))
            base.append(float(run(HERE, RUN, servers, urls["this"], "baseline", n, "1000")))
            baseline = statistics.mean(base)
            results.append(rates)
            print(f"round {r + 1} (load {load:.1f}): baseline {baseline:,.0f} msg/s; " + "; ".join(
                f"{row}: this {rates['this', row] / baseline:.2f}x, {args.rev} "
                f"{rates[args.rev, row] / baseline:.2f}x" for row in rows), flush=True)
        for row in rows:
            ratios = [rates["this", row] / rates[args.rev, row] for rates in results]
            print(f"{row}: this / {args.rev} per round {', '.join(f'{x:.2f}' for x in ratios)}; "
                  f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
