"""The failover campaign's machinery: writers, worker processes, faults, and what is checked after.

``Campaign`` starts the load (writer threads committing keyed messages into the
outbox), two ``outbox relay`` and two ``outbox inbox run`` processes on a
``LocalKafkaCluster``, plays the faults one method each, and ``finish`` drains
and gathers a ``CampaignResult`` for the test to assert on
(``tests/test_failover_campaign.py`` says what is proved). Every wait has a
deadline and checks, while it waits, that no worker process exited.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from _relay_helpers import publish

from outbox import Inbox, Outbox, create_engine
from outbox.testing import LocalKafkaCluster, create_topic
from tests.inbox_support import effects, order_violations

ROOT = Path(__file__).resolve().parents[1]
MESSAGE_ID, SEQ = "outbox-message-id", "outbox-seq"
"""The envelope's headers (docs/concepts.md) the topic is read back by."""

PARTITIONS = 6
HOT_KEYS = 3
COLD_KEYS = 300
HOT_SHARE = 0.3
"""A third of the messages go to the hot keys."""
WRITERS = 2
MESSAGES_PER_TRANSACTION = 5
TRANSACTIONS_PER_SECOND = 20
"""Per writer: 2 writers, 20 transactions of 5 messages a second: 200 messages/s in all."""

PROGRESS = 200
"""Messages the pipeline must publish and apply after a fault before the next one."""
STEP_TIMEOUT = 180.0
OUTAGE_HOLD = 5.0
"""Seconds the two-of-three outage lasts after every worker said it waits."""

INBOX_APP = '''
from outbox import Inbox, create_engine
from tests.inbox_support import apply_effect

inbox = Inbox(create_engine({db!r}, pool_size=6), group={group!r}, concurrency=4, batch_size=20)
inbox.handler({topic!r})(apply_effect)
'''

# A group whose coordinator's node came back waits for its members' old sessions to expire before
# it assigns partitions again: 10 s instead of librdkafka's 45 s default.
CONSUMER_SETTINGS = ("-X", "session_timeout_ms=10000", "-X", "heartbeat_interval_ms=1000")

# ``python -m outbox`` with every thread's stack dumped to the log on SIGUSR1.
OUTBOX_COMMAND = (sys.executable, "-c", "import faulthandler, runpy, signal, sys; "
                  "faulthandler.register(signal.SIGUSR1, all_threads=True); sys.argv[0] = 'outbox'; "
                  "runpy.run_module('outbox', run_name='__main__', alter_sys=True)")

RELAY_DOWN, RELAY_UP = "broker unreachable (", "broker reachable again after"
INBOX_DOWN, INBOX_UP = "the broker unavailable (", "the broker available again after"


@dataclass
class Outage:
    """What the two-of-three outage of one cycle showed."""

    nodes: tuple[int, int]
    attempts_moved: list[int] = field(default_factory=list)
    """Rows whose attempt count rose while the two nodes were down."""
    tried_during: int = 0
    """Rows the relays tried (and pushed back) while the two nodes were down."""
    lines: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per process: (outage-began lines, outage-ended lines) logged from the kill to the recovery."""
    waited: float = 0.0
    """Seconds the two nodes were down."""
    said: dict[str, list[str]] = field(default_factory=dict)
    """Per process whose lines are not one each way: those lines, as logged (the timestamps tell
    a flapping tracker from two outages)."""


@dataclass
class Restart:
    """What one node's restart (SIGTERM, a controlled shutdown, then started again) showed."""

    node: int
    role: str
    """What the node was when stopped: the partitions it led and the coordinators it held."""
    lines: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per process: (outage-began, outage-ended) lines logged from the stop to the pipeline's progress."""
    said: dict[str, list[str]] = field(default_factory=dict)
    """Per process whose lines are not (0, 0) or (1, 1): those lines, as logged."""
    seconds: float = 0.0


@dataclass
class CampaignResult:
    seed: int
    messages: int
    records_on_topic: int
    exit_codes: dict[str, int | None]
    failed_rows: int
    counted_attempts: dict[str, tuple[int, str | None, str, str]]
    order_violations: list[Any]
    parked: int
    held: int
    alerts: list[str]
    doubled_effects: int
    missing_effects: list[str]
    unknown_effects: int
    applied_out_of_order: dict[str, list[int]]
    missing_on_topic: list[str]
    wire_out_of_order: dict[bytes, list[int]]
    redeliveries: int
    outages: list[Outage]
    steps: list[tuple[str, float]]
    restarts: list[Restart] = field(default_factory=list)

    def __str__(self) -> str:
        steps = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.steps)
        return (f"seed {self.seed}: {self.messages} messages, {self.records_on_topic} records on the topic "
                f"({self.records_on_topic - self.messages} duplicates), {self.redeliveries} redeliveries "
                f"dropped by the inbox; steps: {steps}; outages: "
                + "; ".join(f"nodes {o.nodes} down {o.waited:.0f} s, {o.tried_during} rows tried, "
                            f"lines {o.lines}" for o in self.outages)
                + ("; restarts: " + "; ".join(f"node {r.node} ({r.role}) {r.seconds:.0f} s, lines {r.lines}"
                                              for r in self.restarts) if self.restarts else ""))


class Worker:
    """One worker process and its log."""

    def __init__(self, name: str, command: list[str], log: Path, cwd: Path) -> None:
        self.name, self.log = name, log
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}
        with log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)

    def text(self, since: int = 0) -> str:
        with self.log.open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def size(self) -> int:
        return self.log.stat().st_size

    def assert_up(self) -> None:
        code = self.process.poll()
        assert code is None, f"{self.name} exited with {code}:\n{self.text()[-4000:]}"

    def dump_stacks(self) -> None:
        """Every thread's stack into the log (SIGUSR1: ``OUTBOX_COMMAND``), to see where it waits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


class Writers:
    """Threads committing keyed messages at a steady rate until stopped; a writer's error is kept."""

    def __init__(self, outbox: Outbox, topic: str, seed: int) -> None:
        self.outbox, self.topic = outbox, topic
        self.hot = [f"hot-{i}" for i in range(HOT_KEYS)]
        self.cold = [f"key-{i}" for i in range(COLD_KEYS)]
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._write, args=(random.Random(seed * 100 + w),),
                                          name=f"writer-{w}", daemon=True) for w in range(WRITERS)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _write(self, rng: random.Random) -> None:
        interval = 1 / TRANSACTIONS_PER_SECOND
        next_at = time.monotonic()
        try:
            while not self._stop.is_set():
                keys = sorted(rng.choice(self.hot) if rng.random() < HOT_SHARE else rng.choice(self.cold)
                              for _ in range(MESSAGES_PER_TRANSACTION))  # sorted: writers never deadlock
                publish(self.outbox, self.topic, keys, payload={"n": rng.randrange(10**9)})
                next_at += interval
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        assert not self.errors, f"a writer failed: {self.errors[0]!r}"


class Campaign:
    """The load, the workers and the faults of one campaign; a context manager (stops what it started)."""

    def __init__(self, cluster: LocalKafkaCluster, *, outbox_url: str, outbox_engine: sa.Engine,
                 inbox_url: str, topic: str, workdir: Path, seed: int,
                 relay_args: tuple[str, ...] = ()) -> None:
        """``relay_args``: more arguments of each ``outbox relay`` (``--exactly-once``)."""
        self.cluster, self.topic, self.workdir, self.seed = cluster, topic, workdir, seed
        self.relay_args = relay_args
        self.rng = random.Random(seed)
        self.outbox_url, self.inbox_url = outbox_url, inbox_url
        self.engine = outbox_engine
        self.outbox = Outbox(outbox_engine)
        self.inbox_engine = create_engine(inbox_url)
        self.group = f"failover-{topic}"
        self.steps: list[tuple[str, float]] = []
        self.outages: list[Outage] = []
        self.restarts: list[Restart] = []
        create_topic(cluster.bootstrap, topic, PARTITIONS)
        self.writers = Writers(self.outbox, topic, seed)
        self.busiest = -1  # the hottest key's partition, once its first row is published
        self.workers: list[Worker] = []
        self._reader: Any = None  # ``_asked_committed``'s consumer, made on first use

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> Campaign:
        (self.workdir / "service.py").write_text(
            INBOX_APP.format(db=self.inbox_url, group=self.group, topic=self.topic))
        servers = self.cluster.bootstrap
        for n in (1, 2):
            self.workers.append(Worker(f"relay-{n}", [
                *OUTBOX_COMMAND, "relay", "--db", self.outbox_url, "--bootstrap-servers",
                servers, "--worker-id", f"relay-{n}", *self.relay_args], self.workdir / f"relay-{n}.log",
                self.workdir))
        for n in (1, 2):
            self.workers.append(Worker(f"inbox-{n}", [
                *OUTBOX_COMMAND, "inbox", "run", "service:inbox", "--bootstrap-servers",
                servers, *CONSUMER_SETTINGS], self.workdir / f"inbox-{n}.log", self.workdir))
        self.writers.start()
        self._step("warm-up", self._find_the_busiest_partition)
        return self

    def __exit__(self, *exc: object) -> None:
        self.writers.stop()
        for worker in self.workers:
            worker.stop()
        if self._reader is not None:
            self._reader.close()
        self.inbox_engine.dispose()

    # -- the faults ---------------------------------------------------------------------------

    def kill_the_busiest_leader(self) -> None:
        def fault() -> None:
            leader = self.cluster.leader(self.topic, self.busiest)
            self.cluster.kill(leader)
            self.cluster.leader(self.topic, self.busiest)  # waits until another node leads it
            self._progress()
            self.cluster.start(leader)
        self._step("kill the busiest leader", fault)

    def freeze_a_follower(self) -> None:
        def fault() -> None:
            leader = self.cluster.leader(self.topic, self.busiest)
            follower = self.rng.choice([n.node_id for n in self.cluster.nodes if n.node_id != leader])
            self.cluster.freeze(follower)
            try:
                self._wait(lambda: follower not in self._isr().get(self.busiest, ()),
                           "the frozen follower to leave the ISR")
                self._progress()
            finally:
                self.cluster.thaw(follower)
        self._step("freeze a follower", fault)

    def kill_the_active_controller(self) -> None:
        def fault() -> None:
            controller = self.cluster.active_controller()
            self.cluster.kill(controller)
            self.cluster.active_controller(timeout=STEP_TIMEOUT)  # another one elected
            self._progress()
            self.cluster.start(controller)
        self._step("kill the active controller", fault)

    def lose_two_of_three(self) -> None:
        """Kill the group coordinator's node and one other: no quorum, min ISR unmet, the inbox cut
        off from its group even with nothing to commit (a consumer whose coordinator survives and
        that has nothing to commit meets nothing: it has nothing to say)."""
        coordinator = self._group_coordinator()
        other = self.rng.choice([n.node_id for n in self.cluster.nodes if n.node_id != coordinator])
        nodes = tuple(sorted((coordinator, other)))
        outage = Outage(nodes=(nodes[0], nodes[1]))

        def fault() -> None:
            logs = {worker.name: worker.size() for worker in self.workers}
            before = self._pending_rows()
            for node in nodes:
                self.cluster.kill(node)
            down_at = time.monotonic()
            # Every worker says once that it waits (a relay after its delivery timeout, 30 s).
            self._wait(lambda: not self._silent(logs, 0), "every relay and inbox to say the broker is gone",
                       suspects=lambda: self._silent(logs, 0))
            time.sleep(OUTAGE_HOLD)  # an outage that lasts: the workers keep trying meanwhile
            after = self._pending_rows()
            outage.attempts_moved = sorted(i for i, row in after.items()
                                           if row.attempts > (before[i].attempts if i in before else 0))
            outage.tried_during = sum(1 for i, row in after.items()
                                      if row.last_error is not None and (
                                          i not in before or row.available_at != before[i].available_at))
            self.cluster.start(*nodes)
            outage.waited = time.monotonic() - down_at
            self._wait(lambda: not self._silent(logs, 1), "every relay and inbox to say the broker is back",
                       suspects=lambda: self._silent(logs, 1))
            self._progress()
            outage.lines = {w.name: self._lines(w, logs[w.name]) for w in self.workers}
            outage.said = {w.name: self._said(w, logs[w.name]) for w in self.workers
                           if outage.lines[w.name] != (1, 1)}
        self._step("lose two of three nodes", fault)
        self.outages.append(outage)

    def restart_each_node_in_turn(self) -> None:
        """A rolling restart, as an operator does one: each node in turn (an order of the seed's)
        stopped with SIGTERM (a controlled shutdown: its partitions' leadership and its group and
        transaction coordinators move away before it exits) and started again; the next only once
        every replica is back in sync and the pipeline moved on (``_step``)."""
        nodes = [n.node_id for n in self.cluster.nodes]
        self.rng.shuffle(nodes)
        for node in nodes:
            self.restart_node(node)

    def restart_each_node_while_the_last_catches_up(self) -> None:
        """A hurried rolling restart: each node stopped (SIGTERM) as soon as the one before it, started
        again, is back among the cluster's brokers, before it is back in sync (``start`` returns only
        once it is): with ``min.insync.replicas`` 2 of 3, the partitions whose third replica still
        catches up are left with one in sync until it has (and, each node a controller too, the
        quorum with the one left and the one starting). One step, one ``Restart`` (node 0) whose role
        says, at each stop, whether every replica was in sync."""
        nodes = [n.node_id for n in self.cluster.nodes]
        self.rng.shuffle(nodes)
        restart = Restart(node=0, role="")
        logs = {worker.name: worker.size() for worker in self.workers}
        started = time.monotonic()
        in_sync: list[str] = []

        def fault() -> None:
            starting: list[threading.Thread] = []
            for node in nodes:
                in_sync.append(f"node {node} stopped {'in sync' if self._all_in_sync() else 'out of sync'}")
                self.cluster.stop(node)
                starting.append(threading.Thread(target=self.cluster.start, args=(node,), daemon=True))
                starting[-1].start()
                self._wait(lambda n=node: n in self._brokers(), f"node {node} back among the brokers")
            for thread in starting:
                thread.join(STEP_TIMEOUT)
        self._step("restart each node while the last catches up", fault)
        restart.role = f"order {nodes}: {', '.join(in_sync)}"
        self._record(restart, logs, started)

    def restart_the_transaction_coordinator(self) -> None:
        """Restart (SIGTERM, start) only the node that coordinates most of the relays' transactional
        ids: the coordinators move, and nothing else need (it may lead partitions too)."""
        [(node, _)] = Counter(self._transaction_coordinators().values()).most_common(1)
        self.restart_node(node)

    def restart_node(self, node: int) -> None:
        """Stop ``node`` with SIGTERM and start it again; record what each worker logged meanwhile."""
        restart = Restart(node=node, role=self._role(node))
        logs = {worker.name: worker.size() for worker in self.workers}
        started = time.monotonic()

        def fault() -> None:
            self.cluster.stop(node)
            self._progress()  # the pipeline goes on with two nodes
            self.cluster.start(node)
        self._step(f"restart node {node} ({restart.role})", fault)
        self._record(restart, logs, started)

    def _record(self, restart: Restart, logs: dict[str, int], started: float) -> None:
        """``restart`` with what each worker logged since ``logs`` (their sizes), kept for the result."""
        restart.seconds = time.monotonic() - started
        restart.lines = {w.name: self._lines(w, logs[w.name]) for w in self.workers}
        restart.said = {w.name: self._said(w, logs[w.name]) for w in self.workers
                        if restart.lines[w.name] not in ((0, 0), (1, 1))}
        self.restarts.append(restart)

    def _role(self, node: int) -> str:
        """What ``node`` leads and coordinates now: the topic's partitions, the group, transactional ids."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.cluster.bootstrap, "log_level": 0})
        partitions = admin.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        led = sorted(p for p, info in partitions.items() if info.leader == node)
        ids = sorted(shard for shard, n in self._transaction_coordinators().items() if n == node)
        group = " group coordinator," if self._group_coordinator() == node else ""
        controller = " controller," if self.cluster.active_controller() == node else ""
        return f"leads {led},{group}{controller} coordinates shards {ids}"

    def _transaction_coordinators(self) -> dict[int, int]:
        """Shard -> the node coordinating its transactional id (the leader of its partition of
        ``__transaction_state``: Kafka's ``abs(id.hashCode()) % partitions``), the id being
        ``outbox-{incarnation}-{shard}`` as docs/relay.md documents it."""
        from confluent_kafka.admin import AdminClient

        schema = self.outbox.load_schema(self.engine)
        admin = AdminClient({"bootstrap.servers": self.cluster.bootstrap, "log_level": 0})
        log = "__transaction_state"
        partitions = admin.list_topics(log, timeout=30).topics[log].partitions
        return {shard: int(partitions[coordinator_partition(f"outbox-{schema.incarnation}-{shard}",
                                                            len(partitions))].leader)
                for shard in range(schema.shard_count)}

    # -- the end ------------------------------------------------------------------------------

    def finish(self) -> CampaignResult:
        """Stop writing, wait for the backlog to drain through the inbox, stop the workers, gather."""
        self.writers.stop()
        total = self._count(self.engine, sa.select(sa.func.count()).select_from(self.outbox.tables.messages))
        self._wait(lambda: self._effects() >= total and not self._pending(), "the backlog to drain",
                   timeout=300)
        codes = {}
        alerts = []
        for worker in self.workers:
            worker.assert_up()
            codes[worker.name] = worker.stop()
            alerts += [line for line in worker.text().splitlines() if "ALERT" in line]
        return self._gather(codes, alerts)

    def _gather(self, codes: dict[str, int | None], alerts: list[str]) -> CampaignResult:
        m = self.outbox.tables.messages
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(m.c.message_id, m.c.key, m.c.seq, m.c.status, m.c.attempts,
                                          m.c.last_error, m.c.created_at, m.c.published_at)).all()
        tables = Inbox(self.inbox_engine, group=self.group).tables
        with self.inbox_engine.connect() as conn:
            applied = conn.execute(sa.select(effects.c.message_id, effects.c.key, effects.c.seq)
                                   .order_by(effects.c.id)).all()
            violations = conn.execute(sa.select(order_violations)).all()
            parked = conn.scalar(sa.select(sa.func.count()).select_from(tables.inbox_parked)) or 0
            held = conn.scalar(sa.select(sa.func.count()).select_from(tables.inbox_held)) or 0
            deliveries = conn.scalar(sa.select(sa.func.sum(tables.inbox_messages.c.deliveries))) or 0
        committed = {str(r.message_id) for r in rows}
        effect_ids = [str(e.message_id) for e in applied]
        by_key: dict[str, list[int]] = {}
        for e in applied:
            by_key.setdefault(e.key, []).append(e.seq)
        expected: dict[str, int] = {}
        for r in rows:
            expected[r.key] = max(expected.get(r.key, 0), r.seq)
        records = read_committed(self.cluster.bootstrap, self.topic)
        on_topic = {dict(r["headers"])[MESSAGE_ID].decode() for r in records}
        wire: dict[bytes, list[int]] = {}
        for r in records:  # partition, then offset order: a key lives in one partition
            seqs = wire.setdefault(r["key"], [])
            seq = int(dict(r["headers"])[SEQ])
            if seq not in seqs:
                seqs.append(seq)
        return CampaignResult(
            seed=self.seed, messages=len(rows), records_on_topic=len(records), exit_codes=codes,
            failed_rows=sum(1 for r in rows if r.status != "published"),
            counted_attempts={str(r.message_id): (r.attempts, r.last_error, f"{r.created_at:%H:%M:%S}",
                                                  f"{r.published_at:%H:%M:%S}")
                              for r in rows if r.attempts != 1},
            order_violations=list(violations), parked=parked, held=held, alerts=alerts,
            doubled_effects=len(effect_ids) - len(set(effect_ids)),
            missing_effects=sorted(committed - set(effect_ids)),
            unknown_effects=len(set(effect_ids) - committed),
            applied_out_of_order={k: s for k, s in by_key.items() if s != list(range(1, expected[k] + 1))},
            missing_on_topic=sorted(committed - on_topic),
            wire_out_of_order={k: s for k, s in wire.items()
                               if s != list(range(1, expected[k.decode()] + 1))},
            redeliveries=int(deliveries) - len(effect_ids), outages=self.outages, steps=self.steps,
            restarts=self.restarts)

    # -- waiting and reading ------------------------------------------------------------------

    def _step(self, name: str, fault: Callable[[], None]) -> None:
        """Play ``fault``; then wait until every replica is in sync and the pipeline moved on."""
        started = time.monotonic()
        print(f"{time.strftime('%H:%M:%S')} {name}", flush=True)
        fault()
        healed = self._offsets_once_answered()
        self._wait(self._all_in_sync, "every replica back in the ISR")
        self._progress()
        # The next fault starts from a pipeline at rest: an inbox whose commit was unanswered during
        # this fault says so only when the commit gives up, up to 10 s after the fault ended, and
        # ends that outage later still. A fault that began with an outage still open got no line of
        # its own from that worker (CI: "timed out … waiting for every relay and inbox to say the
        # broker is gone (still waiting for inbox-2)"). Offsets committed on every partition after
        # the fault ended come after any commit it left unanswered (each inbox commits one at a time).
        self._wait(lambda: self._committed_past(healed), "every partition's offsets committed again")
        self._wait(lambda: not self._in_outage(), "every relay and inbox to end the outage it logged",
                   suspects=self._in_outage)
        self.steps.append((name, time.monotonic() - started))
        print(f"{name}: {time.monotonic() - started:.1f} s", flush=True)

    def _progress(self) -> None:
        """Wait until the relays published and the inbox applied ``PROGRESS`` more messages."""
        published, applied = self._published(), self._effects()
        self._wait(lambda: (self._published() >= published + PROGRESS
                            and self._effects() >= applied + PROGRESS),
                   f"{PROGRESS} more messages published and applied")

    def _wait(self, condition: Callable[[], bool], what: str, timeout: float = STEP_TIMEOUT,
              suspects: Callable[[], list[Worker]] | None = None) -> None:
        """Wait for ``condition``; past ``timeout``, fail with each worker's last lines and every
        thread's stack. ``suspects``: the workers the condition waits for, named first, with their
        whole stacks (a tail of 2,000 characters holds only the end of the last thread's)."""
        deadline = time.monotonic() + timeout
        while not condition():
            for worker in self.workers:
                worker.assert_up()
            if time.monotonic() > deadline:
                named = suspects() if suspects is not None else []
                before = {worker.name: worker.size() for worker in self.workers}
                for worker in self.workers:
                    worker.dump_stacks()
                time.sleep(1)
                tails = "\n".join(
                    f"--- {w.name}: its last lines ---\n{w.text(max(0, before[w.name] - 3000))[:3000]}"
                    f"\n--- {w.name}: its stacks ---\n"
                    + (w.text(before[w.name]) if w in named else w.text(before[w.name])[-1000:])
                    for w in self.workers)
                still = f" (still waiting for {', '.join(w.name for w in named)})" if named else ""
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{still}\n{tails}")
            time.sleep(0.2)

    def _silent(self, logs: dict[str, int], which: int) -> list[Worker]:
        """The workers that logged no outage-began (``which`` 0) or outage-ended (1) line since ``logs``."""
        return [w for w in self.workers if not self._lines(w, logs[w.name])[which]]

    def _in_outage(self) -> list[Worker]:
        """The workers whose log has an outage that began and did not end."""
        return [w for w in self.workers if (lines := self._lines(w, 0))[0] > lines[1]]

    def _asked_committed(self) -> dict[int, int]:
        """The group's committed offset of each partition of the topic (-1: none yet), or nothing
        while its coordinator does not answer (moving): asked again. One reader for the campaign
        (it never joins the group): asked every 0.2 s while a step waits."""
        from confluent_kafka import Consumer, TopicPartition

        if self._reader is None:
            self._reader = Consumer({"bootstrap.servers": self.cluster.bootstrap, "group.id": self.group,
                                     "log_level": 0})
        try:
            found = self._reader.committed([TopicPartition(self.topic, p) for p in range(PARTITIONS)],
                                           timeout=30)
        except Exception:
            return {}
        return {tp.partition: tp.offset for tp in found}

    def _offsets_once_answered(self) -> dict[int, int]:
        """``_asked_committed``, waited for until the coordinator answers."""
        found: dict[int, int] = {}

        def answered() -> bool:
            found.update(self._asked_committed())
            return bool(found)
        self._wait(answered, "the group's offsets")
        return found

    def _committed_past(self, offsets: dict[int, int]) -> bool:
        now = self._asked_committed()
        return bool(now) and all(now[p] > offset for p, offset in offsets.items())

    def _lines(self, worker: Worker, since: int) -> tuple[int, int]:
        """(outage-began, outage-ended) lines of ``worker``'s log since byte ``since``."""
        down, up = (RELAY_DOWN, RELAY_UP) if worker.name.startswith("relay") else (INBOX_DOWN, INBOX_UP)
        text = worker.text(since)
        return text.count(down), text.count(up)

    def _said(self, worker: Worker, since: int) -> list[str]:
        """``worker``'s outage lines (both ways) since byte ``since``, as logged."""
        down, up = (RELAY_DOWN, RELAY_UP) if worker.name.startswith("relay") else (INBOX_DOWN, INBOX_UP)
        return [line[:300] for line in worker.text(since).splitlines() if down in line or up in line]

    def _find_the_busiest_partition(self) -> None:
        """The hottest key's partition, as the relay recorded it (the writers pick hot keys evenly)."""
        m = self.outbox.tables.messages
        query = sa.select(m.c.kafka_partition).where(m.c.key == self.writers.hot[0],
                                                     m.c.kafka_partition.is_not(None)).limit(1)
        self._wait(lambda: self._partition(query) >= 0,
                   "the hottest key's first row published")
        self.busiest = self._partition(query)

    def _partition(self, query: Any) -> int:
        with self.engine.connect() as conn:
            found = conn.scalar(query)
        return -1 if found is None else int(found)

    def _group_coordinator(self) -> int:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.cluster.bootstrap, "log_level": 0})
        found = admin.describe_consumer_groups([self.group])[self.group].result(30)
        return int(found.coordinator.id)

    def _brokers(self) -> set[int]:
        """The brokers the cluster's metadata names (registered and not fenced), nothing if none answers."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.cluster.live_bootstrap(), "log_level": 0})
        try:
            return set(admin.list_topics(timeout=5).brokers)
        except Exception:
            return set()

    def _isr(self) -> dict[int, tuple[int, ...]]:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.cluster.live_bootstrap(), "log_level": 0})
        try:
            found = admin.list_topics(self.topic, timeout=10).topics[self.topic]
        except Exception:
            return {}
        return {p: tuple(info.isrs) for p, info in found.partitions.items()}

    def _all_in_sync(self) -> bool:
        from confluent_kafka.admin import AdminClient

        if not all(n.running and not n.frozen for n in self.cluster.nodes):
            return False
        admin = AdminClient({"bootstrap.servers": self.cluster.bootstrap, "log_level": 0})
        try:
            topics = admin.list_topics(timeout=10).topics
        except Exception:
            return False
        return all(len(info.isrs) == len(info.replicas)  # the progress and transaction logs' too
                   for found in topics.values() for info in found.partitions.values())

    def _pending_rows(self) -> dict[int, Any]:
        m = self.outbox.tables.messages
        with self.engine.connect() as conn:
            found = conn.execute(sa.select(m.c.id, m.c.attempts, m.c.last_error, m.c.available_at)
                                 .where(m.c.status == "pending")).all()
        return {row.id: row for row in found}

    def _published(self) -> int:
        m = self.outbox.tables.messages
        return self._count(self.engine, sa.select(sa.func.count()).where(m.c.status == "published"))

    def _pending(self) -> int:
        m = self.outbox.tables.messages
        return self._count(self.engine, sa.select(sa.func.count()).where(m.c.status != "published"))

    def _effects(self) -> int:
        return self._count(self.inbox_engine, sa.select(sa.func.count()).select_from(effects))

    @staticmethod
    def _count(engine: sa.Engine, query: Any) -> int:
        with engine.connect() as conn:
            return int(conn.scalar(query) or 0)


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of ``__transaction_state`` (or ``__consumer_offsets``) whose leader coordinates
    ``key`` (a transactional id, a group; of characters of the BMP, one UTF-16 unit each): Kafka's
    ``Utils.abs(key.hashCode()) % partitions``."""
    h = 0
    for ch in key:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    h = h - (1 << 32) if h >= 1 << 31 else h
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def read_committed(bootstrap: str, topic: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Every record of ``topic`` a ``read_committed`` consumer sees, up to each partition's end,
    in partition, then offset order. A partition is read to its end once its end-of-partition event
    came there: its last offsets may be no record the reader sees (transaction markers, a settle's
    aborted empty records), and a transaction left open holds the event back (its last stable offset)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "earliest", "log_level": 3})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in partitions}
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        positions = dict.fromkeys(partitions, 0)
        records: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while any(positions[p] < ends[p] for p in partitions):
            assert time.monotonic() < deadline, f"read {positions} of {ends} in {timeout:.0f} s"
            for message in consumer.consume(10_000, 0.5):
                if message.error() is not None:
                    if message.error().code() == KafkaError._PARTITION_EOF:
                        positions[message.partition()] = max(positions[message.partition()], message.offset())
                    continue
                positions[message.partition()] = message.offset() + 1
                records.append({"partition": message.partition(), "offset": message.offset(),
                                "key": message.key(), "headers": list(message.headers() or [])})
    finally:
        consumer.close()
    return sorted(records, key=lambda r: (r["partition"], r["offset"]))
