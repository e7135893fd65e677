"""What publish() adds to a business transaction, on PostgreSQL and SQLite.

Baseline: BEGIN; INSERT one business row; COMMIT. Measured: the same plus one
``publish()``. Both run interleaved in one process against the same durable
database (fsync on), so machine noise hits both alike; the figure that matters
is the ratio. Target: p50 ratio <= 1.5 on PostgreSQL.

    python tests/benchmarks/bench_publish.py [--transactions N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=3000)
    args = parser.parse_args()
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
