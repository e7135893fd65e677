"""What a delivery report costs a producing thread while other threads want the interpreter lock.

confluent-kafka serves each record's delivery report by taking the lock, calling the callback
and letting the lock go (``dr_msg_cb`` in its ``Producer.c``), also with
``delivery.report.only.error``. One thread here produces ``--records`` records to an Apache Kafka
node (``LocalKafka``) with a callback, flushing every ``--batch`` as a relay's batch does, beside
``k`` threads looping in Python (``--spinners``, a list): the producing thread's wall time and the
process's context switches, per k. Kept by hand in docs/benchmarks.md (*Where the fleet's drain is
bound, and tenant shares*).

    python tests/benchmarks/bench_delivery_lock.py [--records 100000] [--batch 400] [--spinners 0,1,7]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from confluent_kafka import Producer

from outbox.testing import LocalKafka


def context_switches() -> tuple[int, int]:
    """The process's voluntary and involuntary context switches, every thread's."""
    voluntary = involuntary = 0
    for task in os.listdir("/proc/self/task"):
        for line in Path(f"/proc/self/task/{task}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def produce_beside(producer: Producer, records: int, batch: int, spinners: int) -> None:
    stop = threading.Event()

    def spin() -> None:
        total = 0
        while not stop.is_set():
            for i in range(1000):
                total += i

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(spinners)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    reports = [0]

    def report(error: object, message: object) -> None:
        reports[0] += 1

    voluntary, involuntary = context_switches()
    started = time.perf_counter()
    for i in range(records):
        producer.produce("bench-delivery-lock", b"x" * 200, key=str(i % 1000).encode(), on_delivery=report)
        if i % batch == batch - 1:
            producer.flush(30)
    producer.flush(30)
    took = time.perf_counter() - started
    after = context_switches()
    stop.set()
    for thread in threads:
        thread.join()
    assert reports[0] == records, reports
    print(f"{spinners} threads in Python beside it: {took:.2f} s ({took / records * 1e6:.1f} µs a record), "
          f"context switches {after[0] - voluntary:,} voluntary, {after[1] - involuntary:,} involuntary",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=400)
    parser.add_argument("--spinners", default="0,1,7")
    parser.add_argument("--rounds", type=int, default=2, help="the first warms the broker and topic up")
    args = parser.parse_args()
    sys.setswitchinterval(0.001)  # the fleet's (outbox.tenants.tune_switch_interval)
    node = LocalKafka()
    try:
        producer = Producer({"bootstrap.servers": node.bootstrap, "enable.idempotence": True,
                             "linger.ms": 5, "acks": "all"})
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}", flush=True)
            for spinners in (int(k) for k in args.spinners.split(",")):
                produce_beside(producer, args.records, args.batch, spinners)
    finally:
        node.close()


if __name__ == "__main__":
    main()
