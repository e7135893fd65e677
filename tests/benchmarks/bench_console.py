"""The web console's pages with a big outbox and many parked keys, on PostgreSQL.

Two databases in one run: *small* (1,000 pending rows, 10 parked keys) and
*large* (1,000,000 pending rows, 10,000 parked keys of 2 messages each, 1,000
failed rows, 1,000 held gaps). Every page is requested through the whole
app in-process (routing, queries, Jinja2 rendering; Starlette's TestClient,
no network) and timed; the baseline is ``/ping``, a ``SELECT 1`` round trip
through the same app. Figures: median ms per page, and the ratios large /
small (does a page grow with the tables?) and large / ``/ping``.

    python tests/benchmarks/bench_console.py [--rows 1000000] [--keys 10000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import sqlalchemy as sa
from starlette.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

from outbox import Outbox, create_engine
from outbox.console import Operators, create_app
from outbox.console._links import link
from outbox.testing import fresh_database, local_postgres_server

GROUP = "billing"


def fill(engine: sa.Engine, rows: int, keys: int) -> None:
    """Pending rows over 1,000 keys and 16 shards, 1 in 1,000 failed; ``keys`` parked keys; held gaps."""
    failed_every = 1000
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO outbox_messages (message_id, topic, key, seq, shard, payload, content_type, headers,
                                         created_at, available_at, attempts, status, last_error)
            SELECT gen_random_uuid(), 'orders', 'k' || (i % 1000), i / 1000 + 1, i % 16,
                   convert_to('{"order": ' || i || '}', 'UTF8'), 'application/json', '{}',
                   now() - interval '1 hour', now() - interval '1 hour', 0,
                   CASE WHEN i % :every = 0 THEN 'failed' ELSE 'pending' END,
                   CASE WHEN i % :every = 0 THEN 'MSG_SIZE_TOO_LARGE' END
            FROM generate_series(0, :n - 1) AS i"""), {"n": rows, "every": failed_every})
        conn.execute(sa.text("""
            INSERT INTO inbox_parked (consumer_group, message_id, topic, key, seq, payload, content_type,
                                      headers, created_at, reason, error, traceback, attempts,
                                      first_failure_at, last_failure_at)
            SELECT :g, gen_random_uuid(), 'orders', 'key-' || lpad((i / 2)::text, 6, '0'), i % 2 + 1,
                   convert_to('{"n": ' || i || '}', 'UTF8'), 'application/json', '{}', now(),
                   CASE WHEN i % 2 = 0 THEN 'failed' ELSE 'key_parked' END,
                   CASE WHEN i % 2 = 0 THEN 'RuntimeError: bug 42' END,
                   CASE WHEN i % 2 = 0 THEN 'Traceback (most recent call last): ...' END,
                   3, now() - interval '10 minutes', now()
            FROM generate_series(0, :n - 1) AS i"""), {"g": GROUP, "n": keys * 2})
        held = max(1, keys // 10)
        conn.execute(sa.text("""
            INSERT INTO inbox_keys (consumer_group, topic, key, last_seq, parked)
            SELECT :g, 'orders', 'gap-' || lpad(i::text, 6, '0'), 1, false
            FROM generate_series(0, :n - 1) AS i
            """), {"g": GROUP, "n": held})
        conn.execute(sa.text("""
            INSERT INTO inbox_held (consumer_group, message_id, topic, key, seq, payload, content_type,
                                    headers, created_at, received_at)
            SELECT :g, gen_random_uuid(), 'orders', 'gap-' || lpad(i::text, 6, '0'), 3, '\\x7b7d',
                   'application/json', '{}', now(), now() - interval '5 minutes'
            FROM generate_series(0, :n - 1) AS i"""), {"g": GROUP, "n": held})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(sa.text("VACUUM ANALYZE"))


def pages(outbox: Outbox, keys: int) -> dict[str, str]:
    m = outbox.tables.messages
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        middle_failed = conn.scalar(sa.select(m.c.id).where(m.c.status == "failed").order_by(m.c.id)
                                    .offset(conn.scalar(sa.select(sa.func.count()).where(
                                        m.c.status == "failed")) // 2).limit(1))
    middle_key = f"key-{keys // 2:06d}"
    return {
        "/ping (SELECT 1)": "/ping",
        "overview": "/",
        "failed rows, first page": "/failed",
        "failed rows, middle page": f"/failed?after={middle_failed}",
        "parked keys, first page": link("", "/parked", group=GROUP),
        "parked keys, middle page": link("", "/parked", group=GROUP,
                                         after=json.dumps(["orders", middle_key])),
        "one parked key": link("", "/parked/key", group=GROUP, topic="orders", key=middle_key),
        "held gaps, first page": link("", "/held", group=GROUP),
    }


def measure(url: str, rows: int, keys: int, repeat: int) -> dict[str, float]:
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    start = time.perf_counter()
    fill(engine, rows, keys)
    print(f"  filled {rows} rows, {keys} parked keys in {time.perf_counter() - start:.1f} s")
    client = TestClient(create_app(outbox, operators=Operators(users={"bench": "bench-password-long"})),
                        base_url="http://127.0.0.1")
    auth = ("bench", "bench-password-long")
    timings: dict[str, list[float]] = {}
    targets = pages(outbox, keys)
    for _ in range(2):  # warm caches and statement compilation
        for path in targets.values():
            assert client.get(path, auth=auth).status_code == 200, path
    for _ in range(repeat):
        for name, path in targets.items():  # interleaved: noise hits every page alike
            t0 = time.perf_counter()
            response = client.get(path, auth=auth)
            timings.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 200, (path, response.text[:300])
    engine.dispose()
    return {name: statistics.median(values) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--no-write", action="store_true", help="Print only; leave docs/benchmarks.md.")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with local_postgres_server() as server:
        results = {}
        for label, rows, keys in (("small", 1000, 10), ("large", args.rows, args.keys)):
            with fresh_database(server.url) as url:
                print(f"{label}: {rows} pending rows, {keys} parked keys")
                results[label] = measure(url, rows, keys, args.repeat)
    small, large = results["small"], results["large"]
    ping = large["/ping (SELECT 1)"]
    table = markdown_table(
        ["page", "small ms", "large ms", "large / small", "large / ping"],
        [[name, f"{small[name]:.1f}", f"{large[name]:.1f}", f"**{large[name] / small[name]:.2f}**",
          f"{large[name] / ping:.1f}"] for name in small])
    print(table)
    if args.no_write:
        return
    write_section("console", f"""
## Web console: page time with a big outbox (PostgreSQL)

`python tests/benchmarks/bench_console.py --rows {args.rows} --keys {args.keys} --repeat {args.repeat}`
— medians of {args.repeat} requests per page through the whole app in-process (routing, queries,
Jinja2; no network), interleaved. *small*: 1,000 pending rows, 10 parked keys. *large*:
{args.rows:,} pending rows (1 in 1,000 failed), {args.keys:,} parked keys of 2 messages, {args.keys // 10:,}
held gaps. Baseline: `/ping`, one `SELECT 1` through the same app. Load average
{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (2 shared cores: absolute times are noisy,
the ratios within one run less so).

{table}

Parked keys, one key and held gaps are keyset-paged on their indexes: a page costs what
50 rows cost, with 10 or 10,000 keys. Failed rows read the small partial index of failed,
delayed and retrying rows (`ix_outbox_key_waits`) and sort it, so they grow with the number
of *failed* rows (1,000 here), not with the pending ones; before this change a page walked
the primary key through the pending rows. The overview is `outbox status`'s document: its
backlog counts per topic and shard read every pending row (a parallel scan of the table at
this size), so it grows with the backlog — the price of exact counts; a page that
must stay under ~100 ms at millions of pending rows would need estimated counts.
""")


if __name__ == "__main__":
    main()
