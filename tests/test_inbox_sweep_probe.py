"""The gap sweep as the probe of a tenant's gate (``_tenant_sweep``), attacked.

A sweep that met a tenant's database outage closes its gate; the sweep probes that gate in its turn
(``OutageGate.admit``), so that an idle tenant's gaps are parked again. The probe must keep the
gate's promises (docs/tenants.md, "Down"): one probe at a time, the inbox's outage backoff, one
WARNING when the database goes and one when it is back; and a sweep's reads that answer say nothing
of a transaction's writes. SQLite files, one per tenant; the in-memory broker.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Disposition, Inbox
from outbox.tenants import Tenant
from tests.inbox_support import record
from tests.test_inbox_holes import running, wait_for
from transports import Record
from transports.memory import InMemoryBroker, InMemorySource

TOPIC = "orders"
HEADER = "x-tenant"
GROUP = "g"
DOWN = "the database of tenant acme unavailable"
BACK = "the database of tenant acme available again"


def of(tenant: str, key: str, seq: int) -> Record:
    r = record(TOPIC, key, seq)
    r.headers.append((HEADER, tenant.encode()))
    return r


def told(caplog: pytest.LogCaptureFixture, words: str) -> list[float]:
    """When each log line containing ``words`` was written (``time.time()``)."""
    return [r.created for r in caplog.records if words in r.getMessage()]


class Locker(sqlite3.Connection):
    released: list[float]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released = []


@contextlib.contextmanager
def locked(engine: sa.Engine, how: str) -> Iterator[Locker]:
    """Another connection (not of ``engine``'s pool) holds ``BEGIN <how>`` on ``engine``'s SQLite
    file until the block ends, and then commits what it did; its ``released`` gets the
    ``time.time()`` it let go at."""
    locker = Locker(str(engine.url.database), isolation_level=None)
    try:
        locker.execute(f"BEGIN {how}")
        yield locker
    finally:
        locker.execute("COMMIT")
        locker.released.append(time.time())
        locker.close()


def handled_until(inbox: Inbox, r: Record, caplog: pytest.LogCaptureFixture, words: str) -> None:
    """``inbox.handle(r)`` on a thread of its own until a log line says ``words``; then the caller
    gives up waiting (``cancel``): nothing of it is put off any more."""
    given_up = threading.Event()
    ended: list[BaseException] = []

    def handle() -> None:
        try:
            inbox.handle(r, cancel=given_up)
        except BaseException as exc:
            ended.append(exc)

    caller = threading.Thread(target=handle, daemon=True)
    caller.start()
    wait_for(lambda: bool(told(caplog, words)), words)
    given_up.set()
    caller.join(10)
    assert [type(e).__name__ for e in ended] == ["StopRequested"]


def engines(tmp_path: Path, *names: str, timeout: float = 0.1) -> dict[str, sa.Engine]:
    """The default database and one SQLite file per tenant (a short busy timeout: a locked file
    fails fast, "database is locked": an outage)."""
    made = {"default": sa.create_engine(f"sqlite:///{tmp_path}/default.db")}
    made |= {name: sa.create_engine(f"sqlite:///{tmp_path}/{name}.db", connect_args={"timeout": timeout})
             for name in names}
    return made


def tenant_inbox(made: dict[str, sa.Engine], **options: Any) -> Inbox:
    inbox = Inbox(made["default"], group=GROUP, tenant_header=HEADER,
                  tenants=[Tenant(name, database=e) for name, e in made.items() if name != "default"],
                  **options)
    inbox.create_tables()
    for name in made:
        if name != "default":
            inbox.create_tables(tenant=name)
    return inbox


def test_a_sweep_probing_a_database_still_down_tells_it_once_and_backs_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The sweep probes the gate its own outage closed while the database is still down: that probe
    fails too. It used to tell the gate "answered" all the same (``OutageGate.answered(started)``,
    whose tracker took a probe begun after the outage was told for the database's answer): "available
    again" while the file was still locked, the next failure "unavailable" again, and the backoff
    started over at 0.2 s at each probe."""
    made = engines(tmp_path, "acme")
    failed: list[float] = []
    sa.event.listen(made["acme"], "handle_error", lambda context: failed.append(time.monotonic()))
    inbox = tenant_inbox(made, gap_timeout=1.0)
    inbox.handler(TOPIC)(lambda session, message: None)
    assert inbox.handle(of("acme", "k", 2)) == Disposition.HELD  # seq 1 never comes
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with locked(made["acme"], "EXCLUSIVE") as locker:
        until = time.monotonic() + 3
        while time.monotonic() < until:
            inbox.sweep()  # ten times faster than the runner's sweep
            time.sleep(0.1)
    # A probe stops at its first failed read; the backoff (0.2 s doubling, less a quarter at most) lets
    # five probes through in 3 s, not one per sweep (thirty here). Started over at each probe: fifteen.
    assert len(failed) <= 6, f"{len(failed)} failed reads in 3 s: the backoff started over"
    wait_for(lambda: inbox.sweep() or bool(inbox.parked(tenant="acme")), "acme's gap parked", timeout=8)
    assert [m.seq for m in inbox.parked(tenant="acme")] == [2]
    assert len(told(caplog, DOWN)) == 1, told(caplog, DOWN)
    back = told(caplog, BACK)
    assert len(back) == 1 and back[0] >= locker.released[0], "available again while the file was locked"
    for engine in made.values():
        engine.dispose()


def test_a_tenant_whose_writes_fail_while_its_reads_answer_is_not_opened_by_its_sweep(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another connection holds the tenant's write lock (``BEGIN IMMEDIATE``: a long writer; a full
    disk, too, fails writes, not reads): a transaction fails ("database is locked") and closes the gate,
    while the sweep's reads answer. The sweep used to probe that gate in its turn and open it: "available
    again" while no write could go in, "unavailable" again at the next transaction, every sweep. A gate
    a transaction closed is its put-off deliveries' to probe (here the caller gave up waiting: none)."""
    made = engines(tmp_path, "acme")
    inbox = tenant_inbox(made)
    inbox.handler(TOPIC)(lambda session, message: None)
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with locked(made["acme"], "IMMEDIATE") as locker:
        handled_until(inbox, of("acme", "k", 1), caplog, DOWN)  # the transaction's outage
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            inbox.sweep()  # past the gate's first retry time (0.2 s)
            time.sleep(0.1)
    assert inbox.handle(of("acme", "k", 1)) == Disposition.APPLIED
    assert len(told(caplog, DOWN)) == 1, told(caplog, DOWN)
    back = told(caplog, BACK)
    assert len(back) == 1 and back[0] >= locker.released[0], "available again while no write could go in"
    for engine in made.values():
        engine.dispose()


class Holders:
    """How many threads hold a connection of ``engine``'s pool at once: the most since ``reset``."""

    def __init__(self, engine: sa.Engine) -> None:
        self._lock = threading.Lock()
        self.now = self.most = 0
        sa.event.listen(engine, "checkout", self._out)
        sa.event.listen(engine, "checkin", self._in)

    def _out(self, *args: Any) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def _in(self, *args: Any) -> None:
        with self._lock:
            self.now -= 1

    def reset(self) -> None:
        with self._lock:
            self.most = self.now


def test_a_tenant_locked_for_long_is_probed_by_one_caller_at_a_time_and_holds_up_no_other(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """acme's file is locked for 3 s and each statement on it waits 1 s for the lock (its busy
    timeout): its sweep meets the outage and closes the gate, and records of acme and of globex
    come in. While acme is down one caller at a time waits on it (the probe: the sweep or a worker),
    the other workers put acme's records off, globex's are applied at once, and acme's after it.
    The sweep went on to its next reads after its first one failed, beside a worker's probe:
    the gate's failure had let the probing go (``OutageGate.failed``)."""
    made = engines(tmp_path, "acme", "globex", timeout=1.0)
    inbox = tenant_inbox(made, concurrency=4, batch_size=1)
    applied: dict[str, float] = {}
    inbox.handler(TOPIC)(lambda session, message: applied.setdefault(message.key or "", time.monotonic()))
    broker = InMemoryBroker(partitions=2)
    source = InMemorySource(broker, group_id=GROUP, topics=[TOPIC])
    holders = Holders(made["acme"])
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with running(inbox, source) as errors:
        broker.append(of("acme", "a-first", 1))  # acme's tables checked: its gate open, swept
        wait_for(lambda: "a-first" in applied, "acme's first record", errors=errors)
        with locked(made["acme"], "EXCLUSIVE"):
            holders.reset()
            wait_for(lambda: bool(told(caplog, DOWN)), "the sweep's outage", errors=errors)
            sent = time.monotonic()
            for n in range(4):
                broker.append(of("acme", f"a{n}", 1))
                broker.append(of("globex", f"g{n}", 1))
            wait_for(lambda: all(f"g{n}" in applied for n in range(4)), "globex's records", errors=errors)
            globex = max(applied[f"g{n}"] for n in range(4)) - sent
            time.sleep(max(0.0, sent + 3 - time.monotonic()))  # acme stays down 3 s past them
            most = holders.most
            acme_early = [key for key in applied if key.startswith("a") and key != "a-first"]
        wait_for(lambda: all(f"a{n}" in applied for n in range(4)), "acme's records", timeout=15,
                 errors=errors)
    assert acme_early == [], f"applied while acme's file was locked: {acme_early}"
    assert globex < 1.0, f"globex's records took {globex:.1f}s beside acme's outage"
    assert most == 1, f"{most} callers waited on acme's locked file at once"
    assert len(told(caplog, DOWN)) == 1, told(caplog, DOWN)
    assert len(told(caplog, BACK)) == 1, told(caplog, BACK)
    for engine in made.values():
        engine.dispose()


def drop_inbox_tables(connection: sqlite3.Connection) -> None:
    names = [n for (n,) in connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'inbox%'")]
    for name in names:
        connection.execute(f"DROP TABLE {name}")


def test_a_tenants_tables_dropped_while_its_gate_is_closed_by_an_outage_wait_for_a_worker_to_check(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """acme's sweep meets an outage (its file locked); whoever locked it drops acme's inbox tables
    before letting go. The sweep's next probe meets the missing tables: it fails nothing, opens
    nothing, and leaves the gate to a worker, which checks the tables (one ERROR), puts acme's records
    off, and applies them once they are made."""
    made = engines(tmp_path, "acme")
    inbox = tenant_inbox(made, gap_timeout=1.0)
    inbox.handler(TOPIC)(lambda session, message: None)
    assert inbox.handle(of("acme", "k", 2)) == Disposition.HELD
    caplog.set_level(logging.WARNING, logger="outbox.inbox")
    with locked(made["acme"], "EXCLUSIVE") as locker:
        inbox.sweep()  # the outage: acme's gate closes
        drop_inbox_tables(locker)
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        inbox.sweep()  # the probe meets the missing tables
        time.sleep(0.1)
    handled_until(inbox, of("acme", "other", 1), caplog, "tenant acme: its inbox tables are not usable")
    inbox.create_tables(tenant="acme")
    assert inbox.handle(of("acme", "other", 1)) == Disposition.APPLIED
    assert len(told(caplog, "tenant acme: its inbox tables are not usable")) == 1
    assert len(told(caplog, "tenant acme: its inbox tables are there now")) == 1
    assert len(told(caplog, DOWN)) == 1 and len(told(caplog, BACK)) == 1
    for engine in made.values():
        engine.dispose()


def test_a_tenant_removed_while_its_sweep_holds_its_closed_gate_leaves_the_others_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """acme (by URL: the inbox makes its engine, and closes its pool when no tenant is in it any more)
    is locked; its sweep meets the outage, closes its gate and probes it, hung on the lock, when acme
    is removed from the tenant source. Its next record parks as ``tenant_unknown`` in the default
    database; globex's records are applied all along; nothing fails when the hung probe comes back on
    a pool closed under it."""
    made = engines(tmp_path, "globex")
    acme_file = tmp_path / "acme.db"
    listed = [Tenant("acme", database=f"sqlite:///{acme_file}"), Tenant("globex", database=made["globex"])]
    inbox = Inbox(made["default"], group=GROUP, tenant_header=HEADER, tenants=lambda: list(listed),
                  tenant_refresh=0.2, concurrency=2, batch_size=1)
    inbox.create_tables()
    for tenant in listed:
        inbox.create_tables(tenant=tenant.name)
    applied: list[str] = []
    inbox.handler(TOPIC)(lambda session, message: applied.append(message.key or ""))
    broker = InMemoryBroker(partitions=2)
    source = InMemorySource(broker, group_id=GROUP, topics=[TOPIC])
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    acme = sa.create_engine(f"sqlite:///{acme_file}")  # only for the lock helper's file name
    with running(inbox, source) as errors:
        broker.append(of("acme", "a1", 1))
        broker.append(of("globex", "g1", 1))
        wait_for(lambda: {"a1", "g1"} <= set(applied), "both tenants served", errors=errors)
        with locked(acme, "EXCLUSIVE"):
            wait_for(lambda: bool(told(caplog, DOWN)), "the sweep's outage", errors=errors)
            listed.pop(0)
            wait_for(lambda: bool(told(caplog, "tenants: 1 served (0 added, 1 removed)")), "acme removed",
                     errors=errors)
            broker.append(of("acme", "a2", 1))
            broker.append(of("globex", "g2", 1))
            wait_for(lambda: "g2" in applied, "globex's record beside acme's outage", timeout=3,
                     errors=errors)
            wait_for(lambda: [m.key for m in inbox.parked()] == ["a2"], "acme's record parked as unknown",
                     timeout=5, errors=errors)
        broker.append(of("globex", "g3", 1))
        wait_for(lambda: "g3" in applied, "globex's next record", errors=errors)
    assert [(m.key, m.reason) for m in inbox.parked()] == [("a2", "tenant_unknown")]
    assert "a2" not in applied
    assert [r.getMessage()[:40] for r in caplog.records if r.levelno >= logging.ERROR] == [
        "ALERT message_parked topic=orders key=a2"]  # its alert, nothing else
    for engine in [*made.values(), acme]:
        engine.dispose()
