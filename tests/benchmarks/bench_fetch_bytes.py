"""What the byte bound (``max_batch_bytes``) costs the relay's fetch: with and without its running sum.

One durable local PostgreSQL, ``--rows`` pending rows over the default 16 shards, one session set
up as the relay's; each form of the fetch (the backlog's ``UNION ALL`` at 5,000 and 1,000 rows, the
keeping-up ``LATERAL`` at 20) run ``--runs`` times with the sum and without, interleaved, and the
median of all but the first five of each printed with their ratio and the load average.

    python tests/benchmarks/bench_fetch_bytes.py [--rows 50000] [--runs 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import UTC, datetime

import sqlalchemy as sa

from outbox import Outbox, create_engine
from outbox.relay._session import relay_engine
from outbox.relay._sql import statements_for
from outbox.testing import local_postgres

SEED = ("INSERT INTO outbox_messages (message_id, topic, key, seq, shard, payload, content_type, headers, "
        "created_at, available_at, attempts, status) SELECT gen_random_uuid(), 'orders', 'k' || (g % 2000), "
        "g, g % 16, convert_to(repeat('x', 200), 'UTF8'), 'application/json', '{}', now(), now(), 0, "
        "'pending' FROM generate_series(1, :n) g")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=25)
    args = parser.parse_args()
    with local_postgres() as url:
        engine = relay_engine(create_engine(url))
        outbox = Outbox(engine)
        outbox.create_tables()
        with engine.begin() as conn:
            conn.execute(sa.text(SEED), {"n": args.rows})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE outbox_messages"))
        sql = statements_for(outbox.tables, "postgresql")
        shards = tuple(range(outbox.shards))
        print("| fetch | rows | without the sum | with it | ratio | load |\n|---|---|---|---|---|---|")
        for backlog, limit in ((True, 5000), (True, 1000), (False, 20)):
            forms = {"sized": sql.fetch(shards, backlog=backlog),
                     "plain": sql._fetch_of(shards, backlog=backlog)}
            times: dict[str, list[float]] = {name: [] for name in forms}
            with engine.connect() as taken:
                conn = sql.prepare_fetch(taken)
                params = sql.fetch_params(datetime.now(UTC), limit, [], 64 * 2**20)
                for _ in range(args.runs):
                    for name, statement in forms.items():
                        started = time.perf_counter()
                        fetched = len(conn.execute(statement, params).all())
                        times[name].append((time.perf_counter() - started) * 1000)
                conn.commit()
            plain, sized = (statistics.median(times[name][5:]) for name in ("plain", "sized"))
            form = "backlog (`UNION ALL`)" if backlog else "keeping up (`LATERAL`)"
            print(f"| {form} | {fetched:,} | {plain:.2f} ms | {sized:.2f} ms | {sized / plain:.2f}x "
                  f"| {os.getloadavg()[0]:.1f} |", flush=True)
        engine.dispose()


if __name__ == "__main__":
    main()
