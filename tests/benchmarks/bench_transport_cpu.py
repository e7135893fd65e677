"""KafkaTransport.publish CPU per message, this checkout against another one, alternating.

CPU time (of the publishing process, librdkafka's threads included) moves far
less than wall-clock throughput on a shared machine, so it is the fair way to
tell whether a change to the transport made the common case (keys spread, each
once per batch) slower. Each run is a fresh process publishing batches of
1,000 records over distinct keys to the embedded broker; ``--against DIR``
runs the other side from a source tree on ``PYTHONPATH`` (e.g.
``git archive main outbox transports | tar -x -C DIR``).

    python tests/benchmarks/bench_transport_cpu.py --against DIR [--pairs N] [--batches N]

Prints the pairs and the median ratio (this checkout / the other); it writes no
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VALUE = b'{"order":"o-1","status":"paid","total":"19.90","currency":"EUR","lines":[{"sku":"A-1","qty":2}]}'


def run(servers: str, batches: int) -> None:
    """One side, in its own process: prints CPU µs per message and messages/s."""
    from transports import Outcome, Record
    from transports.kafka import KafkaTransport

    transport = KafkaTransport(bootstrap_servers=servers, log_level=0)
    transport.publish([Record(topic="cpu", value=VALUE, key=b"warm")])
    sent = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for b in range(batches):
        records = [Record(topic="cpu", value=VALUE, key=b"key-%d-%d" % (b, i)) for i in range(1000)]
        assert all(r.outcome is Outcome.DELIVERED for r in transport.publish(records))
        sent += len(records)
    print((time.process_time() - cpu) / sent * 1e6, sent / (time.perf_counter() - wall))
    transport.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", type=Path, help="source tree of the other side")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--run", metavar="SERVERS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.run, args.batches)
        return
    from transports.kafka import embedded_kafka

    here = str(Path(__file__).resolve().parents[2])
    sides = {"this": here, "other": str(args.against.resolve())}
    ratios = []
    with embedded_kafka() as servers:
        for _ in range(args.pairs):
            cpu = {}
            for name, tree in sides.items():
                # From /, so the tree on PYTHONPATH is what `import transports` finds.
                out = subprocess.run(
                    [sys.executable, __file__, "--run", servers, "--batches", str(args.batches)],
                    capture_output=True, text=True, check=True, cwd="/",
                    env={**os.environ, "PYTHONPATH": tree})
                cpu[name] = float(out.stdout.split()[0])
            ratios.append(cpu["this"] / cpu["other"])
            print(f"this {cpu['this']:.1f} µs/msg, other {cpu['other']:.1f} µs/msg ({ratios[-1]:.2f})",
                  flush=True)
    print(f"median CPU per message, this / other: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
