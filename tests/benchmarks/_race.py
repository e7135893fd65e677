"""What the race against Debezium measures, and how: the messages, CPU, WAL, row writes, the
topic's end offsets and the order on the wire (``bench_debezium.py`` runs the sides)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from outbox.testing import LocalPostgres

PARTITIONS = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")

Record = tuple[int, bytes, bytes, dict[str, bytes], int]
"""(partition, key, value, headers, timestamp ms) of a record read back."""


def payload(key: str, n: int, i: int) -> dict[str, object]:
    """About 200 bytes of JSON: an order event, ``n`` the key's own counter (checked for order)."""
    return {"order": key, "n": n, "i": i, "status": "paid", "total": "19.90", "currency": "EUR",
            "lines": [{"sku": "A-1", "qty": 2, "price": "9.95"}], "customer": f"c-{i % 977:04d}",
            "note": "deliver to the back door, ring twice"}


def messages_of(count: int, keys: int) -> list[tuple[str, int, dict[str, object]]]:
    """(key, n, payload) for every message, keys drawn at random (seeded), n counting per key."""
    rng, counters, out = random.Random(37), {}, []
    for i in range(count):
        key = f"order-{rng.randrange(keys)}"
        counters[key] = counters.get(key, 0) + 1
        out.append((key, counters[key], payload(key, counters[key], i)))
    return out


def cpu_of(pid: int, *, children: bool = False) -> float:
    """CPU seconds of ``pid`` (with ``children``: plus those of its children that ended)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / CLK_TCK


def postgres_cpu(server: LocalPostgres) -> float:
    """CPU seconds of the whole server: the postmaster, its live children, and the ended ones."""
    master, *kids = server._pids()
    total = cpu_of(master, children=True)
    for pid in kids:
        with contextlib.suppress(OSError):  # ended meanwhile: counted in the postmaster's cutime from now on
            total += cpu_of(pid)
    return total


STATS = ("outbox_messages", "outbox_keys", "outboxevent")


@dataclass
class Snapshot:
    """Counters at one instant: WAL position, CPU seconds, load average."""

    at: float
    wal: int
    side_cpu: float
    pg_cpu: float
    load: float


@dataclass
class Window:
    """What one timed run cost: its messages, seconds and the differences of two snapshots."""

    messages: int
    seconds: float
    wal: int
    side_cpu: float
    pg_cpu: float
    rows: dict[str, tuple[int, int, int]]
    load: tuple[float, float]
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def per_100k(self, cpu: float) -> float:
        return cpu * 100_000 / self.messages

    def row_writes(self) -> float:
        return sum(sum(v) for v in self.rows.values()) / self.messages


def snapshot(engine: sa.Engine, server: LocalPostgres, side_pid: int) -> Snapshot:
    with engine.connect() as conn:
        wal = int(conn.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one())
    return Snapshot(time.time(), wal, cpu_of(side_pid), postgres_cpu(server), os.getloadavg()[0])


def row_counts(engine: sa.Engine) -> dict[str, tuple[int, int, int]]:
    """Inserts, updates and deletes per table so far (``pg_stat_user_tables``).

    A backend reports its counts when its transaction ends, at most once a second, and an
    idle one within ten: the pool is closed first (a backend that ends reports), then a
    second is waited for.
    """
    engine.dispose()
    time.sleep(1.5)
    with engine.connect() as conn:
        return {r.relname: (r.n_tup_ins, r.n_tup_upd, r.n_tup_del) for r in conn.execute(sa.text(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
            "WHERE relname = ANY(:names)"), {"names": list(STATS)})}


def window(before: Snapshot, after: Snapshot, rows_before: dict[str, tuple[int, int, int]],
           rows_after: dict[str, tuple[int, int, int]], messages: int, seconds: float) -> Window:
    rows = {name: (rows_after.get(name, (0, 0, 0))[0] - rows_before.get(name, (0, 0, 0))[0],
                   rows_after.get(name, (0, 0, 0))[1] - rows_before.get(name, (0, 0, 0))[1],
                   rows_after.get(name, (0, 0, 0))[2] - rows_before.get(name, (0, 0, 0))[2])
            for name in STATS}
    return Window(messages, seconds, after.wal - before.wal, after.side_cpu - before.side_cpu,
                  after.pg_cpu - before.pg_cpu, rows, (before.load, after.load))


class EndOffsets:
    """The topic's total end offset (records on it), asked of the broker."""

    def __init__(self, bootstrap: str) -> None:
        from confluent_kafka import Consumer

        self.consumer = Consumer({"bootstrap.servers": bootstrap, "log_level": 0,
                                  "group.id": f"bench-{uuid.uuid4().hex}"})

    def total(self, topic: str) -> int:
        from confluent_kafka import TopicPartition

        return sum(self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10,
                                                       cached=False)[1] for p in range(PARTITIONS))

    def wait(self, topic: str, count: int, timeout: float = 600) -> float:
        """Wait until ``count`` records are on ``topic``; the time.perf_counter() it was seen."""
        deadline = time.monotonic() + timeout
        while (seen := self.total(topic)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic}: {seen} of {count} records after {timeout:.0f} s")
            time.sleep(0.02)
        return time.perf_counter()


def read_back(bootstrap: str, topic: str, count: int) -> list[Record]:
    """Every record of ``topic``, in partition order."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "log_level": 0})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    out = []
    deadline = time.monotonic() + 300
    while len(out) < count and time.monotonic() < deadline:
        for m in consumer.consume(10_000, 1.0):
            if m.error() is None:
                out.append((m.partition(), m.key(), m.value(), dict(m.headers() or ()), m.timestamp()[1]))
    consumer.close()
    return out


def order_on_the_wire(records: list[Record]) -> str:
    """Each key on one partition, its n rising by one along it: "ok", or what was wrong."""
    partitions: dict[bytes, set[int]] = {}
    last: dict[bytes, int] = {}
    wrong = 0
    for partition, key, value, _, _ in records:
        partitions.setdefault(key, set()).add(partition)
        n = json.loads(value)["n"]
        if n != last.get(key, 0) + 1:
            wrong += 1
        last[key] = n
    split = sum(1 for parts in partitions.values() if len(parts) > 1)
    return "in order" if not wrong and not split else f"{wrong} out of order, {split} keys on 2+ partitions"
