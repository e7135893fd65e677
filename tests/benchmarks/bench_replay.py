"""Replay of a parked key on PostgreSQL: a batch per transaction against one message per transaction.

Run: ``.venv/bin/python tests/benchmarks/bench_replay.py [--pairs 2] [--before 1000]
[--after 20000] [--large 200000] [--flood 20000]`` (writes the "replay" section of docs/benchmarks.md).

One throwaway PostgreSQL cluster with durable defaults (fsync, synchronous_commit
on). Each run parks one key (its seq 1 failed; seqs 2..N parked behind it, written
in one multi-row INSERT so the seeding costs no time of the measure), fixes the
handler (one INSERT of the business row per message) and times ``Inbox.replay``
from call to return. The un-batched path is the same code with
``replay_batch = 1``: one transaction per message, as replay ran before. The runs
alternate (un-batched, batched, un-batched, …) because the machine is shared:
the ratio is the median of the pairs. ``--large`` replays one key of that many
messages batched at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from outbox import Inbox, create_engine
from outbox.inbox._delivery import decode
from outbox.inbox._kinds import Reason
from outbox.inbox.storage import InboxStorage, ParkedMessages, storage_for
from outbox.inbox.storage._rows import stored_row
from outbox.testing import local_postgres
from tests.benchmarks._report import markdown_table, write_section
from tests.inbox_support import AlertLog, business, dispose, insert_effect, insert_effects, record

TOPIC = "orders"


def replay_rate(db: str, messages: int, batch: int, *, batch_handler: bool) -> float:
    """Park a key of ``messages`` messages and replay it ``batch`` per transaction: msg/s."""
    engine = create_engine(db, pool_size=4)
    group = f"g-{uuid.uuid4().hex[:8]}"
    inbox = Inbox(engine, group=group, max_attempts=1, alert=AlertLog())
    inbox.create_tables()
    business.create_all(engine)
    broken = True

    def handler(session, message):  # type: ignore[no-untyped-def]
        if broken:
            raise RuntimeError("poison")
        insert_effect(session, message)

    def handle_batch(session, messages):  # type: ignore[no-untyped-def]
        if broken:
            raise RuntimeError("poison")
        insert_effects(session, messages)

    if batch_handler:
        inbox.batch_handler(TOPIC)(handle_batch)
    else:
        inbox.handler(TOPIC)(handler)
    key = f"k-{group}"
    inbox.handle(record(TOPIC, key, 1))  # fails, parks the key
    p = inbox.tables.inbox_parked
    with engine.begin() as conn:
        for start in range(2, messages + 1, 10_000):
            rows = []
            for seq in range(start, min(start + 10_000, messages + 1)):
                d = decode(record(TOPIC, key, seq))
                rows.append({**stored_row(d, group), "reason": Reason.KEY_PARKED.value, "error": None,
                             "traceback": None, "attempts": 0,
                             "first_failure_at": d.received_at, "last_failure_at": d.received_at})
            conn.execute(p.insert(), rows)
    broken = False
    inbox.admin.replay_batch = batch
    started = time.perf_counter()
    result = inbox.replay(TOPIC, key)
    elapsed = time.perf_counter() - started
    assert (result.applied, result.unparked) == (messages, True), result
    dispose(inbox)
    engine.dispose()
    return messages / elapsed


def flood_rate(db: str, messages: int, *, batched: bool, batch_size: int = 500) -> float:
    """Arrivals of a parked key parked by the inbox's transactions, ``batch_size`` a transaction: msg/s.

    Un-batched is the path before: ``storage.park`` for each arrival (an INSERT each), through a
    storage given to the inbox whose ``park_behind`` does that.
    """
    engine = create_engine(db, pool_size=4)
    group = f"f-{uuid.uuid4().hex[:8]}"
    dialect = storage_for(engine.dialect.name)

    def one_by_one(tables, group):  # type: ignore[no-untyped-def]
        own = dialect(tables, group)
        return dataclasses.replace(own, parked=_OneByOne(own, own.parked))

    inbox = Inbox(engine, group=group, max_attempts=1, alert=AlertLog(),
                  storage=None if batched else one_by_one)
    inbox.create_tables()

    def handler(session, message):  # type: ignore[no-untyped-def]
        raise RuntimeError("poison")

    inbox.handler(TOPIC)(handler)
    key = f"k-{group}"
    inbox.handle(record(TOPIC, key, 1))  # fails, parks the key
    flood = [decode(record(TOPIC, key, seq)) for seq in range(2, messages + 2)]
    started = time.perf_counter()
    for n in range(0, messages, batch_size):
        inbox.step.apply(flood[n:n + batch_size])
    elapsed = time.perf_counter() - started
    assert len(inbox.parked(TOPIC, key)) == messages + 1
    dispose(inbox)
    engine.dispose()
    return messages / elapsed


class _OneByOne:
    """Parked messages whose ``add_behind`` parks each arrival alone: the statement per message."""

    def __init__(self, storage: InboxStorage, parked: ParkedMessages) -> None:
        self._storage, self._parked = storage, parked

    def add_behind(self, session, deliveries):  # type: ignore[no-untyped-def]
        for d in deliveries:
            self._storage.park(session, d, Reason.KEY_PARKED)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self._parked, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--before", type=int, default=1_000, help="messages per un-batched replay")
    parser.add_argument("--after", type=int, default=20_000, help="messages per batched replay")
    parser.add_argument("--large", type=int, default=200_000, help="one batched replay of this many")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--flood", type=int, default=20_000, help="arrivals of a parked key per run")
    args = parser.parse_args()
    with local_postgres() as db:
        pairs = []
        for n in range(args.pairs):
            for kind in ("per-message", "batch"):
                one = replay_rate(db, args.before, 1, batch_handler=kind == "batch")
                batched = replay_rate(db, args.after, args.batch, batch_handler=kind == "batch")
                pairs.append((kind, one, batched))
                print(f"pair {n + 1}, {kind} handler: one per transaction {one:,.0f} msg/s, "
                      f"{args.batch} per transaction {batched:,.0f} msg/s", flush=True)
        floods = []
        for n in range(args.pairs):
            one = flood_rate(db, args.flood, batched=False)
            batched = flood_rate(db, args.flood, batched=True)
            floods.append((one, batched))
            print(f"pair {n + 1}, parked flood: an INSERT each {one:,.0f} msg/s, "
                  f"one INSERT per transaction {batched:,.0f} msg/s", flush=True)
        large = replay_rate(db, args.large, args.batch, batch_handler=True) if args.large else None
        if large:
            print(f"large: {args.large:,} messages at {large:,.0f} msg/s", flush=True)
    rows = [[f"pair {n // 2 + 1}", kind, f"{o:,.0f}", f"{b:,.0f}", f"{b / o:.1f}"]
            for n, (kind, o, b) in enumerate(pairs)]
    medians = {kind: statistics.median(b / o for k, o, b in pairs if k == kind)
               for kind in ("per-message", "batch")}
    body = "\n\n".join([
        "## Replay of a parked key",
        f"`tests/benchmarks/bench_replay.py` (run: `python tests/benchmarks/bench_replay.py "
        f"--pairs {args.pairs} --before {args.before} --after {args.after} --large {args.large} "
        f"--flood {args.flood}`): one key's parked messages replayed by `Inbox.replay` "
        f"(a per-message handler inserting one business row per call, or a batch handler inserting "
        f"a call's rows in one executemany), PostgreSQL 15 with durable defaults. "
        f"One message per transaction (`replay_batch = 1`, the path before batching; "
        f"{args.before:,} messages a run) alternated with {args.batch} per transaction "
        f"({args.after:,} messages a run) on a machine shared with other engineers' work.",
        markdown_table(["run", "handler", "one per transaction, msg/s",
                        f"{args.batch} per transaction, msg/s", "ratio"], rows),
        f"Median ratio **{medians['per-message']:.1f}x** with the per-message handler, "
        f"**{medians['batch']:.1f}x** with the batch handler."
        + (f" One key of {args.large:,} parked messages replayed batched (batch handler): "
           f"**{large:,.0f} msg/s** (target: 5,000 or more). Each batch is one transaction: lock "
           f"the key, read the next {args.batch} parked rows (on PostgreSQL the sort is bounded by "
           f"the batch's last seq, read in the index's order: sorting every row still parked cost "
           f"70 ms a batch at 200,000), the handler's call, one claim, one DELETE of the batch's "
           f"rows, the key's advance." if large else ""),
        "### Parking a parked key's flood",
        f"The same cluster: {args.flood:,} arrivals of a parked key through the inbox's transactions "
        f"(500 a transaction, as a consumer's batches), parked by one INSERT per message (the path "
        f"before) alternated with one INSERT per transaction (on PostgreSQL one array per column).",
        markdown_table(["run", "an INSERT each, msg/s", "one INSERT per transaction, msg/s", "ratio"],
                       [[f"pair {n + 1}", f"{o:,.0f}", f"{b:,.0f}", f"{b / o:.1f}"]
                        for n, (o, b) in enumerate(floods)]),
        f"Median ratio **{statistics.median(b / o for o, b in floods):.1f}x**. The other keys' "
        f"send-to-commit latency beside a flood through a broker: `bench_flood.py`, next section.",
    ])
    write_section("replay", body)


if __name__ == "__main__":
    main()
