"""Helpers shared by the relay tests: publishing, draining, reading rows and the topic."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox import Outbox, Relay
from outbox.core._wire import SEQ
from outbox.tenants import TenantRelay
from transports import Outcome, Record, SendResult


def publish(outbox: Outbox, topic: str, keys: Sequence[str | None], *, payload: Any = None,
            **kwargs: Any) -> list:
    """Publish one message per key (in one transaction); returns their message ids."""
    ids = []
    with outbox._sessions() as session, session.begin():
        for i, key in enumerate(keys):
            body = payload if payload is not None else {"i": i}
            ids.append(outbox.publish(session, topic, body, key=key, **kwargs))
    return ids


def drain(relay: Relay, *, timeout: float = 20.0) -> None:
    """Run batches until every row is published or failed (or fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        relay.run_once()
        if not rows(relay.outbox, status="pending"):
            return
        time.sleep(0.02)
    raise AssertionError(f"still pending after {timeout}s: {rows(relay.outbox, status='pending')}")


def slow_writes(relay: Relay, monkeypatch: Any, seconds: float) -> None:
    """Each of ``relay``'s batch outcome writes starts ``seconds`` late (a slow commit)."""
    batch = relay._step._batch
    real_write = batch._write

    def slow_write(plan: Any) -> Any:
        time.sleep(seconds)
        return real_write(plan)

    monkeypatch.setattr(batch, "_write", slow_write)


def drain_pipelined(relay: Relay, monkeypatch: Any, *, timeout: float) -> None:
    """Run pipelined batches until no row is pending, each batch's mark written 1 s late: the next
    batch is sent (its progress record built) while the previous one is marked, so a shard's
    progress record names two batches of rows at once (exactly-once mode's largest record)."""
    slow_writes(relay, monkeypatch, 1.0)
    wait_for(lambda: (relay._step.run(wait=False), not rows(relay.outbox, status="pending"))[1], timeout,
             "every row published", interval=0.0)


def rows(outbox: Outbox, **where: Any) -> list[Any]:
    m = outbox.tables.messages
    query = sa.select(m).order_by(m.c.id)
    for name, value in where.items():
        query = query.where(m.c[name] == value)
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        return list(conn.execute(query))


def start_cli_relay(db: str, kafka: str, log: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "outbox", "relay", "--db", db, "--bootstrap-servers", kafka,
               "--log-level", "WARNING", *args]
    return subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT)


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def seqs_by_key(records: Sequence[Record]) -> dict[bytes, list[int]]:
    """First occurrence of each seq per key (keyed records only), in (partition, offset) order."""
    seen: dict[bytes, list[int]] = {}
    for record in records:
        if record.key is None:
            continue
        seq = int(dict(record.headers)[SEQ])
        order = seen.setdefault(record.key, [])
        if seq not in order:
            order.append(seq)
    return seen


class ScriptedTransport:
    """An in-memory transport whose outcomes a test decides, per message id.

    ``script[message_id]`` is a list of outcomes used one per attempt (then
    DELIVERED). It keeps the per-key contract like the real transports.
    """

    def __init__(self, script: dict | None = None) -> None:
        self.script: dict[str, list[Outcome]] = script or {}
        self.sent: list[Record] = []
        self.offset = 0

    def publish(self, records: Sequence[Record]) -> list[SendResult]:
        results, blocked = [], set()
        for record in records:
            if record.key is not None and record.key in blocked:
                results.append(SendResult(Outcome.RETRY, error="not sent"))
                continue
            message_id = dict(record.headers)["outbox-message-id"].decode()
            planned = self.script.get(message_id) or []
            outcome = planned.pop(0) if planned else Outcome.DELIVERED
            if outcome is Outcome.DELIVERED:
                self.sent.append(record)
                self.offset += 1
                results.append(SendResult(Outcome.DELIVERED, 0, self.offset))
            else:
                blocked.add(record.key)
                results.append(SendResult(outcome, error=f"scripted {outcome.value}"))
        return results

    def close(self, timeout: float = 10.0) -> None:
        pass


def schema_outboxes(engine: sa.Engine, names: Sequence[str], *, shards: int = 4) -> dict[str, Outbox]:
    """A schema per name in ``engine``'s database, each with its outbox tables: tenants of a fleet."""
    outboxes = {}
    for name in names:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
        outbox = Outbox(engine, schema=name, shards=shards)
        outbox.create_tables()
        outboxes[name] = outbox
    return outboxes


def pending(outbox: Outbox) -> int:
    return len(rows(outbox, status="pending"))


def owned_leases(outbox: Outbox) -> int:
    """Shard leases held by any relay now."""
    t = outbox.tables.leases
    engine = outbox.engine
    assert isinstance(engine, sa.Engine)
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).where(t.c.owner.is_not(None))) or 0


class Running:
    """A relay or a tenant fleet on a thread of its own; ``stop`` says how long ``run`` took to return
    (``error``: what ``run`` raised)."""

    def __init__(self, relay: Relay | TenantRelay, stop_timeout: float = 20) -> None:
        self.relay = relay
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(stop_timeout,), daemon=True)
        self.thread.start()

    def _run(self, stop_timeout: float) -> None:
        try:
            self.relay.run(stop_timeout=stop_timeout)
        except BaseException as exc:
            self.error.append(exc)

    def stop(self, *, close: bool = True, clean: bool = True) -> float:
        """Stop, wait for ``run`` to return, ``close`` the relay; ``clean``: ``run`` raised nothing."""
        asked = time.monotonic()
        self.relay.stop()
        self.thread.join(60)
        took = time.monotonic() - asked
        assert not self.thread.is_alive()
        if close:
            self.relay.close()
        if clean:
            assert self.error == []
        return took


class Killed(BaseException):
    """The process died here (nothing after it runs, nothing is cleaned up)."""


def killed_after_its_commit(worker: Relay, monkeypatch: Any) -> None:
    """``worker``'s first batch is committed to Kafka and the relay dies before the database hears of
    it (its batches run until it has a shard: a lease another relay held may have to expire first).
    ``monkeypatch`` is pytest's; undone before returning."""
    def die(plan: object) -> None:
        raise Killed

    monkeypatch.setattr(worker._step._batch, "_write", die)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            worker.run_once()
    except Killed:
        monkeypatch.undo()
        return
    raise AssertionError("the relay's first batch never reached its database write within 30 s")
