"""The inbox against a tiny reference model: random interleavings, invariants checked at every step.

Hypothesis drives a deterministic stand-in for Kafka and the runner around
the real pipeline (decode → settle → transaction → store, and the real offset
tracker): a producer appends messages to two partitions, with duplicates
(keyed and unkeyed), reordered seqs, bursts of one key, and messages whose
handler fails once, twice, always (poison), asks to ``RetryLater`` or skips;
the consumer polls, runs batches of lane heads with a run of each lane's
queue behind them (so a failure can sit in the middle of a key's run), puts
retries on a timer it fires at will, commits,
loses partitions, restarts from the committed offsets (a new ``Inbox``: all
memory gone), and an operator replays and discards. The producer's database
can be rebuilt (issue 23): a new incarnation whose keys count from seq 1 again,
with new message ids.

Invariants, after every step: each message id takes effect at most once; per
key and producer incarnation, effects in seq order; nothing vanishes silently
(a delivery settled as a duplicate has its id recorded). After draining: nothing vanished (every delivered
message is applied, parked, held, or recorded as skipped or discarded by an
operator), and a poisoned key never blocked another (every key that was never
parked has all its messages applied).

The effects table has no unique constraint, so a second application shows
instead of failing. Examples per run: ``INBOX_MODEL_EXAMPLES`` (default 30,
derandomized, so CI runs the same ones every time).
"""

from __future__ import annotations

import itertools
import os
import random
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from outbox import DiscardRefusedError, Disposition, Inbox, RetryLater, SkipMessage
from outbox.inbox._delivery import Delivery, Origin, decode, turn_of
from outbox.inbox._offsets import OffsetTracker
from outbox.testing import OutboxTestHarness
from tests.inbox_support import INBOX_KINDS, dispose, for_inbox, inbox_bind, record
from transports import Record

settings.register_profile(
    "inbox-model",
    max_examples=int(os.environ.get("INBOX_MODEL_EXAMPLES", "30")),
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TOPIC = "model"
KEYS = ["k0", "k1", "k2", "k3"]
PARTITIONS = 2
BEHAVIOURS = ["ok", "ok", "ok", "flaky1", "flaky2", "retry_later", "poison", "skip"]

model_effects = sa.Table(
    "model_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("consumer_group", sa.String(100), nullable=False),
    sa.Column("key", sa.String(20)),
    sa.Column("seq", sa.Integer),
    sa.Column("message_id", sa.Uuid, nullable=False),
)


@dataclass
class Produced:
    message_id: uuid.UUID
    key: str | None
    seq: int | None
    behaviour: str
    record: Record
    incarnation: str


@dataclass
class World:
    """What the handler reads: how each message behaves, and which poison an operator fixed."""

    behaviours: dict[uuid.UUID, str] = field(default_factory=dict)
    calls: dict[uuid.UUID, int] = field(default_factory=lambda: defaultdict(int))
    fixed: set[uuid.UUID] = field(default_factory=set)


def handler_for(world: World, group: str):  # type: ignore[no-untyped-def]
    def handle(session, message):  # type: ignore[no-untyped-def]
        # The write comes first: a failure after it must roll it back.
        session.execute(model_effects.insert().values(consumer_group=group, key=message.key,
                                                      seq=message.seq, message_id=message.message_id))
        behaviour = world.behaviours[message.message_id]
        world.calls[message.message_id] += 1
        calls = world.calls[message.message_id]
        if (behaviour == "flaky1" and calls <= 1) or (behaviour == "flaky2" and calls <= 2):
            raise RuntimeError("flaky")
        if behaviour == "retry_later" and calls <= 2:
            raise RetryLater(0.0, "busy")
        if behaviour == "poison" and message.message_id not in world.fixed:
            raise RuntimeError("poison")
        if behaviour == "skip":
            raise SkipMessage("not for us")
    return handle


class InboxModel(RuleBasedStateMachine):
    engine: sa.Engine
    bind: object  # what the Inbox is built on: ``engine``, or an AsyncEngine on its database
    runs = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.group = f"model-{os.getpid()}-{next(self.runs)}"
        self.world = World()
        self.logs: list[list[Record]] = [[] for _ in range(PARTITIONS)]
        self.produced: dict[uuid.UUID, Produced] = {}
        self.next_seq: dict[str, int] = defaultdict(lambda: 1)
        self.committed = [0] * PARTITIONS
        self.discarded: set[uuid.UUID] = set()
        self.incarnation = ""  # the producer database's identity: drawn in some_traffic
        self.duplicates: set[uuid.UUID] = set()  # ids the inbox settled as duplicates
        self._start_consumer()

    # -- the consumer process -------------------------------------------------------

    def _start_consumer(self) -> None:
        self.inbox = Inbox(self.bind, group=self.group, max_attempts=3, retry_backoff=0,  # type: ignore[arg-type]
                           gap_timeout=3600, alert=lambda alert: None)
        self.inbox.handler(TOPIC)(for_inbox(self.inbox, handler_for(self.world, self.group)))
        self.harness = OutboxTestHarness(inbox=self.inbox)
        self.tracker = OffsetTracker()
        self.position = list(self.committed)
        self.queue: list[Delivery] = []
        self.waiting: list[Delivery] = []

    # -- producer -------------------------------------------------------------------------

    def _append(self, p: Produced, partition: int) -> None:
        r = self.logs[partition]
        copy = Record(p.record.topic, p.record.value, p.record.key, list(p.record.headers),
                      partition=partition, offset=len(r))
        r.append(copy)

    def _new(self, key: str | None, behaviour: str, seq: int | None = None) -> Produced:
        if key is not None and seq is None:
            seq = self.next_seq[key]
            self.next_seq[key] += 1
        message_id = self._uuid()
        r = record(TOPIC, key, seq, incarnation=self.incarnation, message_id=message_id)
        produced = Produced(message_id, key, seq, behaviour, r, self.incarnation)
        self.produced[message_id] = produced
        self.world.behaviours[message_id] = behaviour
        return produced

    @staticmethod
    def _partition(key: str | None, salt: int = 0) -> int:
        return (KEYS.index(key) + salt) % PARTITIONS if key is not None else salt % PARTITIONS

    @rule(key=st.sampled_from([*KEYS, None]), behaviour=st.sampled_from(BEHAVIOURS),
          salt=st.integers(0, 1))
    def produce(self, key: str | None, behaviour: str, salt: int) -> None:
        p = self._new(key, behaviour)
        self._append(p, self._partition(key, salt if key is None else 0))

    def _uuid(self) -> uuid.UUID:
        return uuid.UUID(int=self.ids.getrandbits(128), version=4)

    @initialize(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6),
                poisoned=st.sampled_from(KEYS), seed=st.integers(0, 2**64 - 1))
    def some_traffic(self, keys: list[str], poisoned: str, seed: int) -> None:
        """Every run starts with messages on the wire, one key poisoned with two behind it.

        Message ids and incarnations come from ``seed``: their order decides
        which row a query returns first, so an example must replay with the
        same ones (uuid4 made a failure show in one run out of two)."""
        self.ids = random.Random(seed)
        self.incarnation = str(self._uuid())
        for key in keys:
            self._append(self._new(key, "ok"), self._partition(key))
        self.produce_poison(poisoned, 2)

    @rule(key=st.sampled_from(KEYS), after=st.integers(1, 3))
    def produce_poison(self, key: str, after: int) -> None:
        """A poison message and ``after`` more of its key: they park behind it."""
        for behaviour in ["poison"] + ["ok"] * after:
            self._append(self._new(key, behaviour), self._partition(key))

    @rule(key=st.sampled_from(KEYS), behaviours=st.lists(st.sampled_from(BEHAVIOURS), min_size=2,
                                                          max_size=6))
    def produce_run(self, key: str, behaviours: list[str]) -> None:
        """A burst of one key (a hot key): a batch can carry it as one run, failures in the middle."""
        for behaviour in behaviours:
            self._append(self._new(key, behaviour), self._partition(key))

    @rule(key=st.sampled_from(KEYS))
    def produce_reordered(self, key: str) -> None:
        """The key's next two seqs land in the wrong order (e.g. the key moved partitions)."""
        first, second = self._new(key, "ok"), self._new(key, "ok")
        self._append(second, self._partition(key))
        self._append(first, self._partition(key, 1))

    @rule()
    def producer_rebuilt(self) -> None:
        """The producer's database is restored or recreated (and given a new incarnation, as
        docs/consumer.md says): every key counts from seq 1 again, with new message ids."""
        self.incarnation = str(self._uuid())
        self.next_seq.clear()

    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        """A relay resend or a lost acknowledgement: the same message (same id) again."""
        if self.produced:
            p = data.draw(st.sampled_from(sorted(self.produced.values(), key=lambda p: str(p.message_id))))
            self._append(p, self._partition(p.key, data.draw(st.integers(0, 1))))

    # -- consumer ---------------------------------------------------------------------------

    @rule(partition=st.integers(0, PARTITIONS - 1), count=st.integers(1, 4))
    def poll(self, partition: int, count: int) -> None:
        records = self.logs[partition][self.position[partition]:self.position[partition] + count]
        self.position[partition] += len(records)
        for r in records:
            d = decode(r, origin=Origin.POLLED)
            self.queue.append(d)
            if d.position is not None:
                self.tracker.received([d.position])

    @rule(size=st.integers(1, 5), run=st.integers(1, 5))
    def run_batch(self, size: int, run: int) -> None:
        """A worker takes the heads of up to ``size`` ready lanes (a waiting lane is not ready) and,
        while the batch has room for ``size``, up to ``run`` - 1 more of each lane's queue behind
        its head: a key's run, as the scheduler hands it out."""
        blocked = {turn_of(d) for d in self.waiting}
        lanes: dict[object, list[Delivery]] = {}
        for d in self.queue:
            lane = turn_of(d)
            if lane in blocked:
                continue
            if lane not in lanes:
                if len(lanes) < size:
                    lanes[lane] = [d]
            elif d.message.key is not None and len(lanes[lane]) < run:
                lanes[lane].append(d)
        room = size - len(lanes)
        batch = []
        for taken in lanes.values():
            extra = min(room, len(taken) - 1)
            room -= extra
            batch.extend(taken[:1 + extra])
        if not batch:
            return
        for d in batch:
            self.queue.remove(d)
        settled = self.harness.settle(batch)
        self.duplicates.update(d.message.message_id for d, disposition in settled.done
                               if disposition is Disposition.DUPLICATE)
        self.tracker.finished(d.position for d, _ in settled.done if d.position is not None)
        self.waiting.extend(d for d, _ in settled.later)

    @rule()
    def consume_everything(self) -> None:
        """Poll to the end and run batches, firing timers, until nothing moves."""
        self._drain()

    @rule()
    def timers_fire(self) -> None:
        """Retry delays are over: waiting deliveries go back to the head of their lanes."""
        self.queue[:0] = self.waiting
        self.waiting = []

    @rule()
    def commit(self) -> None:
        offsets = self.tracker.committable()
        for (_, partition), offset in offsets.items():
            self.committed[partition] = offset
        self.tracker.committed(offsets)

    @rule(partition=st.integers(0, PARTITIONS - 1))
    def revoke(self, partition: int) -> None:
        """The partition goes away and comes back: queued and waiting records are dropped after a
        commit of what finished; it is read again from the committed offset."""
        def mine(d: Delivery) -> bool:
            return d.position is not None and d.partition == partition

        self.queue = [d for d in self.queue if not mine(d)]
        self.waiting = [d for d in self.waiting if not mine(d)]
        for (_, p), offset in self.tracker.committable([(TOPIC, partition)]).items():
            self.committed[p] = offset
        self.tracker.forget([(TOPIC, partition)])
        self.position[partition] = self.committed[partition]

    @rule()
    def restart(self) -> None:
        """The consumer process dies (SIGKILL): everything in memory is gone."""
        self._start_consumer()

    @rule()
    def sweep(self) -> None:
        # The runner's own sweep step (an internal phase, kept on purpose): the held deliveries whose
        # gap filled join their lanes' queues here; ``Inbox.sweep`` would settle them on the spot.
        self.queue.extend(self.inbox.gaps.ready())

    # -- operator ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """The operator fixed the cause of a key's failures, and replays it."""
        parked = self.inbox.parked(TOPIC)
        if not parked:
            return
        target = data.draw(st.sampled_from(parked))
        self.world.fixed.update(p.message_id for p in parked if p.key == target.key)
        self.inbox.replay(TOPIC, target.key)

    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        parked = self.inbox.parked(TOPIC)
        if not parked:
            return
        # Half the time the last parked message of a key: the one that must not skip the others.
        last = {p.key: p for p in parked}
        target = data.draw(st.sampled_from(parked) | st.sampled_from(list(last.values())))
        earlier = [p for p in parked if p.key is not None and p.key == target.key
                   and p.seq < target.seq]  # type: ignore[operator]
        try:
            self.inbox.discard(target.message_id, by="model", reason="operator decision")
        except DiscardRefusedError:
            assert earlier, "a discard with no earlier parked message of its key was refused"
            return
        assert not earlier, "a discard skipped past earlier parked messages"
        self.discarded.add(target.message_id)

    # -- invariants ---------------------------------------------------------------------------------

    def _effects(self) -> list[tuple[str | None, int | None, uuid.UUID]]:
        e = model_effects
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(  # type: ignore[misc]
                sa.select(e.c.key, e.c.seq, e.c.message_id)
                .where(e.c.consumer_group == self.group).order_by(e.c.id))]

    @invariant()
    def at_most_once_and_in_key_order(self) -> None:
        effects = self._effects()
        ids = [m for _, _, m in effects]
        assert len(ids) == len(set(ids)), "a message took effect twice"
        last: dict[tuple[str, str], int] = {}
        for key, seq, message_id in effects:
            if key is not None:
                lane = (key, self.produced[message_id].incarnation)
                assert seq > last.get(lane, 0), f"key {key}: seq {seq} applied after {last[lane]}"
                last[lane] = seq

    @invariant()
    def nothing_vanishes_silently(self) -> None:
        """A delivery dropped as a duplicate is a copy of a message the group recorded, parked,
        held, or still has in flight (a second copy in one batch, while the first one waits for
        its retry): issue 23's rebuilt producer had its new messages dropped as duplicates."""
        in_flight = {d.message.message_id for d in self.queue + self.waiting}
        suspects = self.duplicates - in_flight
        if not suspects:
            return
        t = self.inbox.tables
        with self.engine.connect() as conn:
            kept = {i for table in (t.inbox_messages, t.inbox_parked, t.inbox_held)
                    for i in conn.scalars(sa.select(table.c.message_id).where(
                        table.c.consumer_group == self.group, table.c.message_id.in_(suspects)))}
        lost = suspects - kept
        assert not lost, f"dropped as duplicates, never kept: {[self.produced[i] for i in lost]}"

    def teardown(self) -> None:
        try:
            self._drain()
            self.at_most_once_and_in_key_order()
            self._nothing_vanished()
        finally:
            self.inbox = None  # type: ignore[assignment]

    def _drain(self) -> None:
        """Deliver everything, fire every timer, run until nothing moves."""
        for _ in range(200):
            self.timers_fire()
            for partition in range(PARTITIONS):
                self.poll(partition, 1_000)
            self.sweep()
            if not self.queue:
                return
            while self.queue:
                self.run_batch(5, 5)
                self.timers_fire()
        raise AssertionError("the consumer never became idle")

    def _nothing_vanished(self) -> None:
        t = self.inbox.tables
        with self.engine.connect() as conn:
            applied = {m for _, _, m in self._effects()}
            parked = set(conn.scalars(sa.select(t.inbox_parked.c.message_id)
                                      .where(t.inbox_parked.c.consumer_group == self.group)))
            held = set(conn.scalars(sa.select(t.inbox_held.c.message_id)
                                    .where(t.inbox_held.c.consumer_group == self.group)))
            recorded = dict(conn.execute(
                sa.select(t.inbox_messages.c.message_id, t.inbox_messages.c.outcome)
                .where(t.inbox_messages.c.consumer_group == self.group)).all())
        skipped = {m for m, outcome in recorded.items() if outcome == "skipped"}
        discarded = {m for m, outcome in recorded.items() if outcome == "discarded"}
        assert discarded == self.discarded, "a discard without an operator, or one not recorded"
        assert applied <= {m for m, outcome in recorded.items() if outcome == "processed"}
        for p in self.produced.values():
            assert p.message_id in applied | parked | held | skipped | discarded, (
                f"{p.key} seq {p.seq} ({p.behaviour}) vanished")
        parked_keys = {self.produced[m].key for m in parked | held | discarded}
        for key in KEYS:
            if key not in parked_keys:
                mine = {m for m, p in self.produced.items() if p.key == key}
                done = {m for m in applied | skipped if self.produced[m].key == key}
                assert done == mine, f"key {key} was never parked, yet not all of it applied"


@pytest.fixture
def db_url(proof_db_url: str) -> str:
    """The model runs on SQLite, PostgreSQL and MySQL/MariaDB."""
    return proof_db_url


@pytest.mark.slow
@pytest.mark.parametrize("kind", INBOX_KINDS)
def test_the_inbox_keeps_its_invariants_under_random_interleavings(engine: sa.Engine, kind: str) -> None:
    Inbox(engine, group="setup").create_tables()
    model_effects.create(engine, checkfirst=True)
    bind = inbox_bind(engine, kind)  # one engine for every consumer the model starts
    machine = type("Machine", (InboxModel,), {"engine": engine, "bind": bind})
    try:
        run_state_machine_as_test(machine, settings=settings.get_profile("inbox-model"))
    finally:
        if kind == "async":
            dispose(Inbox(bind, group="teardown"))
