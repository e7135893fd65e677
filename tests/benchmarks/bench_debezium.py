"""Our relay against Debezium's outbox event router: one run, one machine, one PostgreSQL, one
Apache Kafka, the same messages.

Both sides run against the same durable PostgreSQL (fsync, synchronous_commit and
full_page_writes on; ``wal_level=logical`` for Debezium, on for both) and the same
local Apache Kafka 4.3.0 (``LocalKafka``), in turns, never at once: while one side
runs, the other is stopped (our relay process ended; Debezium's connector in
Kafka Connect's STOPPED state, so no walsender decodes the other side's WAL).

- **throughput**: 100,000 messages of about 200 bytes of JSON over 10,000 keys are
  committed in 100 transactions of 1,000 rows, back to back; the time from the first
  commit to the last record on the topic (the topic's end offsets, polled every 20 ms).
  Ours: rows copied into ``outbox_messages`` (seq and shard computed beforehand), the
  ``outbox relay`` process draining them. Debezium: rows copied into a Debezium-layout
  ``outboxevent`` table, Debezium 3.6.1's PostgreSQL connector with the ``EventRouter``
  on a standalone Kafka Connect 4.3.0 worker. Each side with its defaults, and tuned.
- **latency**: writer threads commit 1,000 messages/s, one per transaction (ours through
  ``publish()``, Debezium's an INSERT), for ``--seconds``; latency is the record's broker
  append time (the topic has ``message.timestamp.type=LogAppendTime``: one clock, the
  broker's, for both sides) minus the writer's commit time.
- **cost**: CPU seconds of the relay process and of the Connect JVM (``/proc/PID/stat``
  utime+stime), and of PostgreSQL (the postmaster with its children, ended ones
  included) over each timed window; WAL bytes (``pg_current_wal_lsn()`` before and
  after) and row writes (``pg_stat_user_tables``) per message.
- **order**: after each throughput round the topic is read back: every key on one
  partition, its messages in the order they were committed.

    python tests/benchmarks/bench_debezium.py [--messages 100000] [--keys 10000] [--rounds 3]
        [--rate 1000] [--seconds 20]

``--only-ours`` runs our relay's throughput rounds alone (no Connect, no latency runs, no report
written), and ``--ours-latency`` its latency runs alone: for studying our side, as for issue 37
(``--tuned-batch-size`` sets its tuned runs' batch size). ``--analyze`` ANALYZEs the outbox after each
throughput round, when every row is published: what autovacuum does at a moment of its own
choosing, which made 2 of 6 rounds of ours 3-8x slower before the relay's statements were made
to keep their plans on such statistics (docs/benchmarks.md, "What the race says").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
from _race import (
    PARTITIONS,
    STATS,
    EndOffsets,
    Window,
    messages_of,
    order_on_the_wire,
    payload,
    read_back,
    row_counts,
    snapshot,
    window,
)
from _report import TREE, markdown_table, write_section

from outbox import Outbox, create_engine
from outbox.core._sharding import shard_for_key
from outbox.testing import (
    DebeziumOutbox,
    LocalKafka,
    LocalKafkaConnect,
    LocalPostgres,
    create_topic,
    debezium_outbox_table,
)

CHUNK = 1_000
DURABLE_LOGICAL = {"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10"}
DEBEZIUM_TUNED = {"poll.interval.ms": "10", "max.batch.size": "8192", "max.queue.size": "32768",
                  "producer.override.linger.ms": "5", "producer.override.batch.size": "262144",
                  "producer.override.compression.type": "lz4"}
"""Debezium tuned as its docs suggest for throughput and latency: a short poll interval, larger
batches and queue, and the producer batching as our relay's does (linger 5 ms, lz4)."""
OURS_TUNED = ("--batch-size", "20000")


# -- the two sides ----------------------------------------------------------------------------

class Ours:
    """Our relay: an ``outbox relay`` process over ``outbox_messages``."""

    name = "our relay"

    def __init__(self, url: str, bootstrap: str, engine: sa.Engine,
                 messages: list[tuple[str, int, dict[str, object]]]) -> None:
        self.url, self.bootstrap, self.engine = url, bootstrap, engine
        self.outbox = Outbox(engine)
        self.outbox.create_tables()
        self.process: subprocess.Popen[bytes] | None = None
        rows = [{"rn": i, "message_id": uuid.uuid4(), "key": key, "seq": n,
                 "shard": shard_for_key(key, self.outbox.shards),
                 "payload": json.dumps(body).encode()} for i, (key, n, body) in enumerate(messages)]
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE bench_ours (rn int PRIMARY KEY, message_id uuid, key text, "
                                 "seq bigint, shard int, payload bytea)"))
            conn.execute(sa.text("INSERT INTO bench_ours VALUES (:rn, :message_id, :key, :seq, :shard, "
                                 ":payload)"), rows)

    def start(self, *extra: str) -> int:
        with self.engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE outbox_messages, outbox_keys"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "outbox", "relay", "--db", self.url, "--bootstrap-servers", self.bootstrap,
             "--worker-id", "bench", "--log-level", "WARNING", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=TREE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.engine.connect() as conn:
                leased = conn.execute(sa.text("SELECT count(*) FROM outbox_leases WHERE owner = 'bench' "
                                              "AND expires_at > now()")).scalar_one()
            if leased == self.outbox.shards:
                return self.process.pid
            time.sleep(0.2)
        raise RuntimeError("the relay did not take the shards")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(60)

    def load_chunk(self, conn: sa.Connection, topic: str, first: int, last: int) -> None:
        conn.execute(sa.text(
            "INSERT INTO outbox_messages (message_id, topic, key, seq, shard, payload, content_type, "
            "headers, created_at, available_at, attempts, status) SELECT message_id, :topic, key, seq, "
            "shard, payload, 'application/json', '{}', now(), now(), 0, 'pending' FROM bench_ours "
            "WHERE rn BETWEEN :a AND :b ORDER BY rn"), {"topic": topic, "a": first, "b": last})
        conn.execute(sa.text("SELECT pg_notify('outbox', '0')"))  # what publish() sends at commit

    @staticmethod
    def id_of(headers: dict[str, bytes]) -> str:
        return headers["outbox-message-id"].decode()

    @staticmethod
    def topic(kind: str) -> str:
        return f"ours.{kind}"


class Debezium:
    """Debezium's outbox event router on a Kafka Connect worker over ``outboxevent``."""

    name = "Debezium"

    def __init__(self, url: str, bootstrap: str, engine: sa.Engine,
                 messages: list[tuple[str, int, dict[str, object]]]) -> None:
        self.engine = engine
        self.connect = LocalKafkaConnect(bootstrap, heap="1g", settings={
            "connector.client.config.override.policy": "All", "offset.flush.interval.ms": "10000"})
        self.router = DebeziumOutbox(self.connect, url, bootstrap)
        self.defaults = dict(self.router.config)
        rows = [{"rn": i, "id": uuid.uuid4(), "key": key, "payload": json.dumps(body)}
                for i, (key, _, body) in enumerate(messages)]
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE bench_dbz (rn int PRIMARY KEY, id uuid, key text, "
                                 "payload jsonb)"))
            conn.execute(sa.text("INSERT INTO bench_dbz VALUES (:rn, :id, :key, CAST(:payload AS jsonb))"),
                         rows)
        self._stop_connector()

    def start(self, tuned: bool = False) -> int:
        with self.engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE outboxevent"))
        config = {**self.defaults, **(DEBEZIUM_TUNED if tuned else {})}
        self.connect.put_connector(self.router.name, config)
        self.connect._call("PUT", f"/connectors/{self.router.name}/resume")
        self.connect.wait_running(self.router.name)
        self._caught_up()
        assert self.connect.pid is not None
        return self.connect.pid

    def _caught_up(self, timeout: float = 300) -> None:
        """Wait until the connector's walsender has read the WAL written while it was stopped (our
        relay's rounds: decoded, and filtered out by the publication), so that it is not timed."""
        deadline = time.monotonic() + timeout
        with self.engine.connect() as conn:
            target = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
            while time.monotonic() < deadline:
                sent = conn.execute(sa.text(
                    "SELECT r.sent_lsn >= CAST(:target AS pg_lsn) FROM pg_stat_replication r "
                    "JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = :slot"),
                    {"target": target, "slot": self.router.slot}).scalar()
                conn.rollback()
                if sent:
                    return
                time.sleep(0.2)
        print(f"warning: the walsender did not reach {target} within {timeout:.0f} s", flush=True)

    def stop(self) -> None:
        self._stop_connector()

    def _stop_connector(self) -> None:
        """STOPPED: the task is shut down and its replication connection closed."""
        self.connect._call("PUT", f"/connectors/{self.router.name}/stop")
        deadline = time.monotonic() + 60
        with self.engine.connect() as conn:
            while conn.execute(sa.text("SELECT active FROM pg_replication_slots WHERE slot_name = :s"),
                               {"s": self.router.slot}).scalar() and time.monotonic() < deadline:
                time.sleep(0.2)
                conn.rollback()

    def load_chunk(self, conn: sa.Connection, topic: str, first: int, last: int) -> None:
        kind = topic.removeprefix("outbox.event.")
        conn.execute(sa.text(
            "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) SELECT id, :kind, key, "
            "'OrderChanged', payload FROM bench_dbz WHERE rn BETWEEN :a AND :b ORDER BY rn"),
            {"kind": kind, "a": first, "b": last})


    @staticmethod
    def id_of(headers: dict[str, bytes]) -> str:
        return headers["id"].decode()

    @staticmethod
    def topic(kind: str) -> str:
        return DebeziumOutbox.topic(kind)

    def close(self) -> None:
        self.router.close()
        self.connect.close()


Side = Ours | Debezium


# -- runs ----------------------------------------------------------------------------------------

def throughput(side: Side, start: Callable[[], int], server: LocalPostgres, engine: sa.Engine,
               offsets: EndOffsets, bootstrap: str, messages: int) -> Window:
    topic = side.topic(f"tp-{uuid.uuid4().hex[:8]}")
    create_topic(bootstrap, topic, PARTITIONS)
    pid = start()
    try:
        rows_before = row_counts(engine)
        before = snapshot(engine, server, pid)
        first_commit = loaded = 0.0
        for chunk in range(0, messages, CHUNK):
            with engine.begin() as conn:
                side.load_chunk(conn, topic, chunk, chunk + CHUNK - 1)
            loaded = time.perf_counter()
            first_commit = first_commit or loaded
        done = offsets.wait(topic, messages)
        after = snapshot(engine, server, pid)
    finally:
        side.stop()
    result = window(before, after, rows_before, row_counts(engine), messages, done - first_commit)
    records = read_back(bootstrap, topic, messages)
    result.extra.update(order=order_on_the_wire(records), load_seconds=loaded - first_commit,
                        value_bytes=statistics.mean(len(v) for _, _, v, _, _ in records),
                        header_bytes=statistics.mean(sum(len(n) + len(v or b"") for n, v in h.items())
                                                     for _, _, _, h, _ in records),
                        records=len(records))
    return result


WRITERS = 8


def latency(side: Side, start: Callable[[], int], server: LocalPostgres, engine: sa.Engine,
            offsets: EndOffsets, bootstrap: str, url: str, rate: int, seconds: float, keys: int) -> Window:
    """Writer processes (``--writer``) commit ``rate`` messages/s in all; each prints its commits."""
    topic = side.topic(f"lat-{uuid.uuid4().hex[:8]}")
    create_topic(bootstrap, topic, PARTITIONS, config={"message.timestamp.type": "LogAppendTime"})
    pid = start()
    try:
        rows_before = row_counts(engine)
        time.sleep(1)
        before = snapshot(engine, server, pid)
        writers = [subprocess.Popen(
            [sys.executable, __file__, "--writer", type(side).__name__, url, topic, str(rate / WRITERS),
             str(seconds), str(keys // WRITERS), str(w)], stdout=subprocess.PIPE, text=True)
            for w in range(WRITERS)]
        committed: dict[str, float] = {}
        for writer in writers:
            out, _ = writer.communicate(timeout=seconds * 10 + 120)
            committed.update(json.loads(out))
        offsets.wait(topic, len(committed))
        after = snapshot(engine, server, pid)
    finally:
        side.stop()
    result = window(before, after, rows_before, row_counts(engine), len(committed), after.at - before.at)
    records = read_back(bootstrap, topic, len(committed))
    ms = sorted(at - committed[side.id_of(h)] * 1000 for _, _, _, h, at in records)
    q = statistics.quantiles(ms, n=100)
    commits = committed.values()
    result.extra.update(p50=q[49], p99=q[98], achieved=len(committed) / (max(commits) - min(commits)),
                        order=order_on_the_wire(records))
    return result


def writer(kind: str, url: str, topic: str, rate: float, seconds: float, keys: int, w: int) -> None:
    """One writer process: ``rate`` messages/s for ``seconds``, one per transaction; prints
    {event id: commit time} as JSON."""
    engine = create_engine(url, pool_size=1)
    write: Callable[[str, dict[str, object]], str]
    if kind == "Ours":
        outbox = Outbox(engine)

        def write(key: str, body: dict[str, object]) -> str:
            with outbox._sessions() as session, session.begin():
                return str(outbox.publish(session, topic, body, key=key))
    else:
        table = debezium_outbox_table()
        kind_name = topic.removeprefix("outbox.event.")

        def write(key: str, body: dict[str, object]) -> str:
            event_id = uuid.uuid4()
            with engine.begin() as conn:
                conn.execute(table.insert().values(id=event_id, aggregatetype=kind_name, aggregateid=key,
                                                   type="OrderChanged", payload=body))
            return str(event_id)

    committed: dict[str, float] = {}
    counters: dict[str, int] = {}
    interval, began = 1 / rate, time.perf_counter()
    for n in range(int(rate * seconds)):
        if (delay := began + n * interval - time.perf_counter()) > 0:
            time.sleep(delay)
        key = f"w{w}-{n % keys}"
        counters[key] = counters.get(key, 0) + 1
        event_id = write(key, payload(key, counters[key], n))
        committed[event_id] = time.time()
    engine.dispose()
    print(json.dumps(committed))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--only-ours", action="store_true",
                        help="our relay's throughput rounds only: no Debezium, no latency runs, no report")
    parser.add_argument("--tuned-batch-size", type=int, default=int(OURS_TUNED[1]),
                        help="our relay's --batch-size in its tuned throughput runs")
    parser.add_argument("--ours-latency", action="store_true",
                        help="our relay's latency runs only: no Debezium, no throughput runs, no report")
    parser.add_argument("--analyze", action="store_true",
                        help="ANALYZE outbox_messages after each throughput round (all rows published)")
    parser.add_argument("--writer", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        kind, url, topic, rate, seconds, keys, w = args.writer
        writer(kind, url, topic, float(rate), float(seconds), int(keys), int(w))
        return
    load_before = os.getloadavg()
    messages = messages_of(args.messages, args.keys)
    server = LocalPostgres(DURABLE_LOGICAL)
    broker = LocalKafka()
    results: dict[str, list[Window]] = {}
    try:
        engine = create_engine(server.url, pool_size=10)
        offsets = EndOffsets(broker.bootstrap)
        ours = Ours(server.url, broker.bootstrap, engine, messages)
        runs: list[tuple[str, Side, Callable[[], int]]] = [
            ("throughput: our relay, defaults", ours, lambda: ours.start()),
            (f"throughput: our relay, --batch-size {args.tuned_batch_size}", ours,
             lambda: ours.start("--batch-size", str(args.tuned_batch_size))),
        ]
        if not args.only_ours and not args.ours_latency:
            dbz = Debezium(server.url, broker.bootstrap, engine, messages)
            print(f"ready: {broker!r}, {dbz.connect!r}", flush=True)
            runs.insert(1, ("throughput: Debezium, defaults", dbz, lambda: dbz.start()))
            runs.append(("throughput: Debezium, tuned", dbz, lambda: dbz.start(tuned=True)))
        for n in range(0 if args.ours_latency else args.rounds):
            for name, side, start in runs:
                reads = index_reads(engine)
                w = throughput(side, start, server, engine, offsets, broker.bootstrap, args.messages)
                results.setdefault(name, []).append(w)
                print(f"round {n + 1} {name}: {w.rate:,.0f} msg/s, {w.per_100k(w.side_cpu):.1f} s CPU/100k, "
                      f"pg {w.per_100k(w.pg_cpu):.1f} s/100k, WAL {w.wal / w.messages:.0f} B/msg, "
                      f"{w.extra['order']}, load {w.load[0]:.1f}/{w.load[1]:.1f}", flush=True)
                if side is ours:
                    read = {index: count - reads.get(index, 0)
                            for index, count in index_reads(engine).items()}
                    print(f"  index entries read: {read}", flush=True)
                if args.analyze:
                    with engine.begin() as conn:
                        conn.execute(sa.text("ANALYZE outbox_messages"))
        if args.only_ours:
            engine.dispose()
            return
        lat_runs: list[tuple[str, Side, Callable[[], int]]] = [
            ("latency: our relay, defaults", ours, lambda: ours.start())]
        if not args.ours_latency:
            lat_runs += [("latency: Debezium, defaults", dbz, lambda: dbz.start()),
                         ("latency: Debezium, tuned", dbz, lambda: dbz.start(tuned=True))]
        for n in range(args.rounds):
            for name, side, start in lat_runs:
                w = latency(side, start, server, engine, offsets, broker.bootstrap, server.url, args.rate,
                            args.seconds, args.keys)
                results.setdefault(name, []).append(w)
                print(f"round {n + 1} {name}: p50 {w.extra['p50']:.1f} ms, p99 {w.extra['p99']:.1f} ms at "
                      f"{w.extra['achieved']:.0f} msg/s, {w.per_100k(w.side_cpu):.1f} s CPU/100k, "
                      f"WAL {w.wal / w.messages:.0f} B/msg, rows {w.rows}, "
                      f"load {w.load[0]:.1f}/{w.load[1]:.1f}",
                      flush=True)
        if args.ours_latency:
            engine.dispose()
            return
        connect_log = dbz.connect.log_path.read_text(errors="replace")
        dbz.close()
        engine.dispose()
    finally:
        broker.close()
        server.remove()
    report(args, results, load_before, os.getloadavg(), producer_settings(connect_log))


def index_reads(engine: sa.Engine) -> dict[str, int]:
    """Index entries read so far per index of outbox_messages (``idx_tup_read``): which index each
    round's statements walked, and how far."""
    with engine.connect() as conn:
        return {r.indexrelname: r.idx_tup_read for r in conn.execute(sa.text(
            "SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes WHERE relname = 'outbox_messages'"))}


def producer_settings(log: str) -> str:
    """What Connect's producer for the task was configured with (its log's ProducerConfig values)."""
    wanted = ("acks", "enable.idempotence", "linger.ms", "batch.size",
              "max.in.flight.requests.per.connection",
              "compression.type")
    found: dict[str, str] = {}
    for line in log.splitlines():
        stripped = line.strip()
        for name in wanted:
            if stripped.startswith(f"{name} = ") and name not in found:
                found[name] = stripped.split(" = ", 1)[1]
    return ", ".join(f"{k}={v}" for k, v in found.items())


def report(args: argparse.Namespace, results: dict[str, list[Window]], before: tuple[float, ...],
           after: tuple[float, ...], producer: str) -> None:
    def med(name: str, value: Callable[[Window], float]) -> float:
        return statistics.median(value(w) for w in results[name])

    rows = []
    for name, windows in results.items():
        if not name.startswith("throughput"):
            continue
        for n, w in enumerate(windows):
            rows.append([name.removeprefix("throughput: "), n + 1, f"{w.rate:,.0f}",
                         f"{w.extra['load_seconds']:.1f}", f"{w.per_100k(w.side_cpu):.1f}",
                         f"{w.per_100k(w.pg_cpu):.1f}", f"{w.wal / w.messages:,.0f}", f"{w.row_writes():.2f}",
                         w.extra["order"], f"{w.load[0]:.1f} / {w.load[1]:.1f}"])
    medians = [[name.removeprefix("throughput: "), f"**{med(name, lambda w: w.rate):,.0f}**",
                f"{med(name, lambda w: w.per_100k(w.side_cpu)):.1f}",
                f"{med(name, lambda w: w.per_100k(w.pg_cpu)):.1f}",
                f"{med(name, lambda w: w.wal / w.messages):,.0f}",
                f"{statistics.mean(w.extra['value_bytes'] for w in results[name]):.0f} + "
                f"{statistics.mean(w.extra['header_bytes'] for w in results[name]):.0f}"]
               for name in results if name.startswith("throughput")]
    lat_rows = []
    for name, windows in results.items():
        if not name.startswith("latency"):
            continue
        for n, w in enumerate(windows):
            r = w.rows
            lat_rows.append([name.removeprefix("latency: "), n + 1, f"{w.extra['achieved']:,.0f}",
                             f"{w.extra['p50']:.1f}", f"{w.extra['p99']:.1f}",
                             f"{w.per_100k(w.side_cpu):.1f}",
                             f"{w.per_100k(w.pg_cpu):.1f}", f"{w.wal / w.messages:,.0f}",
                             " / ".join(f"{sum(r[t])}" for t in STATS), w.extra["order"],
                             f"{w.load[0]:.1f} / {w.load[1]:.1f}"])
    ours_rate = med("throughput: our relay, defaults", lambda w: w.rate)
    dbz_rate = med("throughput: Debezium, defaults", lambda w: w.rate)
    ours_p99 = med("latency: our relay, defaults", lambda w: w.extra["p99"])  # type: ignore[arg-type, return-value]
    dbz_p99 = min(med(n, lambda w: w.extra["p99"]) for n in results  # type: ignore[arg-type, return-value]
                  if n.startswith("latency: Debezium"))
    body = f"""## Our relay against Debezium's outbox event router

`python tests/benchmarks/bench_debezium.py --messages {args.messages} --keys {args.keys}
--rounds {args.rounds} --rate {args.rate} --seconds {args.seconds:g}
--tuned-batch-size {args.tuned_batch_size}` — one run: one durable
PostgreSQL (fsync, synchronous_commit, full_page_writes on; `wal_level=logical`), one local Apache
Kafka 4.3.0, the same {args.messages:,} messages (about 200 bytes of JSON each, over {args.keys:,}
keys). The sides take turns, never at once.
Ours: the `outbox relay` process. Debezium: Debezium 3.6.1.Final's PostgreSQL connector (pgoutput)
with the outbox `EventRouter`, on a standalone Kafka Connect 4.3.0 worker (`-Xmx1g`, StringConverter),
over a Debezium-layout table. "Tuned": ours `--batch-size {args.tuned_batch_size}`; Debezium
`{", ".join(f"{k}={v}" for k, v in DEBEZIUM_TUNED.items())}`. Connect's producer as logged: {producer}.
Load average (1, 5, 15 min) before: {before[0]:.1f}, {before[1]:.1f}, {before[2]:.1f}; after: {after[0]:.1f},
{after[1]:.1f}, {after[2]:.1f} — other jobs shared the two cores.

**Throughput**, rows committed (100 transactions of {CHUNK:,} rows, back to back) → records on the topic;
CPU seconds per 100,000 messages of the side's process (relay process / Connect JVM) and of PostgreSQL;
WAL and row writes (`pg_stat_user_tables`: inserts + updates + deletes) per message over the window,
the load included; per-key order read back from the topic. Every round:

{markdown_table(["side", "round", "msg/s", "load s", "side CPU s/100k", "PostgreSQL CPU s/100k",
                 "WAL B/msg", "row writes/msg", "order on the wire", "load avg before / after"], rows)}

Medians:

{markdown_table(["side", "msg/s", "side CPU s/100k", "PostgreSQL CPU s/100k", "WAL B/msg",
                 "record bytes (value + headers)"], medians)}

Ours / Debezium, defaults: **{ours_rate / dbz_rate:.2f}x** (target ≥ 1.0x:
{"met" if ours_rate >= dbz_rate else "**not met**"}).

**Latency** at a fixed {args.rate:,} msg/s ({args.seconds:g} s, one message per
transaction, {WRITERS} writer processes: ours through `publish()`, Debezium's an INSERT into `outboxevent`),
commit → the record's
broker append time (`LogAppendTime`); rows written per table in the window (outbox_messages / outbox_keys /
outboxevent). Every round:

{markdown_table(["side", "round", "achieved msg/s", "p50 ms", "p99 ms", "side CPU s/100k",
                 "PostgreSQL CPU s/100k", "WAL B/msg", "row writes", "order", "load avg before / after"],
                lat_rows)}

p99, median of rounds: ours {ours_p99:.1f} ms, Debezium's best {dbz_p99:.1f} ms (target: ours lower:
{"met" if ours_p99 < dbz_p99 else "**not met**"}).
"""
    write_section("debezium", body)


if __name__ == "__main__":
    main()
