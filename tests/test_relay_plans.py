"""The relay's fetch and mark-published keep their plans when PostgreSQL's statistics are stale.

An outbox is ANALYZEd (by autovacuum) mostly while nothing is pending: after a burst was sent,
after retention purged the published rows. Its statistics then say no row is pending (status
'published' 100%, the partial indexes empty) until the next ANALYZE, however much is committed
meanwhile, and PostgreSQL plans on them; and a
statement that psycopg prepared on the server (the sixth run on a connection) may be run with
its generic plan, made without the parameters' values. Issue 37: with the plans that belief
gave, each fetch read the whole backlog (a million buffers for 5,000 rows) and the relay sent
3-8x slower, PostgreSQL's CPU tenfold.

These tests count the buffers each statement touches (``EXPLAIN (ANALYZE, BUFFERS)``), never
wall time: rows visited are what the plan decides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from _plans import EXPLAIN_SETTINGS, explained_plans, insert_outbox_rows
from _relay_helpers import ScriptedTransport
from psycopg import sql as psql

from outbox import Outbox, Relay

pytestmark = pytest.mark.postgres

BACKLOG = 20_000
LIMIT = 1_000
BUFFERS_PER_ROW = 8
"""A bounded fetch or mark touches a few pages per row (about 3 seen); a plan that reads the
whole backlog touches hundreds."""


def _after_published(conn: sa.Connection) -> None:
    """A burst sent: every row published, then ANALYZEd (autovacuum's threshold was crossed)."""
    insert_outbox_rows(conn, BACKLOG, "published")


def _after_purge(conn: sa.Connection) -> None:
    """Retention deleted every published row, then autovacuum ANALYZEd the table."""
    insert_outbox_rows(conn, BACKLOG, "published")
    conn.execute(sa.text("ANALYZE outbox_messages"))
    conn.execute(sa.text("DELETE FROM outbox_messages WHERE status = 'published'"))


@pytest.fixture(params=[_after_published, _after_purge], ids=["after-published", "after-purge"])
def stale(request: pytest.FixtureRequest, pg: sa.Engine) -> Iterator[Outbox]:
    """An outbox ANALYZEd with nothing pending, then a backlog of ``BACKLOG`` pending rows."""
    outbox = Outbox(pg)
    outbox.create_tables()
    with pg.begin() as conn:
        request.param(conn)
    with pg.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE outbox_messages"))
    with pg.begin() as conn:
        insert_outbox_rows(conn, BACKLOG, "pending")
    yield outbox


@pytest.fixture(params=["backlog", "keeping-up"])
def batch(request: pytest.FixtureRequest, stale: Outbox) -> list[tuple[str, dict[str, Any]]]:
    """Every statement one relay batch of ``LIMIT`` rows sent, with its parameters, in order; its fetch
    in the form for a backlog (a relay's first, a UNION ALL, ``LIMIT`` rows) or for a relay keeping
    up (LATERAL, which reads up to its limit in each shard: the limit is ``LIMIT`` / shards). Both
    are prepared on the server and may get their generic plans: the fetch's transaction ends
    with a commit, which psycopg keeps its prepared statements through."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def capture(*args: Any) -> None:
        sent.append((args[2], args[3]))

    engine = stale.engine
    assert isinstance(engine, sa.Engine)
    sa.event.listen(engine, "before_cursor_execute", capture)
    backlog = request.param == "backlog"
    limit = LIMIT if backlog else LIMIT // stale.shards
    relay = Relay(stale, ScriptedTransport(), worker_id="w", batch_size=limit)
    relay._step._batch._backlog = backlog
    try:
        assert relay.run_once().published == limit
    finally:
        relay.close()
        sa.event.remove(engine, "before_cursor_execute", capture)
    return sent


def _fetch(sent: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], str, dict[str, Any]]:
    """The relay's fetch, with the statement that set its session up before it (``relay._session``)."""
    at = next(i for i, (statement, _) in enumerate(sent) if statement.startswith("SELECT sized.id"))
    settings = [statement for statement, _ in sent[:at] if "set_config('enable_sort'" in statement][-1:]
    assert settings, "no session set up before the fetch"
    return settings, *sent[at]


def _mark(sent: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The relay's mark-published UPDATE."""
    return next((statement, params) for statement, params in sent if "published_at" in statement
                and statement.startswith("UPDATE outbox_messages SET attempts"))


def _buffers(conn: sa.Connection, statement: str, params: dict[str, Any], *,
             generic: bool) -> tuple[int, int]:
    """Shared buffers the statement touched and rows it returned or updated, in its custom plan
    (the values planned in) or its generic one (``PREPARE``, as psycopg's sixth run may get)."""
    if not generic:
        explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
        plan = conn.exec_driver_sql(explain + statement, params).scalar_one()
    else:
        names: list[str] = []

        def numbered(match: re.Match[str]) -> str:
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        conn.exec_driver_sql("PREPARE relay_statement AS " + re.sub(r"%\((\w+)\)s", numbered, statement))
        raw = conn.connection.driver_connection
        args = ", ".join(psql.Literal(params[n]).as_string(raw) for n in names)
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        plan = conn.exec_driver_sql(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE relay_statement({args})").scalar_one()
        conn.exec_driver_sql("DEALLOCATE relay_statement")
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    if top["Node Type"] == "ModifyTable":  # what finding the rows cost, not writing their new versions
        top = top["Plans"][0]
    return top["Shared Hit Blocks"] + top["Shared Read Blocks"], top["Actual Rows"]


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_the_fetch_reads_a_batch_not_the_backlog_on_stale_statistics(
        stale: Outbox, batch: list[tuple[str, dict[str, Any]]], generic: bool) -> None:
    settings, statement, params = _fetch(batch)
    with stale.engine.connect() as conn:  # type: ignore[union-attr]
        for setting in settings:  # what the relay set its session to, in this transaction alone
            conn.exec_driver_sql(setting)
        buffers, rows = _buffers(conn, statement, params, generic=generic)
        conn.rollback()
    limit = params["limit"]
    scans = stale.shards if "LATERAL" in statement else 1  # keeping up: up to ``limit`` rows a shard
    assert rows == limit
    assert buffers <= BUFFERS_PER_ROW * limit * scans, f"{buffers} buffers for {rows} rows"


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_marking_a_batch_published_reads_its_rows_not_the_backlog_on_stale_statistics(
        stale: Outbox, batch: list[tuple[str, dict[str, Any]]], generic: bool) -> None:
    statement, params = _mark(batch)
    with stale.engine.connect() as conn:  # type: ignore[union-attr]
        # As it was when the relay marked it, in this transaction only: the batch pending (the
        # seeded rows have no published_at), the leases the relay gave back when it closed held.
        conn.execute(sa.text("UPDATE outbox_messages SET status = 'pending', published_at = NULL "
                             "WHERE published_at IS NOT NULL"))
        conn.execute(sa.text("UPDATE outbox_leases SET owner = 'w'"))
        buffers, rows = _buffers(conn, statement, params, generic=generic)
        conn.rollback()
    limit = _fetch(batch)[2]["limit"]
    assert rows == limit  # every row found pending under a held lease: the fence let them through
    assert buffers <= BUFFERS_PER_ROW * limit, f"{buffers} buffers for {rows} rows"



def test_a_fetch_run_on_an_emptied_table_reads_a_batch_after_a_burst(pg: sa.Engine) -> None:
    """A relay keeping up runs its fetch while the table is empty, every poll and notification
    of a quiet hour; retention has emptied the table and VACUUM cut it to no page, which PostgreSQL
    takes for "clearly empty" whatever the statistics say. A plan made then and kept (psycopg
    prepares a statement at its fifth run, PostgreSQL may keep a generic plan after five more) is
    one for a table of no rows: each due row's "does an earlier row hold my key back" probe a Seq
    Scan of the whole table, a fetch growing with the square of a burst until autovacuum next
    ANALYZEs (seen: 853 ms for one row of 800, the fleet's quiet tenant). Then a burst commits:
    the same connection's next fetch, run as the relay runs it, must read a batch, not the table
    once per row. ``auto_explain`` reports the buffers of that very run (a NOTICE to the client)."""
    outbox = Outbox(pg)
    outbox.create_tables()
    with pg.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        insert_outbox_rows(conn, 100, "published")
        conn.execute(sa.text("DELETE FROM outbox_messages"))
        conn.execute(sa.text("VACUUM ANALYZE outbox_messages"))  # what autovacuum does after retention
        assert conn.execute(sa.text(
            "SELECT relpages, reltuples FROM pg_class WHERE relname = 'outbox_messages'")).one() == (0, 0)
    limit = LIMIT // outbox.shards  # what a relay keeping up asks of each shard
    relay = Relay(outbox, ScriptedTransport(), worker_id="w", batch_size=limit)
    try:
        assert relay.run_once().published == 0  # takes the leases; its first fetch is the backlog form
        batch = relay._step._batch
        owned = list(range(outbox.shards))
        statement = batch.sql.fetch(owned, backlog=False)
        notices: list[str] = []
        with batch.engine.connect() as taken:
            conn = batch.sql.prepare_fetch(taken)
            for _ in range(12):  # the relay's idle fetches: past psycopg's five and PostgreSQL's five
                idle = conn.execute(statement, batch.sql.fetch_params(datetime.now(UTC), limit, [], 2**30))
                assert idle.all() == []
            with pg.begin() as writer:  # a burst, committed faster than autovacuum ANALYZEs
                insert_outbox_rows(writer, BACKLOG, "pending")
            raw = conn.connection.driver_connection
            assert raw is not None  # a connection just checked out has one
            raw.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
            for setting in EXPLAIN_SETTINGS:
                conn.exec_driver_sql(setting)
            rows = conn.execute(statement, batch.sql.fetch_params(datetime.now(UTC), limit, [], 2**30)).all()
            conn.invalidate()  # auto_explain stays loaded in that session: not for the pool
    finally:
        relay.close()
    plans = explained_plans(notices, lambda text: text.startswith("SELECT sized.id"))
    assert len(plans) == 1, notices
    (buffers, _), = plans
    assert len(rows) == limit
    assert buffers <= BUFFERS_PER_ROW * limit * outbox.shards, f"{buffers} buffers for {len(rows)} rows"
