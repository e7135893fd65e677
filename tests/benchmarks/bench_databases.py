"""The three headline ratios on MariaDB beside PostgreSQL, in one run, each against its own baseline.

Both servers are throwaway and durable (PostgreSQL: fsync and synchronous_commit
on; MariaDB: InnoDB flushes its log at every commit), the broker is librdkafka's
mock cluster in this process.

1. publish(): p50 of BEGIN / INSERT a business row / publish() / COMMIT over the
   same transaction without publish() (``bench_publish.measure``). Target <= 1.6.
2. relay: one ``outbox relay`` process draining the outbox, against a process
   that only does SELECT 5000 pending rows / produce them / flush / one
   ``UPDATE … WHERE id IN (…)``; the two alternate (``--pairs``), ratio of the
   medians. Target >= 0.7. On MariaDB the relay polls (no LISTEN/NOTIFY); it runs with
   ``--poll-interval 0.05`` so that the drain, timed from the load's commit, includes at
   most 50 ms of its first poll (a full batch fetches again at once, whatever the interval).
3. inbox: ``@inbox.batch_handler`` against a plain consumer committing every
   message (``bench_inbox``). Target >= 5x.

    python tests/benchmarks/bench_databases.py [--transactions N] [--messages N] [--pairs N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _report import markdown_table, write_section
from bench_inbox import baseline as inbox_baseline
from bench_inbox import inbox_rate
from bench_publish import measure, quantile

from outbox import Inbox, Outbox, create_engine
from outbox._sharding import shard_for_key
from outbox.testing import local_mariadb, local_postgres
from outbox.testing._mariadb import sync_driver
from tests.inbox_support import business
from transports.kafka import embedded_kafka

ANALYSIS = """**On MariaDB the three targets are still not met.** The machine
is shared (two cores, a CI run and another job beside this one; see the load average): the
ratios move by a third from run to run on both servers — PostgreSQL's publish ratio was
1.19 in the previous run and 1.66 in this one, its relay ratio 1.09 and 1.46, with no change
to its path: in this run it misses its publish target by that noise.
What changed since the previous run (relay 0.18, inbox 2.9x at load 6 to 20): the MariaDB server
is reached through mysqlclient instead of PyMySQL, the relay polls every 0.05 s instead of
0.5 s, and the inbox sends five statements a batch instead of eight on MySQL/MariaDB.

*Relay (0.41).* Not a poll wait: after a full batch the relay fetches again at once
(`tests/test_relay_loop.py::test_a_full_batch_is_followed_by_a_fetch_at_once_not_a_poll_wait`,
on SQLite, PostgreSQL and MariaDB); only the first poll after the load was inside the timed
drain. A cProfile of the `outbox relay` process's loop puts a 5,000-row batch at ~0.76 s with
PyMySQL (its fetch 0.42 s: 3.8 s of 12.7 s went to PyMySQL's pure-Python row and DATETIME
decoding) and ~0.34 s with mysqlclient: the fetch ~0.16 s (statement and decoding), building records
0.035 s, produce and flush 0.045 s, the `JSON_TABLE` mark 0.11 s — the raw loop does a whole
batch in ~0.17 s. The fetch is the gap: `EXPLAIN` shows a scan of the primary key in id order
with a dependent subquery per row, the "does an earlier row block my key" probe, on
`ix_outbox_open_key`. Without partial indexes that index holds every row, so the probe
walks all earlier rows of the key, published ones too, each through a clustered-index lookup
for its status: 0.16 to 0.25 s for 5,000 rows half-way through the drain, against 0.07 to 0.14 s for
the same 12 columns without the probe and 0.015 s for the raw loop's 4. A covering index
(`topic, key, seq, status, available_at, created_at`) halved the probe in a trial; making it
is a schema change (an upgrade step), not done here. The cost grows with a key's published
history until GC removes it. The mark is not pipelined on MySQL (PostgreSQL writes a batch's
outcomes while the next one is fetched; on MySQL the fetch cannot yet exclude the rows being
written: a try with `id NOT IN (SELECT id FROM JSON_TABLE(:busy …))` drained at 5,800 and
7,900 msg/s against ~12,000 without it, and was not kept).
*Publish (1.85).* Unchanged: two round trips (the seq upsert, the row insert) on a
business transaction of one insert and a flush; mysqlclient makes both sides faster, not the
ratio (1.76 against 1.77 in an A/B run). One statement would need a trigger on
`outbox_messages` or multi-statement packets (`CLIENT_MULTI_STATEMENTS` on the caller's
connection); an `INSERT … SELECT MAX(seq)` (reasoned, not tried) would take shared next-key
locks that concurrent writers of a key deadlock on, and restart seqs after GC.
*Inbox (3.2x).* A batch of ~400 messages now sends five statements: the key lock and the
successor lookup (both joins from `JSON_TABLE`; the
lookup was two 200-range `OR`s at ~8 ms each), the dedup insert (no savepoint now: InnoDB
undoes only the statement that meets a duplicate key), the handler's insert and the key
advance. The two inserts dominate (~30 to 45 ms each per batch under this load), and the
baseline is a fast one: MariaDB commits one message at a time at 1,600 msg/s here."""

PAYLOAD = b'{"order":"o-1","status":"paid","total":"19.90","currency":"EUR","lines":[{"sku":"A-1","qty":2}]}'
BATCH = 5000


def raw_loop(url: str, servers: str) -> None:
    """The relay's baseline, in its own process: select / produce / flush / update. Prints msg/s."""
    from confluent_kafka import Producer

    engine = sa.create_engine(url)
    m = Outbox(engine).tables.messages
    producer = Producer({"bootstrap.servers": servers, "enable.idempotence": True, "acks": "all",
                         "linger.ms": 5, "compression.type": "lz4", "log_level": 3})
    producer.list_topics("bench", timeout=10)
    sent, started = 0, time.perf_counter()
    while True:
        with engine.begin() as conn:
            rows = conn.execute(sa.select(m.c.id, m.c.topic, m.c.key, m.c.payload)
                                .where(m.c.status == "pending").order_by(m.c.id).limit(BATCH)).all()
            if not rows:
                break
            for row in rows:
                producer.produce(row.topic, row.payload, key=row.key.encode())
            producer.flush(30)
            conn.execute(sa.update(m).where(m.c.id.in_([r.id for r in rows])).values(status="published"))
        sent += len(rows)
    print(sent / (time.perf_counter() - started))


def load(outbox: Outbox, messages: int, keys: int) -> None:
    """Replace the outbox with ``messages`` fresh pending rows, committed at once."""
    m, now, rng, seq = outbox.tables.messages, datetime.now(UTC), random.Random(1), {}
    rows = []
    for _ in range(messages):
        key = f"key-{rng.randrange(keys)}"
        seq[key] = seq.get(key, 0) + 1
        rows.append({"message_id": uuid.uuid4(), "topic": "bench", "key": key, "seq": seq[key],
                     "shard": shard_for_key(key, 16), "payload": PAYLOAD,
                     "content_type": "application/json", "headers": {}, "created_at": now,
                     "available_at": now, "attempts": 0, "status": "pending"})
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        conn.execute(sa.delete(m))
        for start in range(0, messages, 5000):
            conn.execute(sa.insert(m), rows[start:start + 5000])
    # Fresh statistics, as a table in service has: planned on an "empty" table, the relay's
    # per-row "does an earlier row block my key" probe can become a scan per row.
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        analyze = "ANALYZE" if conn.dialect.name == "postgresql" else "ANALYZE TABLE"
        conn.execute(sa.text(f"{analyze} {m.name}"))
        conn.commit()


def pending(engine: sa.Engine, outbox: Outbox) -> bool:
    m = outbox.tables.messages
    with engine.connect() as conn:
        return conn.scalar(sa.select(m.c.id).where(m.c.status == "pending").limit(1)) is not None


def last_pending(engine: sa.Engine, outbox: Outbox) -> bool:
    m = outbox.tables.messages
    with engine.connect() as conn:
        return conn.scalar(sa.select(m.c.status).order_by(m.c.id.desc()).limit(1)) == "pending"


def relay_pairs(url: str, servers: str, messages: int, keys: int, pairs: int) -> list[tuple[float, float]]:
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    leases = outbox.tables.leases
    results = []
    for _ in range(pairs):
        load(outbox, messages, keys)
        out = subprocess.run([sys.executable, __file__, "--raw", url, servers],
                             capture_output=True, text=True, check=True)
        raw = float(out.stdout.strip().splitlines()[-1])
        with engine.begin() as conn:
            conn.execute(sa.delete(outbox.tables.messages))
        worker = f"bench-{uuid.uuid4().hex[:6]}"  # a namesake would wait for the last run's leases
        relay = subprocess.Popen(
            [sys.executable, "-m", "outbox", "relay", "--db", url, "--bootstrap-servers", servers,
             "--batch-size", str(BATCH), "--worker-id", worker, "--log-level", "WARNING",
             "--poll-interval", "0.05"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                with engine.connect() as conn:
                    owned = conn.scalar(sa.select(sa.func.count()).select_from(leases)
                                        .where(leases.c.owner == worker))
                if owned == 16:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the relay took no leases")
                time.sleep(0.1)
            load(outbox, messages, keys)
            started = time.perf_counter()
            # Watch the last row by its primary key, then check the rest once: polling
            # "any pending row?" every 50 ms scans the published rows on MySQL (no partial
            # index) and would slow the relay it measures.
            while last_pending(engine, outbox) or pending(engine, outbox):
                time.sleep(0.05)
            relayed = messages / (time.perf_counter() - started)
        finally:
            relay.terminate()
            relay.wait(60)
        results.append((raw, relayed))
        print(f"  relay: raw loop {raw:,.0f} msg/s, relay {relayed:,.0f} msg/s ({relayed / raw:.2f})",
              flush=True)
    engine.dispose()
    return results


def inbox_pair(url: str, servers: str, messages: int) -> tuple[int, float, float]:
    engine = create_engine(url)
    Inbox(engine, group="setup").create_tables()
    business.create_all(engine)
    engine.dispose()
    base_n = min(messages, 10_000)
    base = inbox_baseline(servers, url, base_n)
    batched = inbox_rate(servers, url, messages, 1000, concurrency=2, batch_size=500, batch_handler=True)
    print(f"  inbox: commit per message {base:,.0f} msg/s, batch handler {batched:,.0f} msg/s", flush=True)
    return base_n, base, batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=50_000, help="relay and inbox runs")
    parser.add_argument("--keys", type=int, default=5_000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--raw", nargs=2, metavar=("URL", "SERVERS"))
    args = parser.parse_args()
    if args.raw:
        raw_loop(*args.raw)
        return
    load_before = os.getloadavg()[0]
    rows = []
    with (local_postgres(settings={}) as pg, local_mariadb(durable=True) as maria_server,
          embedded_kafka() as servers):
        maria = _database(maria_server)
        for name, url in (("PostgreSQL", pg), ("MariaDB", maria)):
            print(name, flush=True)
            t = measure(url, args.transactions)
            publish = quantile(t["publish"], 0.5) / quantile(t["baseline"], 0.5)
            print(f"  publish p50 ratio {publish:.2f}", flush=True)
            pairs = relay_pairs(url, servers, args.messages, args.keys, args.pairs)
            raw = statistics.median(r for r, _ in pairs)
            relayed = statistics.median(x for _, x in pairs)
            _, base, batched = inbox_pair(url, servers, args.messages)
            rows.append([name, f"**{publish:.2f}**", f"{raw:,.0f}", f"{relayed:,.0f}",
                         f"**{relayed / raw:.2f}**", f"{base:,.0f}", f"{batched:,.0f}",
                         f"**{batched / base:.1f}x**"])

    driver = {"mysqldb": "mysqlclient", "pymysql": "PyMySQL"}[sync_driver()]
    write_section("databases", f"""## MariaDB beside PostgreSQL

`python tests/benchmarks/bench_databases.py --transactions {args.transactions}
--messages {args.messages} --pairs {args.pairs}` — one run, both servers throwaway and
durable (PostgreSQL fsync and synchronous_commit on; MariaDB 10.11 with
`innodb_flush_log_at_trx_commit=1`, through {driver}), librdkafka's mock cluster in the process.
Each figure is a ratio to a baseline measured in the same run on the same server:
**publish** — p50 of BEGIN / INSERT a business row / `publish()` / COMMIT over the same without
`publish()`, {args.transactions:,} each, interleaved (target ≤ 1.6); **relay** — one `outbox relay`
process (`--batch-size {BATCH}`) draining {args.messages:,} messages over {args.keys:,} keys, against a
process that only SELECTs {BATCH} pending rows / produces / flushes / runs one `UPDATE … IN`,
medians of {args.pairs} alternating pairs (target ≥ 0.7; on MariaDB the relay polls, here every
0.05 s, so the timed drain includes at most 50 ms of waiting for its first poll); **inbox** —
`@inbox.batch_handler` (batch_size 500, concurrency 2, dedup and key order on) over
{args.messages:,} messages against a plain consumer committing every message (target ≥ 5x).
Load average before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f}.

{markdown_table(["database", "publish p50 ratio", "raw loop msg/s", "relay msg/s", "relay / raw",
                 "commit per message msg/s", "inbox batch handler msg/s", "inbox / commit per message"],
                rows)}

{ANALYSIS}""")


def _database(server_url: str) -> str:
    """A database of its own on the MariaDB server (the server URL names the ``mysql`` schema)."""
    engine = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("CREATE DATABASE bench CHARACTER SET utf8mb4"))
    engine.dispose()
    return sa.make_url(server_url).set(database="bench").render_as_string(hide_password=False)


if __name__ == "__main__":
    main()
