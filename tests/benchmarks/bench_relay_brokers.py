"""The relay on a single-node Apache Kafka next to librdkafka's mock broker, in one sitting.

``bench_relay.py`` measures on the mock cluster (in the benchmark process). This one asks
what a real broker changes: on each broker, the baseline process (SELECT 5000 pending /
produce / flush / one UPDATE) and one relay process (``python -m outbox relay --batch-size
5000``) drain the same rows, and writers committing 1,000 msg/s give commit → ack latency.
Both brokers run throughout (the mock in this process, ``outbox.testing.LocalKafka`` as a JVM
beside it, topics of 4 partitions each); the rounds alternate between them, the order
switching each round, so that the machine's load falls on both alike. Every run records the
1-minute load average while it ran (sampled each second: mean and highest), since other jobs
share the cores. The figures that carry are ratios within the run: relay / baseline on each
broker, and real / mock round by round (section ``relay-brokers``).

    python tests/benchmarks/bench_relay_brokers.py [--broker both|real] [--messages N] [--keys N]
                                                   [--pairs N] [--latency-seconds S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section
from bench_relay import fill, run_baseline, run_latency, run_relays

from outbox import Outbox, create_engine
from outbox.testing import LocalKafka, create_topic, local_postgres
from transports.kafka import embedded_kafka

TOPICS = ("bench", "latency")
RATE = 1000  # msg/s the latency writers commit


# -- brokers and the machine's load -----------------------------------------------------

@dataclass(frozen=True)
class Broker:
    """A running broker: its bootstrap servers, its name in the report, the process it runs in."""

    servers: str
    name: str
    pid: int


@contextmanager
def broker(kind: str) -> Iterator[Broker]:
    """``mock``: librdkafka's mock cluster in this process; ``real``: a single-node Apache Kafka
    (``LocalKafka``, which proves it bound its ports) with the topics made first, 4 partitions
    each, as the mock makes them."""
    if kind == "mock":
        with embedded_kafka() as servers:
            yield Broker(servers, "mock (librdkafka)", os.getpid())
        return
    with LocalKafka() as kafka:
        for topic in TOPICS:
            create_topic(kafka.bootstrap, topic, 4)
        assert kafka.pid is not None
        yield Broker(kafka.bootstrap, f"Apache Kafka {kafka.version}", kafka.pid)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU a process has used so far, from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    """The 1-minute load average while a run lasted: its mean and highest of one-second samples."""

    mean: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:.1f} (≤ {self.high:.1f})"


class LoadDuring:
    """Samples ``os.getloadavg()`` every second on a thread while the ``with`` block runs, and
    counts the CPU the broker's process used meanwhile (for the mock, the benchmark process:
    the broker's threads, and the benchmark's own look at the table every 50 ms)."""

    def __init__(self, broker_pid: int) -> None:
        self._pid = broker_pid

    def __enter__(self) -> LoadDuring:
        self._cpu = cpu_seconds(self._pid)
        self.samples = [os.getloadavg()[0]]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        self.broker_cpu = cpu_seconds(self._pid) - self._cpu

    @property
    def load(self) -> Load:
        return Load(statistics.fmean(self.samples), max(self.samples))


# -- the runs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Throughput:
    """One round on one broker: the baseline's and one relay process's msg/s, with their loads."""

    baseline: float
    relay: float
    baseline_load: Load
    relay_load: Load
    baseline_broker_cpu: float  # the broker's CPU seconds while the baseline drained the rows
    relay_broker_cpu: float  # the same while the relay did

    @property
    def ratio(self) -> float:
        return self.relay / self.baseline


@dataclass(frozen=True)
class Latency:
    """One latency run on one broker: commit → ack p50 and p99 in ms, the rate the writers made."""

    p50: float
    p99: float
    achieved: float
    load: Load


@dataclass
class Results:
    """Every round of every broker, in the order the brokers were named."""

    names: dict[str, str]
    throughput: dict[str, list[Throughput]]
    latency: dict[str, list[Latency]]


def alternating(kinds: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, broker) in running order: the brokers in turn, the order switched every round."""
    for n in range(rounds):
        for kind in kinds if n % 2 == 0 else kinds[::-1]:
            yield n, kind


def compare_brokers(kinds: list[str], messages: int, keys: int, rounds: int,
                    latency_seconds: float) -> Results:
    """Throughput (baseline, then one relay) and latency on each broker in ``kinds``, in one sitting."""
    results = Results({}, {kind: [] for kind in kinds}, {kind: [] for kind in kinds})
    with ExitStack() as stack:
        url = stack.enter_context(local_postgres())
        brokers = {kind: stack.enter_context(broker(kind)) for kind in kinds}
        results.names = {kind: b.name for kind, b in brokers.items()}
        engine = create_engine(url)
        outbox = Outbox(engine)
        outbox.create_tables()
        fill(outbox, messages, keys)
        print("filled", flush=True)
        for n, kind in alternating(kinds, rounds):
            with LoadDuring(brokers[kind].pid) as during_baseline:
                base = run_baseline(url, brokers[kind].servers, engine)
            with LoadDuring(brokers[kind].pid) as during_relay:
                one = run_relays(url, brokers[kind].servers, engine, 1, messages)
            run = Throughput(base, one, during_baseline.load, during_relay.load, during_baseline.broker_cpu,
                             during_relay.broker_cpu)
            results.throughput[kind].append(run)
            print(f"round {n + 1} {kind}: baseline {base:,.0f} msg/s (load {run.baseline_load}), "
                  f"relay {one:,.0f} msg/s (load {run.relay_load}), {run.ratio:.2f}, broker CPU "
                  f"{run.baseline_broker_cpu:.2f} / {run.relay_broker_cpu:.2f} s", flush=True)
        for n, kind in alternating(kinds, rounds):
            with LoadDuring(brokers[kind].pid) as during:
                p50, p99, achieved = run_latency(url, brokers[kind].servers, rate=RATE,
                                                 seconds=latency_seconds)
            results.latency[kind].append(Latency(p50, p99, achieved, during.load))
            print(f"round {n + 1} {kind}: latency p50 {p50:.1f} ms p99 {p99:.1f} ms at {achieved:.0f} "
                  f"msg/s (load {during.load})", flush=True)
        engine.dispose()
    return results


# -- the report -------------------------------------------------------------------------

def median(values: Iterator[float] | list[float]) -> float:
    return statistics.median(list(values))


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def throughput_rows(results: Results, messages: int) -> list[list[object]]:
    rounds = len(next(iter(results.throughput.values())))
    return [[n + 1, results.names[kind], f"{t.baseline:,.0f}", str(t.baseline_load), f"{t.relay:,.0f}",
             str(t.relay_load), f"{t.ratio:.2f}",
             f"{t.baseline_broker_cpu / messages * 1e6:.1f} / {t.relay_broker_cpu / messages * 1e6:.1f}"]
            for n in range(rounds) for kind, runs in results.throughput.items() for t in [runs[n]]]


def latency_rows(results: Results) -> list[list[object]]:
    rounds = len(next(iter(results.latency.values())))
    return [[n + 1, results.names[kind], f"{x.p50:.1f}", f"{x.p99:.1f}", f"{x.achieved:,.0f}", str(x.load)]
            for n in range(rounds) for kind, runs in results.latency.items() for x in [runs[n]]]


def summary_rows(results: Results) -> list[list[object]]:
    """Per broker: medians, and the published targets (bench_relay.py's section) judged on it."""
    rows: list[list[object]] = []
    for kind, runs in results.throughput.items():
        relay, ratio = median(t.relay for t in runs), median(t.ratio for t in runs)
        p50 = median(x.p50 for x in results.latency[kind])
        p99 = median(x.p99 for x in results.latency[kind])
        rows.append([results.names[kind], f"{median(t.baseline for t in runs):,.0f}", f"{relay:,.0f}",
                     f"**{ratio:.2f}** ({verdict(ratio >= 0.85)})", f"**{p50:.1f}** ({verdict(p50 <= 20)})",
                     f"**{p99:.1f}** ({verdict(p99 <= 100)})"])
    return rows


def between_brokers(results: Results) -> str:
    """Real / mock, round by round: the figures the machine's load moves least."""
    if set(results.throughput) != {"mock", "real"}:
        return ""

    def ratio(measure: Callable[[Any], float], runs: dict[str, list[Any]]) -> str:
        pairs = list(zip(runs["real"], runs["mock"], strict=True))
        if any(measure(m) == 0 for _, m in pairs):
            return "— (the mock's below what `/proc` resolves)"
        values = [measure(r) / measure(m) for r, m in pairs]
        return f"**{median(values):.2f}** ({', '.join(f'{v:.2f}' for v in values)})"

    throughput, latency = results.throughput, results.latency
    rows: list[list[object]] = [
        ["baseline msg/s", ratio(lambda t: t.baseline, throughput)],
        ["relay msg/s", ratio(lambda t: t.relay, throughput)],
        ["relay / baseline", ratio(lambda t: t.ratio, throughput)],
        ["broker CPU per message, baseline", ratio(lambda t: t.baseline_broker_cpu, throughput)],
        ["broker CPU per message, relay", ratio(lambda t: t.relay_broker_cpu, throughput)],
        ["latency p50", ratio(lambda x: x.p50, latency)],
        ["latency p99", ratio(lambda x: x.p99, latency)],
    ]
    return f"""
{results.names["real"]} / mock, round by round (median, then each round):

{markdown_table(["measure", "real / mock"], rows)}
"""


def report(args: argparse.Namespace, results: Results) -> None:
    names = list(results.names.values())
    body = f"""## Relay on Apache Kafka next to the mock broker

`python tests/benchmarks/bench_relay_brokers.py --broker {args.broker} --messages {args.messages}
--pairs {args.pairs}` — durable local PostgreSQL (`local_postgres()` defaults: fsync on), one
relay process (`python -m outbox relay --batch-size 5000`), {args.messages:,} messages over
{args.keys:,} keys, on {" and on ".join(names)}: the mock cluster in the benchmark process,
Apache Kafka as a single node (`outbox.testing.LocalKafka`: KRaft, one JVM, `-Xmx512m`, its
defaults for the log, topics of 4 partitions), all running throughout. Beside the relay, the
baseline process on the same broker: SELECT 5000 pending / produce / flush / one UPDATE, the
relay's producer settings (idempotent, `acks=all`, `linger.ms=5`, lz4). Each round runs the
baseline, then the relay, on one broker, then on the other; the order switches every round.
Load: the machine's 1-minute load average while the run lasted, mean (≤ highest), from samples
each second — other jobs share the two cores, so the ratios within a round are the fair figures.

**Throughput**, every round; the last column is the CPU the broker's process used while the
baseline, then the relay, drained the rows, per message (for the mock, the benchmark process
that hosts it; `/proc` counts in hundredths of a second):

{markdown_table(["round", "broker", "baseline msg/s", "load", "relay msg/s", "load", "relay / baseline",
                 "broker CPU µs/msg, baseline / relay"], throughput_rows(results, args.messages))}

**Latency**, commit → broker acknowledgement (`published_at` minus the writer's commit time),
two writer threads asked to commit {RATE:,} msg/s for {args.latency_seconds:g} s, one message per
transaction ("msg/s made": what they managed, on a loaded machine fewer), the relay woken by
LISTEN/NOTIFY (poll interval 5 s), every round:

{markdown_table(["round", "broker", "p50 ms", "p99 ms", "msg/s made", "load"], latency_rows(results))}

**Medians**, with the targets the relay section publishes on the mock (relay / baseline ≥ 0.85,
p50 ≤ 20 ms, p99 ≤ 100 ms) judged on each broker (relay / baseline: the median of the rounds'
ratios):

{markdown_table(["broker", "baseline msg/s", "relay msg/s", "relay / baseline", "p50 ms", "p99 ms"],
                summary_rows(results))}
{between_brokers(results)}"""
    write_section("relay-brokers", body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", choices=["both", "real"], default="both",
                        help="both: the mock and Apache Kafka, alternating; real: Apache Kafka alone")
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--pairs", type=int, default=3, help="rounds on each broker")
    parser.add_argument("--latency-seconds", type=float, default=15.0)
    args = parser.parse_args()
    kinds = ["mock", "real"] if args.broker == "both" else ["real"]
    results = compare_brokers(kinds, args.messages, args.keys, args.pairs, args.latency_seconds)
    report(args, results)


if __name__ == "__main__":
    main()
