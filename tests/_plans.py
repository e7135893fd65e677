"""What the plan tests share: an outbox table's rows made by SQL, a table PostgreSQL takes for
empty, and the plans ``auto_explain`` reports of what a connection then runs, with their buffers.

``auto_explain`` is loaded in the session (``LOAD``: a superuser's), and logs each statement's plan
as a NOTICE to the client, so a test reads the plan of the very run the product made, prepared or
not, where ``EXPLAIN`` would plan the statement anew.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import sqlalchemy as sa
from _relay_helpers import wait_for

EXPLAIN_SETTINGS = ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_analyze = on", "SET auto_explain.log_buffers = on",
            "SET auto_explain.log_format = json", "SET auto_explain.log_level = notice",
            "SET client_min_messages = notice")


def insert_outbox_rows(conn: sa.Connection, n: int, status: str) -> None:
    conn.execute(sa.text(
        "INSERT INTO outbox_messages (message_id, topic, key, seq, shard, payload, content_type, headers, "
        "created_at, available_at, attempts, status) SELECT gen_random_uuid(), 'orders', 'k' || (g % 2000), "
        "g, g % 16, convert_to(repeat('x', 200), 'UTF8'), 'application/json', '{}', now(), now(), 0, "
        ":status FROM generate_series(1, :n) g"), {"n": n, "status": status})


def emptied(pg: sa.Engine, table: str, fill: Callable[[sa.Connection], None], *,
             truncate: bool = False) -> None:
    """``table`` filled, emptied and VACUUM ANALYZEd (what autovacuum does after its rows were
    deleted), or TRUNCATEd and ANALYZEd: no page, reltuples 0, "clearly empty" to the planner.

    VACUUM removes a deleted row only once no snapshot of the database can still see it; an
    autovacuum worker's ANALYZE of a catalog the test's CREATE TABLEs filled holds one (seen on a
    loaded CI host: the table kept its page). So the VACUUM waits for every snapshot older than
    the DELETE to end, as autovacuum's own next round would."""
    with pg.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        fill(conn)
        if truncate:
            conn.execute(sa.text(f"TRUNCATE {table}"))
            conn.execute(sa.text(f"ANALYZE {table}"))
        else:
            conn.execute(sa.text("BEGIN"))
            conn.execute(sa.text(f"DELETE FROM {table}"))
            deleted_by = conn.execute(sa.text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
            conn.execute(sa.text("COMMIT"))
            wait_for(lambda: _no_snapshot_sees(conn, deleted_by), 60, "the snapshots older than the DELETE")
            conn.execute(sa.text(f"VACUUM ANALYZE {table}"))
        pages, tuples = conn.execute(sa.text(
            "SELECT relpages, reltuples FROM pg_class WHERE relname = :t"), {"t": table}).one()
        assert (pages, tuples) == (0, 0), f"{table} not emptied: {pages} pages, {tuples} tuples"


def _no_snapshot_sees(conn: sa.Connection, xid: int) -> bool:
    """Whether no other session of this database holds a snapshot that sees ``xid``'s rows."""
    return not conn.execute(sa.text(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND backend_xmin IS NOT NULL AND backend_xmin::text::bigint <= :xid"), {"xid": xid}).first()


def explained(engine: sa.Engine) -> list[str]:
    """``auto_explain`` on ``engine``'s one connection (set in autocommit: a rollback would undo it);
    the NOTICEs it sends from now on, each the JSON plan of one statement with its buffers."""
    notices: list[str] = []
    with engine.connect() as conn:
        conn.rollback()
        raw = conn.connection.driver_connection
        assert raw is not None  # a connection just checked out has one
        autocommit = raw.autocommit
        raw.autocommit = True
        try:
            with raw.cursor() as cursor:
                for setting in EXPLAIN_SETTINGS:
                    cursor.execute(setting)
        finally:
            raw.autocommit = autocommit
        raw.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
    return notices


def explained_plans(notices: list[str], marker: Callable[[str], bool]) -> list[tuple[int, int]]:
    """(buffers, rows) of each statement whose text ``marker`` recognises (of an UPDATE: the rows
    it found)."""
    found = []
    for notice in notices:
        if "{" not in notice:
            continue
        plan = json.loads(notice[notice.index("{"):])
        if marker(plan["Query Text"]):
            top = plan["Plan"]
            if top["Node Type"] == "ModifyTable":  # what finding the rows cost, not writing them
                top = top["Plans"][0]
            found.append((top["Shared Hit Blocks"] + top["Shared Read Blocks"], top["Actual Rows"]))
    return found
