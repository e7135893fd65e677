"""What ``outbox status`` reports: everything that waits, gathered read-only, and the verdict.

``gather`` returns the JSON document ``outbox status --json`` prints (its shape
is documented in docs/operations.md and versioned by ``"version"``), so the
human output, the JSON and the exit status are all read off one structure.
It reuses the admin queries (``relay.backlog``, ``relay.retrying_heads``,
``relay.shard_leases``, ``inbox.admin.stuck_by_group``), each on an index or on a
table as small as the shard count or as what is parked, so it stays cheap on a
big outbox table. A part whose tables are missing is ``null``: an outbox-only
or an inbox-only database is a normal set-up, not an error.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Engine, inspect

from ..core._envelope import utcnow
from ..core._errors import SchemaError
from ..core._schema import read
from ..inbox.admin import stuck_by_group
from ..producer import Outbox
from ..relay import backlog, retrying_heads, shard_leases

VERSION = 1


def _age(now: datetime, then: datetime | None) -> float | None:
    """Seconds since ``then``, rounded for reading; negative when ``then`` is ahead."""
    return None if then is None else round((now - then).total_seconds(), 1)


def _until(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round((then - now).total_seconds(), 1)


def gather(outbox: Outbox, *, group: str | None = None, stuck_after: float = 300.0) -> dict[str, Any]:
    """The status document: ``outbox``/``inbox`` parts (``null`` without their tables) and ``stuck``."""
    engine = _engine(outbox)
    tables = outbox.tables
    with engine.connect() as conn:
        found = inspect(conn)
        has_outbox = found.has_table(tables.messages.name, schema=tables.schema)
        has_inbox = all(found.has_table(t.name, schema=tables.schema)
                        for t in (tables.inbox_parked, tables.inbox_held))
        if not has_outbox and not has_inbox:
            where = "".join([f" with prefix {tables.prefix!r}" if tables.prefix else "",
                             f" in schema {tables.schema!r}" if tables.schema else ""])
            raise SchemaError(f"no outbox tables and no inbox tables{where} in this database "
                              "(run `outbox init-db`, or check --prefix/--schema)")
        inbox_groups = stuck_by_group(conn, tables, group) if has_inbox else None
    now = utcnow()
    doc: dict[str, Any] = {
        "version": VERSION,
        "checked_at": now.isoformat(),
        "stuck_after_s": stuck_after,
        "outbox": _outbox_part(outbox, now) if has_outbox else None,
        "inbox": None if inbox_groups is None else {"groups": [
            {"group": g.group, "parked_keys": g.parked_keys, "parked_messages": g.parked_messages,
             "oldest_parked_age_s": _age(now, g.oldest_parked), "held_messages": g.held_messages,
             "oldest_held_age_s": _age(now, g.oldest_held)} for g in inbox_groups]},
    }
    doc["stuck"] = stuck_reasons(doc)
    return doc


def _engine(outbox: Outbox) -> Engine:
    engine = outbox.engine
    assert isinstance(engine, Engine)
    return engine


def _outbox_part(outbox: Outbox, now: datetime) -> dict[str, Any]:
    # Read afresh, not the count the outbox kept (``load_schema``): a reader that lives on (the
    # console) would list the shards of the count before a reshard, and only those
    # (``shard_leases``), taking served shards for orphaned ones.
    with _engine(outbox).connect() as conn:
        shards = read(conn, outbox.tables).shard_count
    leases, relays = shard_leases(outbox, shards)
    held: dict[str, int] = {}
    for lease in leases:
        if lease.owner and lease.expires_at and lease.expires_at > now:
            held[lease.owner] = held.get(lease.owner, 0) + 1
    return {
        "shard_count": shards,
        "backlog": [{"topic": r.topic, "shard": r.shard, "pending": r.pending, "failed": r.failed,
                     "oldest_pending_age_s": _age(now, r.oldest_pending)} for r in backlog(outbox)],
        "retrying": [{"topic": h.topic, "key": h.key, "seq": h.seq, "message_id": str(h.message_id),
                      "attempts": h.attempts, "age_s": _age(now, h.created_at),
                      "next_try_in_s": _until(now, h.available_at), "last_error": h.last_error,
                      "waiting_behind": h.waiting} for h in retrying_heads(outbox)],
        "shards": [{"shard": lease.shard, "owner": lease.owner, "epoch": lease.epoch,
                    "state": _lease_state(lease.owner, lease.expires_at, now),
                    "expires_in_s": _until(now, lease.expires_at)}
                   for lease in leases],
        "relays": [{"worker_id": r.worker_id, "heartbeat_age_s": _age(now, r.heartbeat_at),
                    "shards": held.get(r.worker_id, 0)} for r in relays],
    }


def _lease_state(owner: str | None, expires_at: datetime | None, now: datetime) -> str:
    if owner is None:
        return "unowned"
    return "owned" if expires_at is not None and expires_at > now else "expired"


def stuck_reasons(doc: dict[str, Any]) -> list[str]:
    """Why the database needs a person, one sentence each; empty when nothing is stuck.

    Stuck: a failed row (it blocks its key until retried or skipped), a shard with
    pending rows and no live lease (nobody publishes it), a head retrying for more
    than ``stuck_after_s`` since it was written, a parked key, a gap held longer
    than ``stuck_after_s``. A backlog alone is not stuck: it is being worked off.
    """
    limit = doc["stuck_after_s"]
    reasons = []
    out = doc["outbox"]
    if out is not None:
        failed = sum(r["failed"] for r in out["backlog"])
        if failed:
            reasons.append(f"{failed} failed outbox row(s) block their keys (outbox failed list)")
        live = {s["shard"] for s in out["shards"] if s["state"] == "owned"}
        orphaned = sorted({r["shard"] for r in out["backlog"] if r["pending"] and r["shard"] not in live})
        if orphaned:
            reasons.append(f"shard(s) {', '.join(map(str, orphaned))} have pending rows and no live "
                           "relay lease (is a relay running?)")
        slow = [h for h in out["retrying"] if (h["age_s"] or 0) > limit]
        if slow:
            reasons.append(f"{len(slow)} key(s) wait behind a head retrying for over {limit:g} s "
                           f"(last error: {slow[0]['last_error']})")
    for g in (doc["inbox"] or {"groups": []})["groups"]:
        if g["parked_keys"]:
            reasons.append(f"group {g['group']}: {g['parked_keys']} parked key(s) "
                           f"(outbox parked list --group {g['group']})")
        if g["held_messages"] and (g["oldest_held_age_s"] or 0) > limit:
            reasons.append(f"group {g['group']}: a gap held for {g['oldest_held_age_s']:g} s")
    return reasons
