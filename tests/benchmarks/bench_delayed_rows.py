"""What one fetch of the relay costs while delayed rows wait (``publish(delay=...)``, retries).

A known cost, not a target (docs/relay.md, "Many delayed rows"): the fetch walks the pending
index in id order and reads each row to learn whether it is due, so every delayed row older than
the due ones is read again at every fetch. For each count of rows delayed by a day (inserted
first, as a service's scheduled messages are older than its live ones), then 100 due rows over
100 keys, ``VACUUM ANALYZE``, the relay's own statement (16 shards, ``limit`` 1,000, keeping-up
and backlog forms) run twice on the relay's session (the second timed) and once under
``EXPLAIN (ANALYZE, BUFFERS)``; the baseline is the same with no delayed row.

    python tests/benchmarks/bench_delayed_rows.py [--delayed 0,20000,200000,1000000]
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import sqlalchemy as sa

from outbox import Outbox, create_engine
from outbox.relay._session import fetch_session
from outbox.relay._sql import statements_for
from outbox.testing import local_postgres

INSERT = ("INSERT INTO outbox_messages (message_id, topic, key, seq, shard, payload, content_type, headers, "
          "created_at, available_at, attempts, status) SELECT gen_random_uuid(), 'orders', :prefix || g, 1, "
          "g % 16, convert_to(repeat('x', 200), 'UTF8'), 'application/json', '{}', now(), "
          "now() + CAST(:delay AS interval), 0, 'pending' FROM generate_series(1, :n) g")


def measure(url: str, delayed: int) -> list[tuple[str, float, int]]:
    engine = create_engine(url)
    try:
        outbox = Outbox(engine)
        with engine.begin() as conn:  # each count on fresh tables
            conn.execute(sa.text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
        outbox.create_tables()
        with engine.begin() as conn:
            conn.execute(sa.text(INSERT), {"prefix": "later-", "delay": "1 day", "n": delayed})
            conn.execute(sa.text(INSERT), {"prefix": "now-", "delay": "0 s", "n": 100})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE outbox_messages"))
        statements = statements_for(outbox.tables, "postgresql")
        found = []
        for backlog in (False, True):
            stmt = statements.fetch(range(16), backlog=backlog)
            with engine.connect() as conn:
                fetch_session(conn)
                params = statements.fetch_params(datetime.now(UTC), 1000, [], 64 << 20)
                conn.execute(stmt, params).all()  # the first run compiles the statement
                started = time.perf_counter()
                rows = conn.execute(stmt, params).all()
                elapsed = time.perf_counter() - started
                assert len(rows) == 100, len(rows)
                compiled = stmt.compile(dialect=engine.dialect)
                plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(compiled),
                                            compiled.construct_params(params)).scalar()
                top = plan[0]["Plan"]
                found.append(("backlog" if backlog else "keeping up", elapsed * 1000,
                              top["Shared Hit Blocks"] + top["Shared Read Blocks"]))
        return found
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delayed", default="0,20000,200000,1000000")
    args = parser.parse_args()
    counts = [int(n) for n in args.delayed.split(",")]
    print("| delayed rows | fetch | ms | buffers | ms / no delayed row |")
    print("|---|---|---|---|---|")
    with local_postgres() as url:
        base: dict[str, float] = {}
        for n in counts:
            for form, ms, buffers in measure(url, n):
                base.setdefault(form, ms)
                print(f"| {n:,} | {form} | {ms:.1f} | {buffers:,} | {ms / base[form]:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
