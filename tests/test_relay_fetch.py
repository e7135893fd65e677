"""The relay's fetch on PostgreSQL: planned at a cost that does not grow with the shards (a relay
that keeps up), read lazily when a backlog waits, the same rows either way; plain and partitioned."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from _relay_helpers import ScriptedTransport, publish

from outbox import Outbox, Relay
from outbox.housekeeping import partition_outbox
from outbox.relay._sql import PostgresRelayStatements, statements_for

pytestmark = pytest.mark.postgres

SHARDS = tuple(range(16))


@pytest.fixture(params=["plain", "partitioned"])
def outbox(pg: sa.Engine, request: pytest.FixtureRequest) -> Outbox:
    ob = Outbox(pg)
    ob.create_tables()
    if request.param == "partitioned":
        partition_outbox(pg, ob.tables)
    return ob


def plan_nodes(conn: sa.Connection, statement: sa.Select[object], params: dict[str, object]) -> int:
    """How many nodes PostgreSQL's plan of ``statement`` has (what planning it costs grows with)."""
    compiled = statement.compile(dialect=conn.dialect)
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    cursor.execute("EXPLAIN (FORMAT JSON) " + str(compiled), compiled.construct_params(params))
    found = cursor.fetchone()[0]
    plan = found if isinstance(found, list) else json.loads(found)

    def count(node: dict[str, object]) -> int:
        return 1 + sum(count(child) for child in node.get("Plans", []))  # type: ignore[arg-type, attr-defined]
    return count(plan[0]["Plan"])


def fetch_params(limit: int, busy: list[int] = []) -> dict[str, object]:  # noqa: B006 (read only)
    """What the relay passes: ``busy`` as PostgreSQL's array literal (the statement casts it)."""
    return {"now": datetime.now(UTC), "limit": limit, "max_bytes": 2**30,
            "busy": "{" + ",".join(map(str, busy)) + "}"}


def test_the_fetch_of_a_relay_that_keeps_up_is_planned_once_whatever_the_shards(outbox: Outbox) -> None:
    """Every fetch is planned anew (psycopg forgets prepared statements at each rollback): a
    UNION ALL of a scan per shard made planning 16 shards (x 8 daily partitions) most of a quiet
    batch's time. The statement for a relay that keeps up has one plan for any number of shards."""
    publish(outbox, "orders", ["a", "b", None])
    sql = statements_for(outbox.tables, "postgresql")
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        one = plan_nodes(conn, sql.fetch((3,)), fetch_params(100))
        sixteen = plan_nodes(conn, sql.fetch(SHARDS), fetch_params(100))
    assert sixteen == one


def test_a_backlog_is_fetched_by_a_merge_that_stops_at_the_limit(outbox: Outbox) -> None:
    """With more rows due than a batch takes, a statement that reads every shard's rows up to the
    limit before sorting them reads up to shards x limit rows: the backlog's fetch merges the
    shards in id order and stops after ``limit`` rows."""
    publish(outbox, "orders", [f"k{i}" for i in range(400)])
    sql, m = statements_for(outbox.tables, "postgresql"), outbox.tables.messages
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        conn.exec_driver_sql("ANALYZE")
        compiled = sql.fetch(SHARDS, backlog=True).compile(dialect=conn.dialect)
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + str(compiled),
                       compiled.construct_params(fetch_params(10)))
        found = cursor.fetchone()[0]
    plan = found if isinstance(found, list) else json.loads(found)

    def scanned(node: dict[str, object]) -> int:
        """Rows the scans of the fetched table (not the key probe's ``prior``) returned."""
        own = 0
        if str(node.get("Alias", "")).startswith(m.name) and "Scan" in str(node["Node Type"]):
            own = int(node["Actual Rows"]) * int(node["Actual Loops"])  # type: ignore[call-overload]
        return own + sum(scanned(child) for child in node.get("Plans", []))  # type: ignore[arg-type, attr-defined]
    read = scanned(plan[0]["Plan"])
    assert 10 <= read <= 10 + len(SHARDS), read


def test_both_fetches_return_the_same_rows(outbox: Outbox) -> None:
    """Whatever the rows' states (published, failed heads, delayed, busy) and the limit, the
    statement for a relay that keeps up and the backlog's return the same rows in the same order."""
    rng = random.Random(37)
    keys = [rng.choice([f"k{i}" for i in range(40)] + [None]) for _ in range(600)]
    publish(outbox, "orders", keys)
    publish(outbox, "orders", ["k1", "k2", None], delay=timedelta(hours=1))
    m = outbox.tables.messages
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        ids = [r.id for r in conn.execute(sa.select(m.c.id).order_by(m.c.id))]
        conn.execute(sa.update(m).where(m.c.id.in_(rng.sample(ids, 200))).values(status="published"))
        conn.execute(sa.update(m).where(m.c.id.in_(rng.sample(ids, 15)), m.c.status == "pending")
                     .values(status="failed"))
        retried = rng.sample(ids, 15)
        conn.execute(sa.update(m).where(m.c.id.in_(retried), m.c.status == "pending")
                     .values(available_at=m.c.created_at + sa.text("interval '1 hour'"), attempts=1))
    sql = statements_for(outbox.tables, "postgresql")
    assert isinstance(sql, PostgresRelayStatements)
    compared = 0
    with outbox.engine.connect() as conn:  # type: ignore[union-attr]
        for shards in (SHARDS, (0, 5, 9), (7,)):
            for limit in (1, 7, 50, 1000):
                for busy in ([], rng.sample(ids, 60)):
                    params = fetch_params(limit, busy)
                    quiet = [tuple(r) for r in conn.execute(sql.fetch(shards), params)]
                    backlog = [tuple(r) for r in conn.execute(sql.fetch(shards, backlog=True), params)]
                    assert quiet == backlog, (shards, limit, len(busy))
                    compared += len(quiet)
    assert compared > 500  # the rows compared were not all left out


def test_a_full_fetch_makes_the_next_one_read_the_backlog(outbox: Outbox, monkeypatch) -> None:
    """The runner fetches for a backlog at its start and after a full fetch, and as a relay that
    keeps up after one that was not full."""
    seen: list[bool] = []
    fetch = PostgresRelayStatements.fetch

    def spy(self: PostgresRelayStatements, shards: object, *, backlog: bool = False) -> sa.Select[object]:
        seen.append(backlog)
        return fetch(self, shards, backlog=backlog)  # type: ignore[arg-type]
    monkeypatch.setattr(PostgresRelayStatements, "fetch", spy)
    publish(outbox, "orders", [f"k{i}" for i in range(7)])
    relay = Relay(outbox, ScriptedTransport({}), batch_size=3)
    try:
        fetched = [relay.run_once().fetched for _ in range(5)]
    finally:
        relay.close()
    assert fetched == [3, 3, 1, 0, 0]
    assert seen == [True, True, True, False, False]


def test_a_relay_keeps_its_backlog_fetch_prepared_and_plans_its_keeping_up_fetch_at_every_run(
        outbox: Outbox) -> None:
    """The fetch's transaction (read only) ends with a commit: psycopg forgets its prepared
    statements at a rollback, so a backlog fetch ended by one was parsed and planned again every
    batch. On a relay's one connection, after a dozen full batches the backlog's fetch (the UNION
    ALL) is prepared; after a dozen more batches of a relay keeping up, its fetch (LATERAL) is not:
    a plan kept from a table with no page read the whole table once per due row after a burst
    (``tests/test_relay_plans.py``)."""
    engine = outbox.engine
    assert isinstance(engine, sa.Engine)
    one = sa.create_engine(engine.url, poolclass=sa.pool.StaticPool)  # every statement on one connection
    relay = Relay(outbox, ScriptedTransport({}), engine=one, batch_size=2)
    try:
        for i in range(12):  # each fetch full: the next one is the backlog's
            publish(outbox, "orders", [f"k{i}", None])
            assert relay.run_once().published == 2
        for i in range(12):  # each fetch short: the relay keeps up
            publish(outbox, "orders", [f"q{i}"])
            assert relay.run_once().published == 1
        with one.connect() as conn:
            prepared = conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements").scalars().all()
    finally:
        relay.close()
        one.dispose()
    fetches = [statement for statement in prepared if "ORDER BY sized.id" in statement]
    assert len(fetches) == 1 and "UNION ALL" in fetches[0], prepared


@pytest.mark.parametrize("statement", ["look_ahead", "next_delayed"])
def test_the_delayed_rows_reads_send_one_text_whatever_the_shards(outbox: Outbox, pg: sa.Engine,
                                                                   statement: str) -> None:
    """A fleet's idle poll reads the delayed rows of its tenant's shards on every turn: the shards
    travel as one array, so the driver parses and the server receives the same text for any shard
    set (an expanding IN rendered a parameter per shard into the text at every run). And the
    array selects what the IN did: only the delayed row of the shards asked for."""
    later = datetime.now(UTC) + timedelta(hours=1)
    with outbox.begin() as session:
        outbox.publish(session, "orders", b"{}", key="a", delay=timedelta(hours=1))
    with pg.connect() as conn:  # the outbox's own engine (the fixture's)
        shard = conn.scalar(sa.select(outbox.tables.messages.c.shard))
    sql = statements_for(outbox.tables, "postgresql")
    sent: list[str] = []
    listener = lambda conn, cursor, text, params, context, many: sent.append(text)  # noqa: E731
    sa.event.listen(pg, "before_cursor_execute", listener)
    try:
        with pg.connect() as conn:
            since = datetime.now(UTC)
            answers = [conn.execute(getattr(sql, statement)(), {"since": since, "shards": shards}).first()
                       for shards in ([shard], list(SHARDS), [s for s in SHARDS if s != shard])]
    finally:
        sa.event.remove(pg, "before_cursor_execute", listener)
    assert len(sent) == 3 and len(set(sent)) == 1, sent
    found = [answer[0] for answer in answers]
    assert found[0] is not None and abs((found[0] - later).total_seconds()) < 60
    assert found[1] == found[0]
    assert found[2] is None


def test_a_polls_probe_says_due_exactly_when_the_fetch_has_a_row(outbox: Outbox, pg: sa.Engine) -> None:
    """An idle poll asks the probe first and fetches only when it says a row is due
    (``RelayStep.run(probe=True)``): whatever the rows' states (published, failed heads and the
    keys behind them, delayed, retried) and the shards asked, it says so exactly when the fetch
    returns a row, and it reads what the look-ahead reads."""
    rng = random.Random(41)
    m = outbox.tables.messages
    sql = statements_for(outbox.tables, "postgresql")
    subsets = [SHARDS, (0, 5, 9), (7,), (3, 11), (14,)]
    seen = set()
    for _ in range(8):
        publish(outbox, "orders", [rng.choice([f"k{i}" for i in range(12)] + [None]) for _ in range(30)])
        with pg.begin() as conn:
            pending = [r.id for r in conn.execute(sa.select(m.c.id).where(m.c.status == "pending"))]
            for status, n in (("published", 25), ("failed", 2)):
                chosen = rng.sample(pending, min(n, len(pending)))
                conn.execute(sa.update(m).where(m.c.id.in_(chosen)).values(status=status))
                pending = [i for i in pending if i not in chosen]
            conn.execute(sa.update(m).where(m.c.id.in_(rng.sample(pending, min(3, len(pending)))))
                         .values(available_at=m.c.created_at + sa.text("interval '1 hour'"), attempts=1))
        with pg.connect() as conn:
            for shards in subsets:
                now = datetime.now(UTC)
                params = {"since": now, "now": now, "shards": list(shards)}
                at, retried, due = conn.execute(sql.probe(), params).one()
                rows = conn.execute(sql.fetch(shards), fetch_params(1)).all()
                assert due == bool(rows), (shards, due, rows)
                assert (at, retried) == tuple(conn.execute(sql.look_ahead(), params).one())
                seen.add(due)
    assert seen == {True, False}  # both answers were met
