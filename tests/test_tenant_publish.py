"""Publishing for many tenants: one ``Outbox``, each row in its tenant's tables, under that tenant's settings.

A service routes a request to its tenant with SQLAlchemy's ``schema_translate_map``
(PostgreSQL schemas, MySQL/MariaDB databases of one server, SQLite attached
databases) or with an engine per tenant database. The tenants' tables here were
made with different shard counts and record limits, so a row sharded or
size-checked by another tenant's settings shows; every test would pass on the
code before tenants only if those settings were read per schema.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import ORMExecuteState, Session

from outbox import (
    AsyncOutbox,
    ConfigurationError,
    Outbox,
    OutboxTables,
    RecordTooLargeError,
    create_async_engine,
    create_engine,
)
from outbox.core._notify import notify_payload, parse_notify_payload
from outbox.core._sharding import shard_for_key
from outbox.testing import fresh_database, fresh_mysql_database

# tenant -> (shard count, record limit) its tables were made with; None: the default schema.
SETTINGS: dict[str | None, tuple[int, int]] = {
    None: (3, 1_000_000), "a": (1, 4096), "b": (7, 8192), "c": (16, 65536)}
TENANTS = ["a", "b", "c"]
KEYS = ["k0", "k1", "k2", "k3", "k4", "k5"]  # their shards differ between 3, 7 and 16 shards
MID_SIZED = b"x" * 6000  # over tenant a's record limit, under b's
NOW = datetime.now(UTC) - timedelta(minutes=5)

_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "mysql": "mysql+asyncmy",
                  "mariadb": "mariadb+asyncmy"}


@dataclass
class Tenancy:
    """One database with a schema per tenant, each holding outbox tables of its own settings."""

    engine: sa.Engine
    schemas: dict[str | None, str | None]
    attach: dict[str, Path] = field(default_factory=dict)  # SQLite: schema -> file attached as it

    def bind(self, tenant: str | None) -> sa.Engine:
        """The engine a request of ``tenant`` is served with: the tables' schema mapped to the tenant's."""
        if tenant is None:
            return self.engine
        return self.engine.execution_options(schema_translate_map={None: self.schemas[tenant]})

    def rows(self, tenant: str | None, topic: str) -> list[sa.Row]:
        m = OutboxTables(schema=self.schemas[tenant]).messages
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(m.c.message_id, m.c.key, m.c.seq, m.c.shard)
                                     .where(m.c.topic == topic).order_by(m.c.id)))

    def async_engine(self) -> AsyncEngine:
        url = self.engine.url
        engine = create_async_engine(
            url.set(drivername=_ASYNC_DRIVERS[url.get_backend_name()]).render_as_string(hide_password=False))
        if self.attach:
            attach_on_connect(engine.sync_engine, self.attach)
        return engine


def attach_on_connect(engine: sa.Engine, files: dict[str, Path]) -> None:
    """SQLite: every connection attaches each file under its schema name (SQLite's schemas)."""
    @sa.event.listens_for(engine, "connect")
    def _attach(dbapi_connection: Any, _record: Any) -> None:
        for schema, path in files.items():
            dbapi_connection.execute(f"ATTACH DATABASE '{path}' AS {schema}")


def make_tables(tenancy: Tenancy) -> Tenancy:
    for tenant, (shards, limit) in SETTINGS.items():
        Outbox(tenancy.engine, schema=tenancy.schemas[tenant], shards=shards,
               max_record_bytes=limit).create_tables()
    return tenancy


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                                        pytest.param("mysql", marks=pytest.mark.mysql)])
def tenancy(request, tmp_path_factory) -> Iterator[Tenancy]:
    """A database with tenants a, b, c and the default schema, on SQLite, PostgreSQL and MariaDB.

    Shared by the module's tests (each writes its own topics): making 4 sets of 9 tables is
    the slow part.
    """
    if request.param == "sqlite":
        root = tmp_path_factory.mktemp("tenants")
        files = {f"tenant_{t}": root / f"{t}.db" for t in [*TENANTS, "d", "e"]}
        engine = create_engine(f"sqlite:///{root / 'main.db'}")
        attach_on_connect(engine, files)
        yield make_tables(Tenancy(engine, {None: None, **{t: f"tenant_{t}" for t in [*TENANTS, "d", "e"]}},
                                  files))
        engine.dispose()
    elif request.param == "postgres":
        with fresh_database(request.getfixturevalue("postgres_server")) as url:
            engine = create_engine(url)
            schemas: dict[str | None, str | None] = {None: None}
            with engine.begin() as conn:
                for t in [*TENANTS, "d", "e"]:
                    conn.execute(sa.text(f"CREATE SCHEMA tenant_{t}"))
                    schemas[t] = f"tenant_{t}"
            yield make_tables(Tenancy(engine, schemas))
            engine.dispose()
    else:
        with fresh_mysql_database(request.getfixturevalue("mysql_server")) as url:
            engine = create_engine(url)
            database = engine.url.database
            schemas = {None: None, **{t: f"{database}_{t}" for t in [*TENANTS, "d", "e"]}}
            with engine.begin() as conn:
                for t in [*TENANTS, "d", "e"]:
                    conn.execute(sa.text(f"CREATE DATABASE `{schemas[t]}` CHARACTER SET utf8mb4"))
            try:
                yield make_tables(Tenancy(engine, schemas))
            finally:
                with engine.begin() as conn:
                    for t in [*TENANTS, "d", "e"]:
                        conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{schemas[t]}`"))
                engine.dispose()


def new_topic() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def assert_sharded_by_its_tenant(tenancy: Tenancy, tenant: str | None, topic: str) -> None:
    shards = SETTINGS[tenant][0]
    for row in tenancy.rows(tenant, topic):
        assert row.shard == shard_for_key(row.key, shards), (tenant, row)


def test_keys_shard_differently_per_tenant():
    """The test's own premise: a row sharded with another tenant's count would land elsewhere."""
    for first, second in [(3, 7), (7, 16), (3, 16), (1, 7)]:
        assert any(shard_for_key(k, first) != shard_for_key(k, second) for k in KEYS), (first, second)


def test_one_outbox_serves_each_tenant_with_its_own_settings(tenancy):
    """Interleaved tenants through one Outbox: shard count, record limit and seqs are each tenant's."""
    outbox = Outbox(tenancy.engine)
    topic = new_topic()
    # The record limit first: b (8192) accepts what a (4096) must refuse, whoever came first.
    with Session(tenancy.bind("b")) as session, session.begin():
        outbox.publish(session, topic, MID_SIZED, key="big")
    with Session(tenancy.bind("a")) as session, session.begin(), pytest.raises(
            RecordTooLargeError, match="max_record_bytes=4096"):
        outbox.publish(session, topic, MID_SIZED, key="big")
    published: dict[str | None, list[uuid.UUID]] = defaultdict(list)
    for round_ in range(3):
        for tenant in [*TENANTS, None]:
            with Session(tenancy.bind(tenant)) as session, session.begin():
                for key in KEYS:
                    published[tenant].append(outbox.publish(session, topic, {"r": round_}, key=key))
    for tenant in [*TENANTS, None]:
        rows = tenancy.rows(tenant, topic)
        assert [r.message_id for r in rows if r.key != "big"] == published[tenant]
        assert_sharded_by_its_tenant(tenancy, tenant, topic)
        by_key = defaultdict(list)
        for r in rows:
            by_key[r.key].append(r.seq)
        assert by_key.pop("big", [1]) == [1]  # b's one big record; a wrote none
        assert by_key == {key: [1, 2, 3] for key in KEYS}  # every tenant's keys count from 1
    assert [r.key for r in tenancy.rows("a", topic)].count("big") == 0


def test_translate_map_on_the_connection_and_an_explicit_schema(tenancy):
    """A map set on the session's connection routes too; ``Outbox(schema=…)`` is translated by its name."""
    topic = new_topic()
    outbox = Outbox(tenancy.engine)
    with Session(tenancy.engine) as session, session.begin():
        outbox.publish(session, topic, {}, key="k1")  # the default schema: its settings are kept now
    with Session(tenancy.engine) as session, session.begin():
        session.connection(execution_options={"schema_translate_map": {None: tenancy.schemas["b"]}})
        outbox.publish(session, topic, {}, key="k1")
        outbox.publish(session, topic, {}, key="k2")
    b_schema, c_schema = tenancy.schemas["b"], tenancy.schemas["c"]
    of_b = Outbox(tenancy.engine, schema=b_schema)
    with Session(tenancy.engine) as session, session.begin():
        of_b.publish(session, topic, {}, key="k1")
    with Session(tenancy.engine.execution_options(schema_translate_map={b_schema: c_schema})) as session, \
            session.begin():
        of_b.publish(session, topic, {}, key="k1")  # tables of schema b, mapped to c's
    assert [(r.key, r.seq) for r in tenancy.rows(None, topic)] == [("k1", 1)]
    assert [(r.key, r.seq) for r in tenancy.rows("b", topic)] == [("k1", 1), ("k2", 1), ("k1", 2)]
    assert [(r.key, r.seq) for r in tenancy.rows("c", topic)] == [("k1", 1)]
    for tenant in (None, "b", "c"):
        assert_sharded_by_its_tenant(tenancy, tenant, topic)


def test_tables_made_through_a_translate_map_are_the_tenants(tenancy):
    """``create_tables`` on a tenant's engine makes and stamps the tenant's tables, not the default's."""
    Outbox(tenancy.bind("d"), shards=5, max_record_bytes=5000).create_tables()
    outbox, topic = Outbox(tenancy.engine), new_topic()
    with Session(tenancy.bind("d")) as session, session.begin():
        for key in ["k1", "k2", "k1"]:
            outbox.publish(session, topic, {}, key=key)
        with pytest.raises(RecordTooLargeError, match="max_record_bytes=5000"):
            outbox.publish(session, topic, MID_SIZED, key="k1")
    rows = tenancy.rows("d", topic)
    assert [(r.key, r.seq) for r in rows] == [("k1", 1), ("k2", 1), ("k1", 2)]  # MySQL: the tenant's trigger
    assert all(r.shard == shard_for_key(r.key, 5) for r in rows)
    assert Outbox(tenancy.bind("d")).load_schema().shard_count == 5
    assert Outbox(tenancy.engine).load_schema().shard_count == SETTINGS[None][0]


@pytest.mark.parametrize("tenancy", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
                         indirect=True)  # release 0.1 had no MySQL: no such database exists there
def test_an_old_tenant_schema_upgrades_through_a_translate_map(tenancy):
    """``upgrade_tables`` on a tenant's engine brings that tenant's 0.1 tables up, in place.

    Each step looks before it alters: through a map it must look at the tenant's tables,
    not the default schema's, which are current.
    """
    from _schema_v01 import OutboxTables as TablesV01

    from outbox.core._schema import SCHEMA_VERSION

    old, topic = TablesV01(schema=tenancy.schemas["e"]), new_topic()
    old.metadata.create_all(tenancy.engine)
    row = {"topic": topic, "payload": b"{}", "content_type": "application/json", "headers": {},
           "created_at": NOW, "available_at": NOW, "attempts": 0, "status": "pending"}
    with tenancy.engine.begin() as conn:
        conn.execute(old.messages.insert(), [
            {**row, "message_id": uuid.uuid4(), "key": "k1", "seq": seq, "shard": shard_for_key("k1", 16)}
            for seq in (1, 2)])
        conn.execute(old.keys.insert(), [{"topic": topic, "key": "k1", "last_seq": 2}])
        conn.execute(old.leases.insert(), [{"shard": s, "owner": None, "epoch": 1, "expires_at": NOW}
                                           for s in range(16)])
    assert Outbox(tenancy.bind("e")).upgrade_tables() == (1, SCHEMA_VERSION)
    outbox = Outbox(tenancy.engine)
    with Session(tenancy.bind("e")) as session, session.begin():
        outbox.publish(session, topic, {}, key="k1")
    rows = tenancy.rows("e", topic)
    assert [r.seq for r in rows] == [1, 2, 3] and {r.shard for r in rows} == {shard_for_key("k1", 16)}
    assert Outbox(tenancy.engine).load_schema().shard_count == SETTINGS[None][0]


_PUBLISHES = st.lists(st.tuples(st.sampled_from([None, *TENANTS]), st.sampled_from(KEYS[:3]),
                                st.booleans()), min_size=1, max_size=14)


@settings(max_examples=20, deadline=None)
@given(publishes=_PUBLISHES)
def test_interleaved_publishes_keep_each_tenants_seqs_and_rows(tenancy, publishes):
    """Any interleaving of tenants and keys: each tenant's keys count 1..n in publish order, and no
    row reaches another tenant's tables. ``True`` commits the transaction after the publish, so a
    transaction may carry several publishes of one tenant."""
    outbox, topic = Outbox(tenancy.engine), new_topic()
    expected: dict[str | None, list[tuple[uuid.UUID, str]]] = defaultdict(list)
    session: Session | None = None
    current: str | None = None
    for tenant, key, commit in publishes:
        if session is not None and tenant != current:
            session.commit()
            session.close()
            session = None
        if session is None:
            session, current = Session(tenancy.bind(tenant)), tenant
            session.begin()
        expected[tenant].append((outbox.publish(session, topic, {}, key=key), key))
        if commit:
            session.commit()
            session.close()
            session = None
    if session is not None:
        session.commit()
        session.close()
    for tenant in [None, *TENANTS]:
        rows = tenancy.rows(tenant, topic)
        assert [(r.message_id, r.key) for r in rows] == expected[tenant]
        seqs: dict[str, list[int]] = defaultdict(list)
        for r in rows:
            seqs[r.key].append(r.seq)
        assert all(s == list(range(1, len(s) + 1)) for s in seqs.values()), (tenant, dict(seqs))
        assert_sharded_by_its_tenant(tenancy, tenant, topic)


def test_async_outbox_serves_each_tenant(tenancy):
    """``AsyncOutbox`` and ``Outbox(async_engine).publish_async`` follow an AsyncEngine's translate map."""
    topic = new_topic()

    async def scenario() -> None:
        engine = tenancy.async_engine()
        outbox, legacy = AsyncOutbox(engine), Outbox(engine)
        try:
            for tenant in ["b", "a", None, "c"]:
                bind = engine if tenant is None else engine.execution_options(
                    schema_translate_map={None: tenancy.schemas[tenant]})
                async with AsyncSession(bind) as session, session.begin():
                    for key in KEYS:
                        await outbox.publish(session, topic, {}, key=key)
                        await legacy.publish_async(session, topic, {}, key=key)
                    if tenant == "a":
                        with pytest.raises(RecordTooLargeError, match="max_record_bytes=4096"):
                            await outbox.publish(session, topic, MID_SIZED, key="k1")
                    else:
                        await legacy.publish_async(session, topic, MID_SIZED, key="big")
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    for tenant in [None, *TENANTS]:
        rows = tenancy.rows(tenant, topic)
        assert [r.seq for r in rows if r.key == "k1"] == [1, 2], tenant
        assert [r.key for r in rows].count("big") == (0 if tenant == "a" else 1)
        assert_sharded_by_its_tenant(tenancy, tenant, topic)


def test_one_outbox_over_an_engine_per_tenant_database(tmp_path):
    """Database per tenant: sessions of another engine than the Outbox's get that database's settings."""
    engines = {name: create_engine(f"sqlite:///{tmp_path / f'{name}.db'}") for name in ("a", "b")}
    Outbox(engines["a"], shards=1, max_record_bytes=4096).create_tables()
    Outbox(engines["b"], shards=7, max_record_bytes=8192).create_tables()
    outbox, topic = Outbox(engines["a"]), "orders"
    for name in ("a", "b", "a", "b"):
        with Session(engines[name]) as session, session.begin():
            for key in KEYS:
                outbox.publish(session, topic, {}, key=key)
    with Session(engines["b"]) as session, session.begin():
        outbox.publish(session, topic, MID_SIZED, key="big")
    for name, shards in (("a", 1), ("b", 7)):
        m = OutboxTables().messages
        with engines[name].connect() as conn:
            rows = conn.execute(sa.select(m.c.key, m.c.seq, m.c.shard).where(m.c.key != "big")).all()
        assert sorted(r.seq for r in rows if r.key == "k1") == [1, 2]
        assert all(r.shard == shard_for_key(r.key, shards) for r in rows), name
    for engine in engines.values():
        engine.dispose()


@pytest.mark.postgres
def test_a_session_of_another_kind_of_database_is_refused_by_name(postgres_db, tmp_path):
    """An Outbox made for SQLite and handed a PostgreSQL session says so, instead of running SQLite's SQL."""
    lite = create_engine(f"sqlite:///{tmp_path / 'lite.db'}")
    pg = create_engine(postgres_db)
    Outbox(pg).create_tables()
    with Session(pg) as session, session.begin(), pytest.raises(ConfigurationError, match="outbox per kind"):
        Outbox(lite).publish(session, "orders", {}, key="k")
    lite.dispose()
    pg.dispose()


def test_a_map_of_one_statement_is_refused_not_followed_blindly(tenancy):
    """A ``do_orm_execute`` hook that maps the statement alone would put a row in tenant b's tables
    sharded by the default schema's count: ``publish()`` refuses it, naming where to set the map."""
    outbox, topic, b_schema = Outbox(tenancy.engine), new_topic(), tenancy.schemas["b"]

    def route_to_b(state: Any) -> None:
        state.update_execution_options(schema_translate_map={None: b_schema})

    with Session(tenancy.engine) as session:
        sa.event.listen(session, "do_orm_execute", route_to_b)
        with pytest.raises(ConfigurationError, match="on the session's bind or on its connection"), \
                session.begin():
            outbox.publish(session, topic, {}, key="k1")
    assert tenancy.rows("b", topic) == [] and tenancy.rows(None, topic) == []


@pytest.mark.parametrize("tenancy", ["sqlite"], indirect=True)
def test_a_map_of_the_insert_alone_is_refused_where_the_seq_takes_two_statements(tenancy):
    """SQLite numbers a keyed row in two statements (bump the key's seq, then insert the row):
    a hook that maps only the row's INSERT put it in tenant b's tables with a seq counted in the
    default schema's keys (b's seqs then repeat). Only the first statement was checked."""
    outbox, topic, b_schema = Outbox(tenancy.engine), new_topic(), tenancy.schemas["b"]
    messages = outbox.tables.messages

    def route_rows_to_b(state: ORMExecuteState) -> None:
        if state.is_insert and state.statement.table is messages:
            state.update_execution_options(schema_translate_map={None: b_schema})

    with Session(tenancy.engine) as session:
        sa.event.listen(session, "do_orm_execute", route_rows_to_b)
        with pytest.raises(ConfigurationError, match="on the session's bind or on its connection"), \
                session.begin():
            outbox.publish(session, topic, {}, key="k1")
    assert tenancy.rows("b", topic) == [] and tenancy.rows(None, topic) == []


@pytest.mark.parametrize("tenancy", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_notify_payload_names_the_schema_the_row_went_to(tenancy):
    """A LISTEN connection hears ``<shard>:<schema>``, the schema as the server names it: the
    connection's ``current_schema()`` for a row written without one (not a bare ``<shard>``: a
    writer naming ``public`` and one relying on ``search_path`` say the same)."""
    import psycopg

    assert tenancy.engine.dialect.name == "postgresql"  # NOTIFY is PostgreSQL's
    b_schema, c_schema = tenancy.schemas["b"], tenancy.schemas["c"]
    outbox, of_b = Outbox(tenancy.engine), Outbox(tenancy.engine, schema=b_schema)
    cases = [  # (outbox, bind, key, the schema the payload must name)
        (outbox, tenancy.engine, "k1", None),
        (outbox, tenancy.bind("a"), "k1", tenancy.schemas["a"]),
        (outbox, tenancy.bind("c"), None, c_schema),  # unkeyed: the other statement
        (outbox, tenancy.bind("b"), "k4", b_schema),
        (of_b, tenancy.engine, "k2", b_schema),
        (of_b, tenancy.engine.execution_options(schema_translate_map={b_schema: c_schema}), "k5", c_schema),
        (outbox, tenancy.engine, None, None),
    ]
    with tenancy.engine.connect() as conn:
        default = conn.exec_driver_sql("SELECT current_schema()").scalar()
    dsn = tenancy.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN outbox")
        for publisher, bind, key, schema in cases:
            topic = new_topic()
            with Session(bind) as session, session.begin():
                publisher.publish(session, topic, {}, key=key)
            [note] = listener.notifies(timeout=5, stop_after=1)
            m = OutboxTables(schema=schema).messages
            with tenancy.engine.connect() as conn:
                shard = conn.scalar(sa.select(m.c.shard).where(m.c.topic == topic))
            assert shard is not None, (schema, "the row is not in the schema the payload names")
            named = schema if schema is not None else default  # the server's name, never None
            assert note.payload == f"{shard}:{named}"
            assert parse_notify_payload(note.payload) == (shard, named)


_IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,40}", fullmatch=True)


@given(shard=st.integers(0, 4095), schema=st.none() | _IDENTIFIERS)
def test_notify_payload_reads_back(shard, schema):
    assert parse_notify_payload(notify_payload(shard, schema)) == (shard, schema)


@pytest.mark.parametrize("payload", ["", "x", ":a", "1:", "-1", "1.0", "\uff11", " 1", "1 :a"])
def test_a_payload_of_another_sender_is_refused(payload):
    with pytest.raises(ValueError, match="not an outbox notification payload"):
        parse_notify_payload(payload)
