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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _report import TREE, markdown_table, write_section
from bench_inbox import baseline as inbox_baseline
from bench_inbox import inbox_rate
from bench_publish import measure, quantile

from outbox import Inbox, Outbox, create_engine
from outbox.core._sharding import shard_for_key
from outbox.testing import local_mariadb, local_postgres
from outbox.testing._mariadb import sync_driver
from tests.inbox_support import business
from transports.kafka import embedded_kafka

ANALYSIS = """**On MariaDB all three targets are met, in every one of the last five runs of this
command** (before the table above): publish 1.52, 1.56, 1.51, 1.54, 1.50 (target <= 1.6); relay
0.90, 0.98, 0.81, 0.89, 0.84 (>= 0.7; single pairs 0.75 to 1.21); inbox 5.3x, 5.8x, 6.1x, 5.9x,
6.4x (>= 5x). PostgreSQL in the same runs: 1.49 to 1.53, 1.57 to 1.88, 5.8x to 7.4x. The report
before last had 1.85, 0.41 and 3.2x; the last one 1.51 to 1.62, 0.62 to 0.81 and 3.9x to 5.5x,
with the spread mostly the harness's own doing, fixed here:

*The harness.* (1) The inbox run was timed by polling `SELECT count(*)` of the business table
every 20 ms: at 50,000 rows a scan of 4 ms on MariaDB (2 ms on PostgreSQL), a fifth of a core
of two, taken from the inbox's run only (the baseline counts in its own loop). The handlers now
note what they wrote and a `Session` `after_commit` listener adds it up, timing each commit
where it happens; the first commit's messages are no longer counted in the rate (they were).
(2) Every run deletes 50,000 rows, and InnoDB's purge (or PostgreSQL's checkpoint) of them ran
during whichever timed run came next: the raw loop moved between 27,000 and 46,000 msg/s, single
relay pairs between 0.48 and 0.96. Each timed run now starts after a PostgreSQL `CHECKPOINT` and
once MariaDB's purge backlog (`trx_rseg_history_len`) is short; the raw loop now holds 35,000 to
39,000 msg/s, but for a fast pass about one pair in ten (46,000 and 55,000 msg/s; the table's
run has one, its pair 0.53), not explained yet; the median of four pairs absorbs it.

*What changed in the library*, each step measured on its own (py-spy and cProfile):
*Publish (1.85 to ~1.5).* One statement instead of two: a `BEFORE INSERT` trigger bumps the
key's counter for a keyed row that comes without a seq, holding the counter's row lock to
commit as the upsert did (`outbox/core/_mysql.py`; seq order under 8 concurrent writers and
"the later BEGIN that commits first gets seq 1" pass on MariaDB). In an interleaved run the
two-statement publish was 1.77 to 1.82 and the trigger 1.51 to 1.54 of the same baseline.
*Relay (0.41 to ~0.85).* (1) The "does an earlier row block my key" probe read every earlier row
of the key through `ix_outbox_open_key` (no partial indexes): MySQL now has
`ix_outbox_key_waits` on `(topic, key, may_block, seq)`, `may_block` a stored invisible
generated column holding the partial index's predicate, forced with `FORCE INDEX`: the fetch of
5,000 rows half-way through a drain went from 0.19 to 0.25 s to 0.12 s. (2) mysqlclient parses
`DATETIME` text in Python (~4 us a value); `outbox.create_engine` gives it
`datetime.fromisoformat`: 0.12 s to 0.05 s. (3) Batches are pipelined as on PostgreSQL: the
`JSON_TABLE` mark runs while the next batch is fetched and sent.
*Inbox (3.2x to ~6x).* (1) mysqlclient quoted the multi-row dedup `INSERT` and key upsert value
by value in Python, a fifth of a batch: both now pass the batch as one JSON parameter to
`JSON_TABLE`. (2) Valid content types are remembered (the regex was 4.6% of the threads' time).
(3) The workers ran at READ COMMITTED through SQLAlchemy's `isolation_level` execution option,
which sends a `SET` at every checkout and another at every checkin: two of the eight round trips
of a batch (8% of the worker threads' samples). A connection is now switched once, when a worker
takes it, and back only when the application's engine does (`outbox/core/_engine.py`). Its upper
bound, measured first: with the server itself at READ COMMITTED and no switching, four
alternating pairs of inbox runs gave 13,000 to 15,000 msg/s against 12,100 to 13,700 (noisy,
~10%). What is left is spread thin: decoding envelopes (pydantic's
`model_construct`, the JSON check of each payload), the benchmark's own handler (an executemany
the driver quotes), and the server on the same two cores."""

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


def quiesce(*urls: str) -> None:
    """Let both servers finish the last run's background writes before a timed run starts.

    Each run deletes 50,000 rows: InnoDB purges them and PostgreSQL checkpoints and
    vacuums after the fact, on the same two cores and disk as the next timed run —
    whichever of the pair came next paid for it (single relay pairs ranged 0.48 to 0.96).
    PostgreSQL checkpoints now; MariaDB waits (at most 20 s) until its purge backlog
    (the history list) is short.
    """
    for url in urls:
        engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("CHECKPOINT"))
            else:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and (conn.scalar(sa.text(
                        "SELECT count FROM information_schema.INNODB_METRICS"
                        " WHERE name = 'trx_rseg_history_len'")) or 0) > 1000:
                    time.sleep(0.1)
        engine.dispose()


def pending(engine: sa.Engine, outbox: Outbox) -> bool:
    m = outbox.tables.messages
    with engine.connect() as conn:
        return conn.scalar(sa.select(m.c.id).where(m.c.status == "pending").limit(1)) is not None


def last_pending(engine: sa.Engine, outbox: Outbox) -> bool:
    m = outbox.tables.messages
    with engine.connect() as conn:
        return conn.scalar(sa.select(m.c.status).order_by(m.c.id.desc()).limit(1)) == "pending"


def relay_pairs(url: str, servers: str, messages: int, keys: int, pairs: int,
                settle: Callable[[], None]) -> list[tuple[float, float]]:
    engine = create_engine(url)
    outbox = Outbox(engine)
    outbox.create_tables()
    leases = outbox.tables.leases
    results = []
    for _ in range(pairs):
        load(outbox, messages, keys)
        settle()
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
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=TREE)
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
            settle()
            started = time.perf_counter()
            # Watch the last row by its primary key (a lookup of a fraction of a millisecond,
            # so every 10 ms adds little slack to the drain's time), then check the rest once:
            # polling "any pending row?" scans the published rows on MySQL (no partial index)
            # and would slow the relay it measures.
            while last_pending(engine, outbox) or pending(engine, outbox):
                time.sleep(0.01)
            relayed = messages / (time.perf_counter() - started)
        finally:
            relay.terminate()
            relay.wait(60)
        results.append((raw, relayed))
        print(f"  relay: raw loop {raw:,.0f} msg/s, relay {relayed:,.0f} msg/s ({relayed / raw:.2f})",
              flush=True)
    engine.dispose()
    return results


def inbox_pair(url: str, servers: str, messages: int,
               settle: Callable[[], None] = lambda: None) -> tuple[int, float, float]:
    engine = create_engine(url)
    Inbox(engine, group="setup").create_tables()
    business.create_all(engine)
    engine.dispose()
    base_n = min(messages, 10_000)
    settle()
    base = inbox_baseline(servers, url, base_n)
    settle()
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
        def settle() -> None:
            quiesce(pg, maria)
        for name, url in (("PostgreSQL", pg), ("MariaDB", maria)):
            print(name, flush=True)
            settle()
            t = measure(url, args.transactions)
            publish = quantile(t["publish"], 0.5) / quantile(t["baseline"], 0.5)
            print(f"  publish p50 ratio {publish:.2f}", flush=True)
            pairs = relay_pairs(url, servers, args.messages, args.keys, args.pairs, settle)
            raw = statistics.median(r for r, _ in pairs)
            relayed = statistics.median(x for _, x in pairs)
            _, base, batched = inbox_pair(url, servers, args.messages, settle)
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
