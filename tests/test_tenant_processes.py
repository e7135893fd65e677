"""``outbox relay --tenants`` processes against real databases and the session's Kafka broker (issue 27).

One tenant's database stopped while the others keep flowing, and a SIGKILL
campaign over a fleet of several processes. The topic is read back with a
real consumer: per tenant (told by the tenant header, checked against the
database the message came from) and per key, the first occurrences of the
seqs are 1, 2, 3 ...; a record seen twice is a redelivery of the same
message id, never another message.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import owned_leases, pending, publish, rows, schema_outboxes, wait_for

from outbox import Outbox, create_engine
from transports import Record
from transports.testing import read_topic

STOP_TIMEOUT = 10.0  # outbox relay's stop bound (docs/relay.md)
MESSAGE_ID, SEQ = "outbox-message-id", "outbox-seq"  # the envelope headers

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]

HEADER = "x-tenant"


def start_fleet(db: str, kafka: str, tenants_file: Path, log: Path,
                *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "outbox", "relay", "--db", db, "--bootstrap-servers", kafka,
               "--tenants", f"file:{tenants_file}", "--tenant-header", HEADER, "--log-level", "INFO",
               "--poll-interval", "0.2", *args]
    return subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT)




def check_topic(records: Sequence[Record], outboxes: dict[str, Outbox]) -> int:
    """Every tenant's every message on the topic under its tenant's name, per key in seq order.

    Returns the number of redelivered records.
    """
    tenant_of: dict[str, str] = {}
    expected: dict[tuple[str, str], list[int]] = {}
    for name, outbox in outboxes.items():
        stored = rows(outbox)
        assert {r.status for r in stored} == {"published"}, name
        for row in stored:
            tenant_of[str(row.message_id)] = name
            expected.setdefault((name, row.key), []).append(row.seq)
    seen: dict[str, tuple[str, str, int]] = {}
    got: dict[tuple[str, str], list[int]] = {}
    for record in records:
        headers = dict(record.headers)
        message_id = headers[MESSAGE_ID].decode()
        assert message_id in tenant_of, f"a record of no tenant's message: {message_id}"
        tenants = [value.decode() for name, value in record.headers if name == HEADER]
        assert tenants == [tenant_of[message_id]], (tenants, tenant_of[message_id])
        assert record.key is not None
        this = (tenants[0], record.key.decode(), int(headers[SEQ]))
        if message_id in seen:  # a redelivery: the very same message again
            assert seen[message_id] == this
            continue
        seen[message_id] = this
        got.setdefault(this[:2], []).append(this[2])
    assert set(seen) == set(tenant_of), (
        f"messages missing from the topic: {len(records)} records read, {len(seen)} ids of {len(tenant_of)}")
    assert got == {place: sorted(seqs) for place, seqs in expected.items()}
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in expected.values())
    return len(records) - len(seen)


@pytest.fixture
def pg(postgres_db: str) -> Iterator[sa.Engine]:
    engine = create_engine(postgres_db)
    yield engine
    engine.dispose()


@pytest.mark.slow
def test_one_tenant_database_stopped_while_the_others_flow(
        pg: sa.Engine, postgres_db: str, own_postgres: Any, kafka: str, topic: str,
        tmp_path: Path) -> None:
    shared = schema_outboxes(pg, ["a1", "a2"], shards=8)
    own = create_engine(own_postgres.url)
    solo = Outbox(own, shards=8)
    solo.create_tables()
    outboxes = {**shared, "solo": solo}
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps(
        ["a1", "a2", {"name": "solo", "database_env": "SOLO_DATABASE_URL"}]))
    log = tmp_path / "fleet.log"
    fleet = subprocess.Popen(
        [sys.executable, "-m", "outbox", "relay", "--db", postgres_db, "--bootstrap-servers", kafka,
         "--tenants", f"file:{tenants_file}", "--tenant-header", HEADER, "--log-level", "INFO",
         "--poll-interval", "0.2", "--lease-ttl", "3"],
        stdout=log.open("a"), stderr=subprocess.STDOUT,
        env={**os.environ, "SOLO_DATABASE_URL": own_postgres.url})
    keys = [f"k{i % 5}" for i in range(20)]
    frozen = False
    outage_log = ""
    try:
        for outbox in outboxes.values():
            publish(outbox, topic, keys)
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 60, "every tenant served")
        publish(solo, topic, keys)  # perhaps still pending when its database stops: it waits for it
        own.dispose()
        own_postgres.stop()
        for round_ in range(4):  # the others keep flowing meanwhile
            for outbox in shared.values():
                publish(outbox, topic, keys)
            wait_for(lambda: all(pending(o) == 0 for o in shared.values()), 40,
                     f"the other tenants in round {round_}")
        own_postgres.start()
        publish(solo, topic, keys)
        wait_for(lambda: pending(solo) == 0, 60, "the stopped tenant served again")
        # SIGTERM while its database is frozen (it answers nothing): the process exits within
        # its stop bound, the other tenants' leases given back.
        outage_log = log.read_text()
        own_postgres.freeze()
        frozen = True
        for outbox in shared.values():
            publish(outbox, topic, keys)
        wait_for(lambda: all(pending(o) == 0 for o in shared.values()), 40, "the others, once frozen")
        asked = time.monotonic()
        fleet.send_signal(signal.SIGTERM)
        code = fleet.wait(60)
        took = time.monotonic() - asked
    finally:
        if fleet.poll() is None:
            fleet.send_signal(signal.SIGTERM)
            code = fleet.wait(60)
        if frozen:
            own_postgres.thaw()
        own.dispose()
    text = log.read_text()
    assert code == 0, text[-3000:]
    print(f"\nstopped {took:.1f} s after SIGTERM with a tenant database frozen")
    assert took < STOP_TIMEOUT + 5, text[-3000:]
    assert all(owned_leases(o) == 0 for o in shared.values())
    total = sum(len(rows(o)) for o in outboxes.values())
    # To each partition's end: a count could be made up by a redelivery before every message was read.
    check_topic(read_topic(kafka, topic, expected=total, timeout=60, whole=True), outboxes)
    down = [line for line in outage_log.splitlines() if " unreachable (" in line]
    up = [line for line in outage_log.splitlines() if "reachable again" in line]
    assert len(down) == 1 and len(up) == 1, (down, up)
    assert f":{own_postgres.port}" in down[0]


@pytest.mark.slow
@pytest.mark.mysql
def test_a_tenant_fleet_loses_and_reorders_nothing_when_its_processes_are_killed(
        pg: sa.Engine, postgres_db: str, mysql_db: str, kafka: str, topic: str, tmp_path: Path) -> None:
    shared = schema_outboxes(pg, ["t1", "t2", "t3"], shards=8)
    maria = create_engine(mysql_db)
    own = Outbox(maria, shards=8)
    own.create_tables()
    outboxes = {**shared, "own": own}
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps(["t1", "t2", "t3", {"name": "own", "database": mysql_db}]))
    log = tmp_path / "fleet.log"

    names: list[str] = ["", "", ""]

    def start(n: int) -> subprocess.Popen[bytes]:
        names[n] = f"fleet-{n}-{uuid.uuid4().hex[:4]}"
        return start_fleet(postgres_db, kafka, tenants_file, log, "--workers", "2", "--lease-ttl", "2",
                           "--worker-id", names[n], "--batch-size", "200")

    fleets = [start(n) for n in range(3)]
    rng = random.Random(27)
    done = threading.Event()
    kills = 0

    def killer() -> None:
        nonlocal kills
        # Only a process that holds leases is killed (one still starting, which takes seconds on a
        # loaded machine, would prove nothing): every kill lands on a fleet at work.
        while not done.wait(rng.uniform(2, 4)):
            text = log.read_text()
            working = [n for n in range(len(fleets)) if f"relay {names[n]} took shards" in text]
            if not working:
                continue
            n = rng.choice(working)
            fleets[n].send_signal(signal.SIGKILL)
            fleets[n].wait()
            fleets[n] = start(n)
            kills += 1

    key_count, wanted_kills = 40, 5
    writing = threading.Event()

    def write(name: str, outbox: Outbox) -> None:
        # Writes go on until enough kills struck, so the processes die while they publish.
        mine = random.Random(name)
        while kills < wanted_kills and not writing.is_set():
            # Keys in sorted order inside a transaction: concurrent writers never deadlock.
            publish(outbox, topic, sorted(f"key-{mine.randrange(key_count)}" for _ in range(50)),
                    payload=b"x")

    killing = threading.Thread(target=killer)
    writers = [threading.Thread(target=write, args=item) for item in outboxes.items()]
    killing.start()
    try:
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join(120)
        assert kills >= wanted_kills
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 180, "every row published", 0.5)
    finally:
        writing.set()
        done.set()
        killing.join()
        for process in fleets:
            process.send_signal(signal.SIGTERM)
        for process in fleets:  # one restarted just now may die of the signal before it handles it
            process.wait(40)
        maria.dispose()
    total = sum(len(rows(o)) for o in outboxes.values())
    # To each partition's end: the kills' redeliveries could make up a count of records before
    # every message was read (as in test_relay_processes' campaign on CI).
    records = read_topic(kafka, topic, expected=total, timeout=90, whole=True)
    redelivered = check_topic(records, outboxes)
    print(f"\n{total} messages of {len(outboxes)} tenants, {len(records)} records, {redelivered} "
          f"redelivered, {kills} fleet processes killed while they held leases")


def lease_owners(outbox: Outbox) -> set[str]:
    t = outbox.tables.leases
    engine = outbox.engine
    assert isinstance(engine, sa.Engine)
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(t.c.owner).where(t.c.owner.is_not(None))))


def test_fleet_processes_given_shares_serve_each_tenant_from_one_of_them(
        pg: sa.Engine, postgres_db: str, kafka: str, topic: str, tmp_path: Path) -> None:
    """Two ``--tenant-share`` processes over eight tenants: each tenant's every shard lease is held by
    the process of its share (without shares each process would take half of every tenant's
    shards), and every message reaches the topic in per-key order."""
    from outbox.tenants import share_of

    names = [f"sh{i}" for i in range(8)]
    outboxes = schema_outboxes(pg, names, shards=4)
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps(names))
    log = tmp_path / "fleet.log"
    fleets = [start_fleet(postgres_db, kafka, tenants_file, log, "--worker-id", f"share-{index}",
                          "--tenant-share", f"{index}/2", "--lease-ttl", "3") for index in range(2)]
    keys = [f"k{i % 3}" for i in range(12)]
    try:
        assert {share_of(name, 2) for name in names} == {0, 1}  # both processes have tenants
        wait_for(lambda: all(owned_leases(o) == 4 for o in outboxes.values()), 60, "every tenant's leases")
        for outbox in outboxes.values():
            publish(outbox, topic, keys)
        wait_for(lambda: all(pending(o) == 0 for o in outboxes.values()), 60, "every tenant served")
        # A lease TTL and more: a process that also served another share's tenant would have its
        # part of that tenant's shards by now.
        time.sleep(4)
        owners = {name: lease_owners(outbox) for name, outbox in outboxes.items()}
    finally:
        for fleet in fleets:
            fleet.send_signal(signal.SIGTERM)
        codes = [fleet.wait(60) for fleet in fleets]
    assert codes == [0, 0], log.read_text()[-3000:]
    assert owners == {name: {f"share-{share_of(name, 2)}"} for name in names}, owners
    text = log.read_text()
    assert "share-0: tenant share 0/2: " in text and "share-1: tenant share 1/2: " in text, text[-3000:]
    check_topic(read_topic(kafka, topic, expected=len(names) * len(keys), timeout=60, whole=True), outboxes)
