"""Many relays' lease renewals in one PostgreSQL statement: what an idle fleet costs most.

A fleet renews every tenant's leases every TTL/3 (``outbox.tenants._renewal``).
Three statements a tenant (``Leases._heartbeat``: heartbeat, live relays with
the shard count, renewal) were 150 statements a second for 500 tenants with a
30 s TTL, and most of an idle fleet's CPU: the client's work is per statement
(build the parameters, send, read the answer), the server's per row. On
PostgreSQL the same three go for a chunk of tenants into one statement, each
tenant's in data-modifying CTEs over its own schema's tables:

- the heartbeat (``INSERT ... ON CONFLICT DO UPDATE``) and forgetting relays
  dead for ten TTLs (never this one: one statement changes a row once);
- the renewal of the shards this relay holds, by owner and shard, RETURNING
  what it renewed (the epoch is what fencing checks, as before);
- one read of the live relays and the stored shard count, tagged with the
  tenant's place in the chunk;
- and, once, ``set_config`` of this transaction's idle bound: the renewal
  holds the chunk's heartbeat and lease rows locked until its COMMIT, so a
  fleet frozen between the two (SIGSTOP, a VM stall) would hold another
  fleet's take of those leases, and its renewal (the same dead relays
  forgotten), for as long as it sleeps; PostgreSQL ends it after a lease TTL
  instead, as it ends a single relay's (``RelayStatements.end_if_idle``), and
  in the same round trip.

The read sees the snapshot before the heartbeat, which changes nothing: the
fair share counts this relay whether its own row is seen or not
(``fair_share``). Each tenant's ``Leases`` is held under its lock from the
round's start to taking the answer in (``Leases.shared_round``), as
``maintain`` holds it. The statement's text is built once per chunk of
schemas and kept; a tenant whose tables are gone fails the statement, and the
caller renews the chunk again tenant by tenant (``_renewal``).
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.sql.compiler import IdentifierPreparer

from ._leases import Answer, LeaseRound, Leases
from ._sql import idle_timeout_ms

Member = tuple[str | None, Leases, LeaseRound]
"""A tenant's schema (None: the connection's own), its leases, and its round (``Leases.shared_round``)."""


def renew_together(conn: Connection, members: list[Member]) -> list[Answer]:
    """The heartbeat, live relays, shard count and renewal of every member, in one statement.

    Runs in the caller's transaction; raises what the statement raised (one
    member's missing tables fail it for all). All members share the relay's
    worker id and TTL (one fleet process).
    """
    if not members:
        return []
    first = members[0][1]
    tables = first.tables
    statement = _statement(conn.dialect.identifier_preparer, tuple(schema for schema, _, _ in members),
                           (tables.relays.name, tables.leases.name, tables.meta.name))
    now = members[0][2].now
    params: dict[str, Any] = {
        "me": first.worker_id, "now": now, "expires": members[0][2].expires,
        "live_after": now - timedelta(seconds=first.ttl),
        "forget_before": now - timedelta(seconds=10 * first.ttl),
        "idle": str(idle_timeout_ms(first.ttl)),
    }
    for i, (_, _, round_) in enumerate(members):
        params[f"shards_{i}"] = round_.shards
    answers: list[Answer] = [([], None, []) for _ in members]
    for tenant, kind, value, epoch in conn.execute(statement, params):
        if kind == IDLE_BOUND:
            continue
        live, _, renewed = answers[tenant]
        if kind == 0:
            live.append(value)
        elif kind == 1:
            answers[tenant] = (live, int(value), renewed)
        else:
            renewed.append((int(value), int(epoch)))
    return answers


IDLE_BOUND = 3
"""The row kind of the statement's ``set_config`` (kinds 0-2: a live relay, the shard count, a renewal)."""


@lru_cache(maxsize=256)
def _statement(quote: IdentifierPreparer, schemas: tuple[str | None, ...], names: tuple[str, str, str]
               ) -> TextClause:
    """The chunk's statement, built once per chunk of schemas (the chunks are the same every round)."""
    ctes: list[str] = []
    reads: list[str] = []
    for i, schema in enumerate(schemas):
        where = f"{quote.quote_schema(schema)}." if schema is not None else ""
        relays, leases, meta = (where + quote.quote(name) for name in names)
        ctes.append(
            f"beat_{i} AS (INSERT INTO {relays} (worker_id, heartbeat_at) VALUES (:me, :now) "
            f"ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at), "
            f"forget_{i} AS (DELETE FROM {relays} WHERE heartbeat_at < :forget_before AND worker_id <> :me), "
            f"renew_{i} AS (UPDATE {leases} SET expires_at = :expires "
            f"WHERE owner = :me AND shard = ANY(CAST(:shards_{i} AS integer[])) RETURNING shard, epoch)")
        reads.append(
            f"SELECT {i}, 0, worker_id, NULL::bigint FROM {relays} WHERE heartbeat_at > :live_after "
            f"UNION ALL SELECT {i}, 1, value, NULL::bigint FROM {meta} WHERE name = 'shard_count' "
            f"UNION ALL SELECT {i}, 2, shard::text, epoch FROM renew_{i}")
    reads.append(f"SELECT 0, {IDLE_BOUND}, set_config('idle_in_transaction_session_timeout', :idle, true), "
                 "NULL::bigint")
    return text("WITH " + ", ".join(ctes) + " " + " UNION ALL ".join(reads))
