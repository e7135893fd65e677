"""Tenants are told apart by what their database servers say, not by how their URLs are spelled.

Issue 35's breaks: two relay tenants naming one schema through two spellings of
one database URL were both served (the schema's rows went out under whichever
took the leases first); an inbox tenant whose database was the default one
spelled another way took the unknown tenants' parked messages for its own, and
its replay ran its handler on another tenant's message. Each spelling here is
one a user could write: another host name for the address, a query parameter,
``dir/./file``, a symlink, a hard link, a relative path.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _relay_helpers import pending, publish, schema_outboxes, wait_for
from conftest import mariadb_of_its_own

from outbox import ConfigurationError, Inbox, Outbox, create_engine
from outbox.tenants import Tenant, TenantRelay, TenantShare, share_of
from outbox.testing import LocalMariaDB
from tests.inbox_support import record
from transports.memory import InMemoryBroker, InMemoryTransport

HEADER = "x-tenant"
ROOMY = 1_000_000 + 256
TOPIC = "orders"

POSTGRES_SPELLINGS: dict[str, Callable[[sa.URL], sa.URL]] = {
    "localhost for 127.0.0.1": lambda url: url.set(host="localhost"),
    "an added connect_timeout": lambda url: url.update_query_dict({"connect_timeout": "10"}),
    "an added application_name": lambda url: url.update_query_dict({"application_name": "relay"}),
}


def respelled(url: str, how: str) -> str:
    return POSTGRES_SPELLINGS[how](sa.make_url(url)).render_as_string(hide_password=False)


def fleet(tenants: Any, broker: InMemoryBroker, **kwargs: Any) -> TenantRelay:
    options: dict[str, Any] = dict(tenant_header=HEADER, poll_interval=0.1, lease_ttl=5.0, refresh_every=0.2)
    options.update(kwargs)
    return TenantRelay(tenants, lambda: InMemoryTransport(broker), **options)


# -- break 1: a relay's two tenants in one schema ---------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("how", sorted(POSTGRES_SPELLINGS))
def test_two_relay_tenants_in_one_schema_through_two_spellings_are_refused(
        pg: sa.Engine, postgres_db: str, topic: str, how: str) -> None:
    outboxes = schema_outboxes(pg, ["acme"], shards=2)
    publish(outboxes["acme"], topic, ["a"])
    both = [Tenant("acme", "acme", database=postgres_db),
            Tenant("impostor", "acme", database=respelled(postgres_db, how))]
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = fleet(lambda: both, broker)
    try:
        with pytest.raises(ConfigurationError, match="tenants 'acme' and 'impostor' name the same schema"):
            relay.refresh()
        assert relay.tenants == []
        both.pop()
        relay.run_once()
    finally:
        relay.close()
    assert [[v for n, v in r.headers if n == HEADER] for r in broker.records(topic)] == [[b"acme"]]


@pytest.mark.postgres
def test_the_default_database_and_a_respelled_url_of_it_are_one_database(
        pg: sa.Engine, postgres_db: str) -> None:
    schema_outboxes(pg, ["acme"], shards=2)
    impostor = Tenant("impostor", "acme", database=respelled(postgres_db, "localhost for 127.0.0.1"))
    relay = fleet([Tenant("acme", "acme"), impostor], InMemoryBroker(max_record_bytes=ROOMY), database=pg)
    try:
        with pytest.raises(ConfigurationError, match="'acme' and 'impostor'"):
            relay.refresh()
    finally:
        relay.close()


@pytest.mark.postgres
def test_two_tenants_in_two_schemas_of_one_database_are_both_served(pg: sa.Engine, postgres_db: str,
                                                                     topic: str) -> None:
    outboxes = schema_outboxes(pg, ["acme", "globex"], shards=2)
    for outbox in outboxes.values():
        publish(outbox, topic, ["k"])
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = fleet([Tenant("acme", "acme", database=postgres_db),
                   Tenant("globex", "globex", database=respelled(postgres_db, "localhost for 127.0.0.1"))],
                  broker)
    try:
        relay.run_once()
    finally:
        relay.close()
    sent = sorted(v for r in broker.records(topic) for n, v in r.headers if n == HEADER)
    assert sent == [b"acme", b"globex"]


@pytest.mark.postgres
def test_the_default_schema_named_and_unnamed_is_one_schema(pg: sa.Engine) -> None:
    relay = fleet([Tenant("acme"), Tenant("impostor", schema="public")],
                  InMemoryBroker(max_record_bytes=ROOMY), database=pg)
    try:
        with pytest.raises(ConfigurationError, match="'acme' and 'impostor'"):
            relay.refresh()
    finally:
        relay.close()


def test_a_sqlite_file_and_the_same_file_attached_as_a_schema_are_one_schema(tmp_path: Path) -> None:
    home = create_engine(f"sqlite:///{tmp_path / 'home.db'}")

    @sa.event.listens_for(home, "connect")
    def attach(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.execute(f"ATTACH DATABASE '{tmp_path / 'acme.db'}' AS acme")

    relay = fleet([Tenant("acme", schema="acme"), Tenant("impostor", database=f"sqlite:///{tmp_path}/acme.db")],
                  InMemoryBroker(max_record_bytes=ROOMY), database=home, notify_channel=None)
    try:
        with pytest.raises(ConfigurationError, match="'acme' and 'impostor'"):
            relay.refresh()
    finally:
        relay.close()
        home.dispose()


@pytest.mark.mysql
def test_a_mysql_schema_named_through_another_database_is_that_database(mysql_db: str) -> None:
    """On MySQL and MariaDB a schema is a database of the server: ``/mysql`` with schema ``t_x``
    and ``/t_x`` without one are one place."""
    url = sa.make_url(mysql_db)
    elsewhere = url.set(database="mysql").render_as_string(hide_password=False)
    both = [Tenant("acme", schema=url.database, database=elsewhere), Tenant("impostor", database=mysql_db)]
    relay = fleet(both, InMemoryBroker(max_record_bytes=ROOMY))
    try:
        with pytest.raises(ConfigurationError, match="'acme' and 'impostor'"):
            relay.refresh()
    finally:
        relay.close()


@pytest.fixture
def folding_mariadb() -> Iterator[LocalMariaDB]:
    """A MariaDB that keeps and compares database names in lower case (``lower_case_table_names=1``,
    the setting of Windows and macOS servers, and of many managed ones)."""
    yield from mariadb_of_its_own(("--lower-case-table-names=1",))


@pytest.mark.slow
@pytest.mark.mysql
def test_two_schema_names_a_folding_server_takes_for_one_are_one_schema(
        folding_mariadb: LocalMariaDB) -> None:
    relay = fleet([Tenant("acme", schema="Acme"), Tenant("impostor", schema="acme")],
                  InMemoryBroker(max_record_bytes=ROOMY), database=folding_mariadb.url)
    try:
        with pytest.raises(ConfigurationError, match="'acme' and 'impostor'"):
            relay.refresh()
    finally:
        relay.close()


class Running:
    def __init__(self, relay: TenantRelay) -> None:
        self.relay = relay
        self.thread = threading.Thread(target=relay.run, kwargs={"stop_timeout": 10}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.relay.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.relay.close()


@pytest.mark.slow
@pytest.mark.postgres
def test_two_tenants_in_one_schema_whose_database_was_down_at_the_reading_are_not_both_served(
        own_postgres: Any, topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """Down when the tenants were read, the database could not say who it is then: the second
    tenant to be built is refused by name when it answers, and the schema's rows go out under one."""
    url = own_postgres.url
    outbox = Outbox(create_engine(url, poolclass=sa.NullPool), shards=2)
    outbox.create_tables()
    publish(outbox, topic, ["k1", "k2", "k3"])
    own_postgres.stop()
    caplog.set_level(logging.ERROR, logger="outbox.relay")
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    running = Running(fleet([Tenant("acme", database=url),
                             Tenant("impostor", database=respelled(url, "localhost for 127.0.0.1"))], broker))
    try:
        wait_for(lambda: running.relay.problem() is not None and "unreachable" in running.relay.problem(),
                 30, "the database seen down")
        own_postgres.start()
        wait_for(lambda: pending(outbox) == 0, 30, "the rows sent")
        wait_for(lambda: any("name the same schema" in r.getMessage() for r in caplog.records), 30,
                 "the second tenant refused by name")
        assert len(running.relay.tenants) == 1
    finally:
        running.stop()
        outbox.engine.dispose()  # type: ignore[union-attr]
    names = {v for r in broker.records(topic) for n, v in r.headers if n == HEADER}
    assert len(names) == 1, names


# -- break 2: an inbox tenant in the default database's tables ---------------------------------------


def _sqlite_spellings(tmp_path: Path) -> dict[str, str]:
    default = tmp_path / "default.db"
    os.symlink(default, tmp_path / "link.db")
    os.link(default, tmp_path / "hard.db")
    return {"dir/./file": f"sqlite:///{tmp_path}/./default.db",
            "a symlink": f"sqlite:///{tmp_path}/link.db",
            "a hard link": f"sqlite:///{tmp_path}/hard.db",
            "a relative path": f"sqlite:///{os.path.relpath(default)}"}


def _with_tenant(name: str) -> Any:
    r = record(TOPIC, "k", 1, message_id=uuid.uuid4())
    r.headers.append((HEADER, name.encode()))
    return r


@pytest.mark.parametrize("how", ["dir/./file", "a symlink", "a hard link", "a relative path"])
def test_an_inbox_tenant_in_the_default_sqlite_database_spelled_otherwise_is_refused(
        tmp_path: Path, how: str) -> None:
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    with default.begin() as conn:  # the file exists (hard links need it)
        conn.exec_driver_sql("CREATE TABLE made (x INTEGER)")
    acme = Tenant("acme", database=_sqlite_spellings(tmp_path)[how])
    inbox = Inbox(default, group="g", tenants=[acme], tenant_header=HEADER)
    applied: list[str] = []
    inbox.handler(TOPIC)(lambda session, message: applied.append(message.headers[HEADER]))
    inbox.create_tables()
    with pytest.raises(ConfigurationError, match="tenant acme: its inbox tables would be the default"):
        inbox.handle(_with_tenant("initech"))
    with pytest.raises(ConfigurationError, match="tenant acme"):
        assert inbox.tenants
    assert applied == []
    default.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("how", sorted(POSTGRES_SPELLINGS))
@pytest.mark.parametrize("schema", [None, "public"])
def test_an_inbox_tenant_in_the_default_postgres_schema_spelled_otherwise_is_refused(
        postgres_db: str, how: str, schema: str | None) -> None:
    default = sa.create_engine(postgres_db)
    inbox = Inbox(default, group="g", tenant_header=HEADER,
                  tenants=[Tenant("acme", schema=schema, database=respelled(postgres_db, how))])
    inbox.handler(TOPIC)(lambda session, message: None)
    with pytest.raises(ConfigurationError, match="tenant acme: its inbox tables would be the default"):
        assert inbox.tenants
    default.dispose()


def test_an_inbox_tenant_in_its_own_schema_of_the_default_sqlite_database_is_served(tmp_path: Path) -> None:
    """The refusal is of the default database's own tables, not of the database: an attached
    schema, or the default database spelled otherwise with a schema attached, is the tenant's."""
    default = create_engine(f"sqlite:///{tmp_path}/default.db")

    @sa.event.listens_for(default, "connect")
    def attach(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.execute(f"ATTACH DATABASE '{tmp_path / 'acme.db'}' AS acme")

    inbox = Inbox(default, group="g", tenants=[Tenant("acme", schema="acme")], tenant_header=HEADER)
    inbox.handler(TOPIC)(lambda session, message: None)
    assert [t.name for t in inbox.tenants] == ["acme"]
    default.dispose()


@pytest.mark.slow
@pytest.mark.postgres
def test_two_inbox_tenants_in_one_schema_of_a_database_down_at_the_reading_are_refused_at_first_use(
        own_postgres: Any, tmp_path: Path) -> None:
    """Down at the reading, the database could not say who it is: the second tenant's tables are
    refused when first used (by the workers, or an operator's parked, replay, discard)."""
    url = own_postgres.url
    own_postgres.stop()
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    inbox = Inbox(default, group="g", tenant_header=HEADER, tenants=[
        Tenant("acme", database=url),
        Tenant("impostor", database=respelled(url, "an added connect_timeout"))])
    inbox.handler(TOPIC)(lambda session, message: None)
    inbox.create_tables()
    assert [t.name for t in inbox.tenants] == ["acme", "impostor"]  # read; their database unasked
    own_postgres.start()
    inbox.create_tables(tenant="acme")
    assert inbox.parked(tenant="acme") == []
    with pytest.raises(ConfigurationError, match="tenants 'acme' and 'impostor' name the same schema"):
        inbox.parked(tenant="impostor")
    default.dispose()


def test_two_inbox_tenants_in_one_sqlite_file_are_refused(tmp_path: Path) -> None:
    """They would share their dedup records: a message id applied for one would be a duplicate
    for the other (docs/tenants.md: "the same id delivered to two tenants is applied once in each")."""
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    inbox = Inbox(default, group="g", tenant_header=HEADER, tenants=[
        Tenant("acme", database=f"sqlite:///{tmp_path}/shared.db"),
        Tenant("globex", database=f"sqlite:///{tmp_path}/./shared.db")])
    inbox.handler(TOPIC)(lambda session, message: None)
    with pytest.raises(ConfigurationError, match="tenants 'acme' and 'globex' name the same schema"):
        assert inbox.tenants
    default.dispose()


# -- break 3: schemas_like's pattern ------------------------------------------------------------------


def _schemas_sql(engine: sa.Engine, verb: str, names: list[str]) -> None:
    """CREATE or DROP each schema (a database on MySQL and MariaDB), quoted: kept as spelled."""
    mysql = engine.dialect.name in ("mysql", "mariadb")
    quote, kind = ("`", "DATABASE") if mysql else ('"', "SCHEMA")
    with engine.begin() as conn:
        for name in names:
            extra = " IF EXISTS" if verb == "DROP" else ""
            cascade = " CASCADE" if verb == "DROP" and not mysql else ""
            conn.execute(sa.text(f"{verb} {kind}{extra} {quote}{name}{quote}{cascade}"))


@pytest.mark.parametrize("db", [pytest.param("postgres", marks=pytest.mark.postgres),
                                pytest.param("mysql", marks=pytest.mark.mysql)])
def test_schemas_like_takes_percent_alone_for_a_wildcard(request: pytest.FixtureRequest, db: str) -> None:
    """The docs' own ``tenant_%`` matched ``tenants`` and ``tenantX…`` (``_`` is LIKE's "any one
    character"): those schemas' rows were sent under tenants nobody listed."""
    from outbox.tenants import schemas_like

    url = request.getfixturevalue(f"{db}_db")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    stem = f"t{uuid.uuid4().hex[:6]}"
    wanted = [f"{stem}_acme", f"{stem}_globex", f"{stem}_"]
    others = [f"{stem}s", f"{stem}xacme", f"{stem}", f"{stem.upper()}_upper", f"x{stem}_acme", f"{stem}%"]
    _schemas_sql(engine, "CREATE", wanted + others)
    try:
        assert [t.name for t in schemas_like(engine, f"{stem}_%")()] == sorted(wanted)
        assert [t.name for t in schemas_like(engine, f"{stem}_ac%")()] == [f"{stem}_acme"]
        assert [t.name for t in schemas_like(engine, f"%{stem}_acme")()] == [f"{stem}_acme", f"x{stem}_acme"]
        assert [t.name for t in schemas_like(engine, f"{stem}_acme")()] == [f"{stem}_acme"]
    finally:
        _schemas_sql(engine, "DROP", wanted + others)
        engine.dispose()


def test_schemas_like_on_sqlite_reads_the_attached_databases(tmp_path: Path) -> None:
    from outbox.tenants import schemas_like

    engine = create_engine(f"sqlite:///{tmp_path / 'home.db'}")

    @sa.event.listens_for(engine, "connect")
    def attach(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        for name in ("tenant_acme", "tenants", "tenantx"):
            dbapi_connection.execute(f"ATTACH DATABASE '{tmp_path / name}.db' AS {name}")

    assert [t.name for t in schemas_like(engine, "tenant_%")()] == ["tenant_acme"]
    engine.dispose()


# -- tenant shares: two processes, each serving a share of one source --------------------------------

@pytest.mark.postgres
def test_two_names_of_one_schema_in_two_shares_are_refused_by_both_processes(
        pg: sa.Engine, postgres_db: str, topic: str) -> None:
    """Each process serves one of them: only if it looks at the whole source does it see the other.
    Served, every row of the schema went out under the name of whichever process leased it first."""
    assert share_of("acme", 2) != share_of("globex", 2)
    outboxes = schema_outboxes(pg, ["acme"], shards=2)
    publish(outboxes["acme"], topic, [f"k{i}" for i in range(5)])
    both = [Tenant("acme", "acme", database=postgres_db),
            Tenant("globex", "acme", database=respelled(postgres_db, "localhost for 127.0.0.1"))]
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relays = [fleet(lambda: both, broker, worker_id=f"share-{i}", share=TenantShare(i, 2)) for i in range(2)]
    try:
        for relay in relays:
            with pytest.raises(ConfigurationError, match=r"'(acme|globex)' and '(acme|globex)' name"):
                relay.refresh()
            assert relay.tenants == []
        both.pop()
        for relay in relays:
            relay.run_once()
    finally:
        for relay in relays:
            relay.close()
    assert {v for r in broker.records(topic) for n, v in r.headers if n == HEADER} == {b"acme"}


@pytest.mark.postgres
def test_a_tenant_of_this_share_in_the_schema_of_another_shares_is_refused_when_it_claims_it(
        pg: sa.Engine, postgres_db: str, topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading's check skips a database that does not answer at that moment; the schemas of the
    other shares' tenants are held for them, so the claim before serving refuses it still."""
    outboxes = schema_outboxes(pg, ["acme"], shards=2)
    publish(outboxes["acme"], topic, ["k"])
    mine = share_of("globex", 2)
    source = [Tenant("acme", "acme", database=postgres_db)]  # another share's
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = fleet(lambda: source, broker, share=TenantShare(mine, 2))
    try:
        relay.refresh()
        assert relay.tenants == []
        source.append(Tenant("globex", "acme", database=respelled(postgres_db, "localhost for 127.0.0.1")))
        # Its database did not answer the reading's check (a moment's outage): it is skipped there.
        monkeypatch.setattr(relay._tenants._claims, "refuse_shared", lambda tenants: None)
        relay.refresh()
        relay.run_once()
        assert relay.tenants == []
    finally:
        relay.close()
    assert broker.records(topic) == []


def test_a_share_pools_only_its_own_tenants_databases(tmp_path: Path, topic: str) -> None:
    """The other shares' databases are asked which schema they are through engines without a pool:
    the fleet keeps a pool, a listener and a renewal only for its share's."""
    names = [f"db{i}" for i in range(6)]
    tenants = [Tenant(name, database=f"sqlite:///{tmp_path / name}.db") for name in names]
    for tenant in tenants:
        outbox = Outbox(create_engine(str(tenant.database)), shards=2)
        outbox.create_tables()
        publish(outbox, topic, ["k"])
    share = TenantShare(0, 2)
    ours = sorted(name for name in names if share.holds(name))
    assert 0 < len(ours) < len(names)
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relay = fleet(tenants, broker, share=share)
    try:
        relay.run_once()
        pooled = sorted(Path(str(db.engine.url.database)).stem for db in relay._databases.values())
    finally:
        relay.close()
    assert pooled == ours
    assert sorted(v.decode() for r in broker.records(topic) for n, v in r.headers if n == HEADER) == ours


def name_in(share: int, count: int, prefix: str, avoid: frozenset[str] = frozenset()) -> str:
    """The first ``prefix<i>`` of share ``share`` of ``count``, not in ``avoid``."""
    i = 0
    while share_of(f"{prefix}{i}", count) != share or f"{prefix}{i}" in avoid:
        i += 1
    return f"{prefix}{i}"


@pytest.mark.postgres
def test_a_tenant_renamed_into_another_share_leaves_its_old_process_which_serves_its_next_tenants(
        pg: sa.Engine, postgres_db: str, topic: str) -> None:
    """One edit of the source renames acme (one share) to globex (the other), same schema, and
    adds a tenant of acme's share. acme's process held globex's schema for the other share while
    acme's own unit still claimed it: every reading was refused from then on, acme stayed served
    under its old name beside globex, and the new tenant never was."""
    a, b = share_of("acme", 2), share_of("globex", 2)
    assert a != b
    fresh = name_in(a, 2, "newco")
    outboxes = schema_outboxes(pg, ["acme", fresh], shards=2)
    source = [Tenant("acme", "acme", database=postgres_db)]
    broker = InMemoryBroker(max_record_bytes=ROOMY)
    relays = {k: fleet(lambda: list(source), broker, worker_id=f"share-{k}", share=TenantShare(k, 2))
              for k in (a, b)}
    try:
        for relay in relays.values():
            relay.refresh()
        assert relays[a].tenants == ["acme"]
        source[:] = [Tenant("globex", "acme", database=postgres_db),
                     Tenant(fresh, fresh, database=postgres_db)]
        for _ in range(2):
            for relay in relays.values():
                relay.refresh()
        assert relays[a].tenants == [fresh] and relays[b].tenants == ["globex"]
        publish(outboxes["acme"], topic, ["k"])
        for relay in relays.values():
            relay.run_once()
    finally:
        for relay in relays.values():
            relay.close()
    assert [v for r in broker.records(topic) for n, v in r.headers if n == HEADER] == [b"globex"]


@pytest.mark.postgres
def test_a_frozen_database_of_another_shares_tenant_holds_this_shares_reading_once(
        pg: sa.Engine, postgres_db: str) -> None:
    """A server that takes connections and answers nothing (SIGSTOP): asking it which schema the
    other share's tenant is costs a connect timeout, then it is left for a while; every reading
    waited for it, and this share's new tenants were picked up a timeout per frozen database late."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    other = Tenant(name_in(1, 2, "frozen"), "s",
                   database=f"postgresql+psycopg://u:p@127.0.0.1:{hole.getsockname()[1]}/db")
    own = name_in(0, 2, "own")
    schema_outboxes(pg, [own], shards=2)
    source = [other]
    relay = fleet(lambda: list(source), InMemoryBroker(max_record_bytes=ROOMY), share=TenantShare(0, 2))
    try:
        relay.refresh()  # pays the connect timeout once
        source.append(Tenant(own, own, database=postgres_db))
        started = time.monotonic()
        relay.refresh()
        took = time.monotonic() - started
        assert relay.tenants == [own]
        assert took < 3, took
    finally:
        relay.close()
        hole.close()


@pytest.mark.mysql
@pytest.mark.parametrize("wrong", ["password", "database"])
def test_another_shares_tenant_whose_database_refuses_this_process_leaves_this_shares_tenants_served(
        mysql_db: str, tmp_path: Path, wrong: str) -> None:
    """A wrong password, or a database not made yet (MariaDB's errors 1045 and 1049, no outage to
    the relay): that tenant is its own share's to refuse. Every process's reading failed."""
    own = name_in(0, 2, "own")
    own_url = f"sqlite:///{tmp_path / 'own.db'}"
    Outbox(create_engine(own_url), shards=2).create_tables()
    bad = sa.make_url(mysql_db).set(**({"password": "wrong-password"} if wrong == "password" else
                                       {"database": "not_made_yet"})).render_as_string(hide_password=False)
    source = [Tenant(name_in(1, 2, "other"), database=bad), Tenant(own, database=own_url)]
    relay = fleet(lambda: list(source), InMemoryBroker(max_record_bytes=ROOMY), share=TenantShare(0, 2))
    try:
        relay.refresh()
        assert relay.tenants == [own]
    finally:
        relay.close()
