"""What publish() adds to a business transaction, on PostgreSQL and SQLite.

Baseline: BEGIN; INSERT one business row; COMMIT. Measured: the same plus one
``publish()``. Both run interleaved in one process against the same durable
database (fsync on), so machine noise hits both alike; the figure that matters
is the ratio. Target: p50 ratio <= 1.5 on PostgreSQL.

    python tests/benchmarks/bench_publish.py [--transactions N]

``--against REV`` instead compares this tree's ``publish()`` with another
commit's (``git archive REV``, unpacked in a temporary directory), in one
sitting: each round runs, for both trees in alternating order and each in a
fresh process whose working directory is its tree, (a) the keyed publish
transaction on PostgreSQL and on SQLite (a database per tree, tables made by
each tree's own code), reporting its p50, and (b) ``Outbox._checked_row`` alone — the
input checks, serialisation and size count, no SQL — for a dict, a pydantic
model and a bytes payload, reporting the median µs per call. What to read:
the per-round difference of ``_checked_row`` between the trees, as a share of this
tree's publish p50 (the checks' cost, precise to a fraction of a µs), and the
per-round ratio of publish p50 (noisier: the machine is shared). Prints; writes nothing.

    python tests/benchmarks/bench_publish.py --against main [--rounds 5] [--transactions 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

from outbox import Outbox, create_engine
from outbox.testing import local_postgres

business = sa.MetaData()
orders = sa.Table(
    "orders", business,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("customer", sa.String(50)),
    sa.Column("total", sa.Numeric(10, 2)),
)


def measure(url: str, transactions: int) -> dict[str, list[float]]:
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    business.create_all(engine)
    timings: dict[str, list[float]] = {"baseline": [], "publish": []}
    payload = {"customer": "c-1", "total": "19.90", "lines": [{"sku": "A-1", "qty": 2}]}
    for i in range(transactions * 2 + 200):
        kind = "publish" if i % 2 else "baseline"
        start = time.perf_counter()
        with Session(engine) as session, session.begin():
            # From 1: MySQL reads id 0 in an AUTO_INCREMENT column as "take the next value".
            session.execute(orders.insert().values(id=i + 1, customer="c-1", total=19.90))
            if kind == "publish":
                outbox.publish(session, "orders", payload, key=f"order-{i % 1000}")
        elapsed = time.perf_counter() - start
        if i >= 200:  # the first 200 warm caches, pools and statement compilation
            timings[kind].append(elapsed * 1000)
    engine.dispose()
    return timings


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1]


# Run in each tree with only the API both trees share (the other tree has its own bench file).
_TREE_SETUP = ("import sys, os; sys.path.insert(0, os.getcwd()); from outbox import Outbox, create_engine; "
               "e = create_engine(sys.argv[1]); Outbox(e).create_tables()")
_TREE_PUBLISH = """
import sys, os, time, statistics
sys.path.insert(0, os.getcwd())
from sqlalchemy.orm import Session
from outbox import Outbox, create_engine
url, n = sys.argv[1], int(sys.argv[2])
engine = create_engine(url)
outbox = Outbox(engine)
payload = {"customer": "c-1", "total": "19.90", "lines": [{"sku": "A-1", "qty": 2}]}
times = []
for i in range(n + 200):
    start = time.perf_counter()
    with Session(engine) as session, session.begin():
        outbox.publish(session, "orders", payload, key=f"order-{i % 1000}",
                       headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    if i >= 200:
        times.append((time.perf_counter() - start) * 1000)
engine.dispose()
print(statistics.median(times))
"""
_TREE_ROW = """
import sys, os, time, statistics, inspect
sys.path.insert(0, os.getcwd())
import pydantic, sqlalchemy as sa
from outbox import Outbox
class Paid(pydantic.BaseModel):
    order_id: int
    amount: str
    note: str | None = None
outbox = Outbox(sa.create_engine("sqlite://"))
# The checks and the row without SQL: _checked_row (_row before, with the record limit, in older trees).
row = getattr(outbox, "_checked_row", None)
if row is None:
    limit = (1_000_000,) if "max_record_bytes" in inspect.signature(outbox._row).parameters else ()
    row = lambda *a: outbox._row(*a, *limit)
headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
payloads = {"dict": {"customer": "c-1", "total": "19.90", "lines": [{"sku": "A-1", "qty": 2}]},
            "model": Paid(order_id=7, amount="9.90"), "bytes": b"x" * 200}
out = []
for name, payload in payloads.items():
    per_call = []
    for _ in range(300):
        start = time.perf_counter()
        for _ in range(100):
            row("orders", payload, "order-17", headers, None, None)
        per_call.append((time.perf_counter() - start) * 1e4)  # µs per call
    out.append(f"{name}={statistics.median(per_call):.3f}")
print(" ".join(out))
"""


def _in_tree(tree: Path, code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr.strip().splitlines()[-1]}")
    return (done.stdout.strip().splitlines() or [""])[-1]


def against(rev: str, rounds: int, transactions: int) -> None:
    """This tree's publish() and _row against ``rev``'s, interleaved round by round."""
    here = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp, local_postgres(settings={}) as pg_url:
        other = Path(tmp) / "tree"
        archive = subprocess.run(["git", "archive", rev], cwd=here, capture_output=True, check=True)
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(other, filter="data")
        trees = {"this": here, rev: other}
        urls: dict[tuple[str, str], str] = {}
        with sa.create_engine(pg_url, isolation_level="AUTOCOMMIT").connect() as conn:
            for i, name in enumerate(trees):
                conn.execute(sa.text(f"CREATE DATABASE tree{i}"))
                urls[name, "PostgreSQL"] = pg_url.rsplit("/", 1)[0] + f"/tree{i}"
                urls[name, "SQLite"] = f"sqlite:///{tmp}/tree{i}.db"
        for (name, _), url in urls.items():
            _in_tree(trees[name], _TREE_SETUP, url)
        shares: list[float] = []
        ratios: dict[str, list[float]] = {"PostgreSQL": [], "SQLite": []}
        for r in range(rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            p50: dict[tuple[str, str], float] = {}
            rows: dict[str, dict[str, float]] = {}
            for name in order:
                rows[name] = {k: float(v) for k, v in
                              (part.split("=") for part in _in_tree(trees[name], _TREE_ROW).split())}
                for db in ratios:
                    p50[name, db] = float(_in_tree(trees[name], _TREE_PUBLISH, urls[name, db],
                                                   str(transactions)))
            for db in ratios:
                ratios[db].append(p50["this", db] / p50[rev, db])
            cost = rows["this"]["dict"] - rows[rev]["dict"]
            shares.append(cost / (p50["this", "SQLite"] * 1000))
            print(f"round {r + 1} (load {os.getloadavg()[0]:.1f}): _row µs this "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rows["this"].items()) + f"; {rev} "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rows[rev].items())
                  + "; publish p50 ms " + ", ".join(
                      f"{db} this {p50['this', db]:.3f} / {rev} {p50[rev, db]:.3f}" for db in ratios),
                  flush=True)
        print(f"checks' cost (dict payload, _row this - {rev}) as a share of this publish p50 on "
              f"SQLite, the faster database: per round {', '.join(f'{x:.1%}' for x in shares)}; "
              f"median {statistics.median(shares):.1%}")
        for db, values in ratios.items():
            print(f"publish p50 this / {rev} on {db}: per round {', '.join(f'{x:.3f}' for x in values)}; "
                  f"median {statistics.median(values):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--against", metavar="REV", help="compare with this commit (see above)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.against:
        against(args.against, args.rounds, args.transactions)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp, local_postgres(settings={}) as pg_url:
        for backend, url in (("PostgreSQL 15 (fsync on)", pg_url),
                             ("SQLite (WAL, synchronous=NORMAL)", f"sqlite:///{tmp}/bench.db")):
            t = measure(url, args.transactions)
            b50, p50 = quantile(t["baseline"], 0.5), quantile(t["publish"], 0.5)
            b99, p99 = quantile(t["baseline"], 0.99), quantile(t["publish"], 0.99)
            rows.append([backend, f"{b50:.3f}", f"{p50:.3f}", f"**{p50 / b50:.2f}**",
                         f"{b99:.3f}", f"{p99:.3f}", f"**{p99 / b99:.2f}**"])
            print(rows[-1])
    table = markdown_table(
        ["database", "p50 baseline ms", "p50 with publish ms", "p50 ratio",
         "p99 baseline ms", "p99 with publish ms", "p99 ratio"], rows)
    write_section("publish", f"""## publish(): cost inside a business transaction

`python tests/benchmarks/bench_publish.py --transactions {args.transactions}` — baseline is
BEGIN / INSERT one business row / COMMIT; measured adds one keyed `publish()` (seq upsert,
row insert and, on PostgreSQL, `pg_notify`, in one statement). Interleaved, same database.
Target: p50 ratio ≤ 1.5 on PostgreSQL.

{table}""")


if __name__ == "__main__":
    main()
