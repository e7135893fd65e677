"""Where a message's commit→ack time goes in our relay, at a fixed rate, on a real Apache Kafka.

One durable PostgreSQL (as ``bench_debezium.py``'s), one local Apache Kafka, a ``Relay`` with a
``KafkaTransport`` (the ``outbox relay`` process's defaults) running in this process, and
``bench_debezium.py``'s writer processes committing ``--rate`` messages/s, one per transaction,
through ``publish()``. The relay's steps are timed from outside (wrappers around its
wake-up listener, its statements and its transport; the product is not changed), and each
message's commit → broker append time (``LogAppendTime``) is cut into:

- **commit → notify**: the first NOTIFY the relay received after the commit;
- **→ fetch start**: the start of the fetch that returned the row (the relay was busy with
  the batch before, or sleeping);
- **fetch**: the fetch statement, sent to its rows back. Its snapshot is taken after it was
  planned, so a row committed while a fetch is planned is in it: such a row counts its
  commit → fetch end here (its notify and wait show as 0), which is why a slow plan costs
  less latency than its length;
- **→ produce**: the row's encoding and what else came between fetch and ``publish``;
- **produce → append**: ``publish`` called → the broker's append time (linger, request, acks);
- **append → report**: → librdkafka's delivery report served to the relay;
- and, beside the span, the marking write: when it starts after the report, how long it takes,
  and how long the next batch waited for it (``finish``); and the process's GC pauses.

    python tests/benchmarks/bench_relay_latency.py [--rate 1000] [--seconds 20] [--rounds 2]
        [--partitioned] [-X linger.ms=0 ...] [--poll-interval 0.5]
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's outbox, not the installed one
from _race import PARTITIONS, read_back

from outbox import Outbox, Relay, create_engine
from outbox.core._gc import tune_gc_for_batches
from outbox.relay import _batch, _wakeup
from outbox.testing import LocalKafka, LocalPostgres, create_topic
from transports.kafka import KafkaTransport

DURABLE = {"wal_level": "logical"}
WRITERS = 8
BENCH_DEBEZIUM = Path(__file__).with_name("bench_debezium.py")


class Timeline:
    """What the relay did and when (time.time(), the writers' clock): notifies, statements, batches."""

    def __init__(self) -> None:
        self.notifies: list[float] = []
        self.fetches: list[tuple[float, float]] = []
        self.publishes: list[tuple[float, float, list[str]]] = []
        self.reports: dict[str, float] = {}
        self.served: dict[int, float] = {}
        self.writes: list[tuple[float, float, list[str]]] = []
        self.finish_waits: list[float] = []
        self.gc_pauses: list[float] = []
        self.gc_generations: list[int] = []
        self.lock = threading.Lock()


def instrument(timeline: Timeline, engine: sa.Engine) -> None:
    """Wrap the relay's wake-up, fetch, publish, delivery report and marking write to time them
    (each round's relay is a new one: the classes are wrapped once, the timeline swapped)."""
    global CURRENT
    CURRENT = timeline
    fetch_started: list[float] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "ORDER BY sized.id" in statement:
            fetch_started.append(time.time())

    @sa.event.listens_for(engine, "after_cursor_execute")
    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "ORDER BY sized.id" in statement:
            timeline.fetches.append((fetch_started.pop(), time.time()))

    if not WRAPPED:
        wrap_classes()
        WRAPPED.append(True)


CURRENT = Timeline()
WRAPPED: list[bool] = []


def wrap_classes() -> None:
    collecting: list[float] = []

    def collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            CURRENT.gc_pauses.append(time.perf_counter() - collecting.pop())
            CURRENT.gc_generations.append(info["generation"])
    gc.callbacks.append(collector)

    listen = _wakeup.start_listening

    def start_listening(engine: sa.Engine, channels: list[str], *, on_notify: Callable[[str], None],
                        **kw: Any) -> Any:
        def noted(payload: str) -> None:
            CURRENT.notifies.append(time.time())
            on_notify(payload)
        return listen(engine, channels, on_notify=noted, **kw)
    _wakeup.start_listening = start_listening  # type: ignore[assignment]

    report = KafkaTransport._report

    def timed_report(reports: dict[int, Any], index: int, error: Any, message: Any) -> None:
        if error is None:  # the message carries no headers here: its index in the publish call
            CURRENT.served.setdefault(index, time.time())
        report(reports, index, error, message)
    KafkaTransport._report = staticmethod(timed_report)  # type: ignore[method-assign]

    publish = KafkaTransport.publish

    def timed_publish(self: KafkaTransport, records: Any) -> Any:
        began = time.time()
        ids = [dict(r.headers)["outbox-message-id"].decode() for r in records]
        CURRENT.served = {}
        out = publish(self, records)
        for index, at in CURRENT.served.items():
            CURRENT.reports[ids[index]] = at
        CURRENT.publishes.append((began, time.time(), ids))
        return out
    KafkaTransport.publish = timed_publish  # type: ignore[method-assign]

    write = _batch.BatchRunner._write

    def timed_write(self: _batch.BatchRunner, plan: Any) -> Any:
        began = time.time()
        out = write(self, plan)
        CURRENT.writes.append((began, time.time(), [str(i) for i in plan.published.ids]))
        return out
    _batch.BatchRunner._write = timed_write  # type: ignore[method-assign]

    finish = _batch.BatchRunner.finish

    def timed_finish(self: _batch.BatchRunner) -> None:
        pending = self._writing is not None and not self._writing.done()
        began = time.perf_counter()
        finish(self)
        if pending:
            CURRENT.finish_waits.append(time.perf_counter() - began)
    _batch.BatchRunner.finish = timed_finish  # type: ignore[method-assign]


def warm_up(kafka: LocalKafka) -> None:
    """A record through an idempotent producer first: a new broker's coordinator loads meanwhile."""
    from transports import Outcome, Record

    transport = KafkaTransport({}, bootstrap_servers=kafka.bootstrap)
    deadline = time.monotonic() + 120
    while transport.publish([Record("warm-up", b"k", b"v")])[0].outcome is not Outcome.DELIVERED:
        if time.monotonic() > deadline:
            raise RuntimeError("the broker took no record in 120 s")
        time.sleep(1)
    transport.close(1.0)


def q(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100)[p - 1] if len(values) > 1 else (values or [0.0])[0]


def one_round(url: str, kafka: LocalKafka, engine: sa.Engine, args: argparse.Namespace,
              settings: dict[str, str]) -> dict[str, Any]:
    topic = f"lat-{uuid.uuid4().hex[:8]}"
    create_topic(kafka.bootstrap, topic, PARTITIONS, config={"message.timestamp.type": "LogAppendTime"})
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_messages"))
        conn.execute(sa.text("DELETE FROM outbox_keys"))
    timeline = Timeline()
    relay_engine = create_engine(url)
    instrument(timeline, relay_engine)
    outbox = Outbox(relay_engine)
    transport = KafkaTransport(settings, bootstrap_servers=kafka.bootstrap)
    relay = Relay(outbox, transport, poll_interval=args.poll_interval,
                  worker_id=f"lat-{uuid.uuid4().hex[:6]}")
    runner = threading.Thread(target=relay.run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while len(relay.leases.owned()) < outbox.shards and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    load = os.getloadavg()
    writers = [subprocess.Popen(
        [sys.executable, str(BENCH_DEBEZIUM), "--writer", "Ours", url, topic, str(args.rate / WRITERS),
         str(args.seconds), str(10_000 // WRITERS), str(w)], stdout=subprocess.PIPE, text=True)
        for w in range(WRITERS)]
    committed: dict[str, float] = {}
    for writer in writers:
        out, _ = writer.communicate(timeout=args.seconds * 10 + 120)
        committed.update(json.loads(out))
    records = read_back(kafka.bootstrap, topic, len(committed))
    relay.stop()
    with engine.connect() as conn:
        message_ids = {str(i): str(m) for i, m in conn.execute(sa.text(
            "SELECT id, message_id FROM outbox_messages"))}
    timeline.writes = [(a, b, [message_ids[i] for i in ids if i in message_ids])
                       for a, b, ids in timeline.writes]
    runner.join(30)
    transport.close(1.0)
    relay_engine.dispose()
    appended = {h["outbox-message-id"].decode(): at / 1000 for _, _, _, h, at in records}
    return breakdown(timeline, committed, appended) | {"load": load, "load_after": os.getloadavg()}


def breakdown(t: Timeline, committed: dict[str, float], appended: dict[str, float]) -> dict[str, Any]:
    """Per message: the spans of the module doc, in ms; their p50/p99 and the mean share."""
    batch_of: dict[str, int] = {}
    for n, (_, _, ids) in enumerate(t.publishes):
        for i in ids:
            batch_of[i] = n
    fetch_ends = [end for _, end in t.fetches]
    notifies = sorted(t.notifies)
    spans: dict[str, list[float]] = {k: [] for k in (
        "total", "commit→notify", "→fetch start", "fetch", "→produce", "produce→append", "append→report",
        "report→mark start", "mark")}
    write_of = {i: (a, b) for a, b, ids in t.writes for i in ids}
    for mid, commit in committed.items():
        if mid not in batch_of or mid not in appended:
            continue
        began, _, _ = t.publishes[batch_of[mid]]
        # The fetch that returned it: the last fetch that ended before its publish began.
        f = bisect.bisect_right(fetch_ends, began) - 1
        fetch_start, fetch_end = t.fetches[f]
        n = bisect.bisect_left(notifies, commit)
        notify = notifies[n] if n < len(notifies) else fetch_start
        notify = min(notify, fetch_start) if notify > commit else commit
        report = t.reports.get(mid, appended[mid])
        ms = lambda a, b: (b - a) * 1000  # noqa: E731
        spans["total"].append(ms(commit, appended[mid]))
        spans["commit→notify"].append(ms(commit, notify))
        spans["→fetch start"].append(ms(notify, fetch_start))
        spans["fetch"].append(ms(fetch_start, fetch_end))
        spans["→produce"].append(ms(fetch_end, began))
        spans["produce→append"].append(ms(began, appended[mid]))
        spans["append→report"].append(ms(appended[mid], report))
        if mid in write_of:
            spans["report→mark start"].append(ms(report, write_of[mid][0]))
            spans["mark"].append(ms(*write_of[mid]))
    sizes = [len(ids) for _, _, ids in t.publishes]
    return {"spans": {k: (statistics.mean(v), q(v, 50), q(v, 99)) for k, v in spans.items() if v},
            "batches": len(sizes), "batch_size_mean": statistics.mean(sizes) if sizes else 0,
            "fetches": len(t.fetches), "notifies": len(t.notifies),
            "finish_wait_ms": (1000 * statistics.mean(t.finish_waits) if t.finish_waits else 0.0,
                               len(t.finish_waits)),
            "messages": len(spans["total"]),
            "gc": (len(t.gc_pauses), 1000 * sum(t.gc_pauses), 1000 * max(t.gc_pauses, default=0.0)),
            "gc_by_generation": {g: (t.gc_generations.count(g), 1000 * max(
                p for p, h in zip(t.gc_pauses, t.gc_generations, strict=True) if h == g))
                for g in sorted(set(t.gc_generations))}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("--partitioned", action="store_true", help="outbox_messages partitioned by day")
    parser.add_argument("-X", action="append", default=[], help="KEY=VALUE librdkafka setting")
    parser.add_argument("--gc-young", type=int, help="the collector's young threshold instead of the relay's")
    args = parser.parse_args()
    settings = dict(x.split("=", 1) for x in args.X)
    tune_gc_for_batches()
    if args.gc_young:
        gc.set_threshold(args.gc_young, *gc.get_threshold()[1:])
    server = LocalPostgres(DURABLE)
    kafka = LocalKafka()
    try:
        engine = create_engine(server.url)
        outbox = Outbox(engine)
        outbox.create_tables()
        if args.partitioned:
            from outbox.housekeeping import partition_outbox
            partition_outbox(engine, outbox.tables)
        warm_up(kafka)
        for n in range(args.rounds):
            r = one_round(server.url, kafka, engine, args, settings)
            table = "partitioned" if args.partitioned else "plain"
            print(f"round {n + 1} ({table}, {settings or 'defaults'}): "
                  f"{r['messages']} messages, {r['batches']} batches (mean {r['batch_size_mean']:.1f} rows), "
                  f"{r['fetches']} fetches, {r['notifies']} notifies, next batch waited for the mark "
                  f"{r['finish_wait_ms'][0]:.2f} ms x{r['finish_wait_ms'][1]}, "
                  f"{r['gc'][0]} GC pauses ({r['gc'][1]:.1f} ms in all, longest {r['gc'][2]:.2f} ms), "
                  f"load {r['load'][0]:.1f} -> {r['load_after'][0]:.1f}", flush=True)
            print(f"  GC (generation: pauses, longest ms): {r['gc_by_generation']}", flush=True)
            for name, (mean, p50, p99) in r["spans"].items():
                print(f"  {name:18s} mean {mean:7.2f}  p50 {p50:7.2f}  p99 {p99:7.2f} ms", flush=True)
        engine.dispose()
    finally:
        kafka.close()
        server.remove()


if __name__ == "__main__":
    main()
