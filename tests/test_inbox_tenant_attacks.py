"""The inbox per tenant under input and faults nobody listed: what a client or a source can throw at it.

SQLite databases, one per tenant, so each example costs milliseconds. Every
record reaches exactly the tenant its tenant header (in any case) names, or parks as
``tenant_unknown`` in the default database; nothing a ``tenant_of`` returns or
raises escapes into the consumer thread; a tenant source that hangs holds up
neither the poll nor a worker (docs/tenants.md, "The inbox per tenant").
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import ConfigurationError, Disposition, Inbox, NotParkedError
from outbox.inbox._delivery import Named, Unnamed, decode
from outbox.tenants import Tenant
from tests.inbox_support import record
from tests.test_inbox_holes import wait_for
from transports import Record

TOPIC = "orders"
HEADER = "x-tenant"
SERVED = ("acme", "globex", "a" * 63, "dot.ted-name")


def found(engine: sa.Engine, message_id: uuid.UUID) -> list[str]:
    """Where ``message_id`` is in ``engine``'s inbox tables: "applied" and/or "parked:<reason>"."""
    where = []
    with engine.connect() as conn:
        if conn.scalar(sa.text("SELECT count(*) FROM inbox_messages WHERE message_id = :m"),
                       {"m": message_id.hex}):
            where.append("applied")
        where += [f"parked:{reason}" for reason in conn.scalars(
            sa.text("SELECT reason FROM inbox_parked WHERE message_id = :m"), {"m": message_id.hex})]
    return where


class Tenants:
    """An inbox on SQLite files: the default database and one per served tenant."""

    def __init__(self, tmp: Path, source: Callable[[], list[Tenant]] | None = None, **options: Any) -> None:
        self.engines = {name: sa.create_engine(f"sqlite:///{tmp}/{name}.db") for name in SERVED}
        self.default = sa.create_engine(f"sqlite:///{tmp}/default.db")
        self.listed = [Tenant(name, database=engine) for name, engine in self.engines.items()]
        self.inbox = Inbox(self.default, group="g", tenants=source or (lambda: list(self.listed)),
                           retry_backoff=0.001, retry_backoff_max=0.01, **options)
        self.inbox.handler(TOPIC)(lambda session, message: None)
        self.inbox.create_tables()
        for name in SERVED:
            self.inbox.create_tables(tenant=name)

    def where(self, message_id: uuid.UUID) -> dict[str | None, list[str]]:
        """Each database holding ``message_id`` (None: the default) and what it holds of it."""
        places: dict[str | None, list[str]] = {None: found(self.default, message_id)}
        places |= {name: found(engine, message_id) for name, engine in self.engines.items()}
        return {name: what for name, what in places.items() if what}


@pytest.fixture(scope="module")
def by_header(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    made = Tenants(tmp_path_factory.mktemp("tenants"), tenant_header=HEADER, tenant_refresh=0.01)
    yield made
    for engine in [made.default, *made.engines.values()]:
        engine.dispose()


# -- the tenant header as any bytes a client can send ---------------------------------------------

_values = st.one_of(
    st.sampled_from([name.encode() for name in SERVED]),
    st.sampled_from([b"", b"ACME", b"Acme", b"acme ", b" acme", b"acme\x00", b"acme\n", b"a" * 64,
                     b"acme\xff", b"\xed\xa0\x80", b"acme.", b"-acme", b"globex\x00acme"]),
    st.binary(max_size=80),
    st.builds(lambda n: b"acme" * n, st.integers(60, 300)),
)
_names = st.sampled_from([HEADER, HEADER, "X-Tenant", "x-tenant ", "x_tenant"])
_headers = st.lists(st.tuples(_names, st.one_of(st.none(), _values)), max_size=4)


def _expected_tenant(headers: list[tuple[str, bytes | None]]) -> str | None:
    """The tenant the record belongs to: its tenant header in any case (the last of each spelling),
    if every spelling of it names one served tenant."""
    spelled = {name: value for name, value in headers if name.lower() == HEADER}
    values = {(value or b"").decode("utf-8", "replace") for value in spelled.values()}
    name = values.pop() if len(values) == 1 else None
    return name if name in SERVED else None


@settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                   HealthCheck.too_slow])
@given(headers=_headers, other=st.sampled_from([None, b"fine", b"\xff\xfe"]))
def test_any_tenant_header_reaches_its_tenant_or_parks_as_unknown_in_the_default_database(
        by_header: Tenants, headers: list[tuple[str, bytes | None]], other: bytes | None) -> None:
    """Absent, empty, duplicated, case variants, invalid UTF-8, NUL, long: one place, never another's.

    A record whose tenant header (in any case: the last of each spelling, all of
    them naming one tenant) names a served tenant is there (applied, or parked unread when
    a header is not UTF-8); every other record is parked in the default
    database (as ``tenant_unknown``, or unread as ``foreign``), nowhere else.
    """
    r = record(TOPIC, None, None)
    r.headers.extend(cast(list[tuple[str, bytes]], headers))  # a null header value, as Kafka allows
    if other is not None:
        r.headers.append(("other", other))
    r.offset = next(_offsets)  # a record parked unread is known by its position: one each
    message_id = decode(r).message.message_id
    disposition = by_header.inbox.handle(r)
    tenant = _expected_tenant(headers)
    unreadable = any(not _is_utf8(value) for _, value in r.headers)
    where = by_header.where(message_id)
    if unreadable:  # never applied anywhere: parked for what it is, at its tenant or in the default
        assert (disposition, where) == (Disposition.PARKED, {tenant: ["parked:foreign"]})
    elif tenant is None:
        assert (disposition, where) == (Disposition.PARKED, {None: ["parked:tenant_unknown"]})
    else:
        assert (disposition, where) == (Disposition.APPLIED, {tenant: ["applied"]})


_offsets = itertools.count()


def _is_utf8(value: bytes | None) -> bool:
    try:
        (value or b"").decode()
    except UnicodeDecodeError:
        return False
    return True


# -- tenant_of returning or raising anything ------------------------------------------------------

class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be shown")


class _NoEquality:
    """What numpy arrays and some ORM objects do: ``==`` raises (or is no bool)."""

    def __eq__(self, other: object) -> bool:
        raise ValueError("the truth value is ambiguous")


class _Name(str):
    def __getitem__(self, index: Any) -> str:
        raise RuntimeError("sliced")


_returns = st.one_of(
    st.none(), st.text(max_size=70), st.sampled_from(SERVED), st.integers(), st.binary(max_size=8),
    st.builds(_NoEquality), st.builds(_Name, st.sampled_from(["acme", "nobody"])),
    st.builds(lambda text: ValueError(text), st.text(max_size=30)),  # raised, below
    st.builds(_Unprintable), st.just(KeyError("acme\x00\ud800")),
)


@settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(returned=_returns)
def test_whatever_tenant_of_returns_or_raises_the_record_gets_a_place_and_nothing_escapes(
        tmp_path_factory: pytest.TempPathFactory, returned: object) -> None:
    """``tenant_of`` is user code called on the consumer thread: an exception from it, or from its
    result's ``==`` or ``str()``, must not escape ``decode`` (it stopped the consumer); a served
    name (even as a ``str`` subclass) routes there, anything else parks as ``tenant_unknown``."""
    def tenant_of(message: Any) -> Any:
        if isinstance(returned, BaseException):
            raise returned
        return returned

    tenants = _tenant_of_tenants(tmp_path_factory)
    router = tenants.inbox.router
    assert router is not None
    router.tenant_of = tenant_of
    message_id = uuid.uuid4()
    r = record(TOPIC, None, None, message_id=message_id)
    tagged = router.tag(decode(r))
    named = str.__str__(returned)[:200] if isinstance(returned, str) else ""
    assert tagged.tenant == (Named(named) if named else Unnamed(""))
    assert not isinstance(tagged.tenant, Named) or type(tagged.tenant.name) is str
    served = named in SERVED
    disposition = tenants.inbox.handle(r)
    where = tenants.where(message_id)
    if served:
        assert (disposition, where) == (Disposition.APPLIED, {str.__str__(returned): ["applied"]})
    else:
        assert (disposition, where) == (Disposition.PARKED, {None: ["parked:tenant_unknown"]})


_BY_FUNCTION: dict[str, Tenants] = {}


def _tenant_of_tenants(factory: pytest.TempPathFactory) -> Tenants:
    """One inbox for every example (built once: the tables take longer than an example)."""
    if "made" not in _BY_FUNCTION:
        _BY_FUNCTION["made"] = Tenants(factory.mktemp("tenant_of"), tenant_of=lambda message: None,
                                       tenant_refresh=0.01)
    return _BY_FUNCTION["made"]


# -- a tenant source that hangs --------------------------------------------------------------------

def test_a_tenant_source_that_hangs_holds_up_neither_the_poll_nor_a_worker(tmp_path: Path) -> None:
    """The source read under the router's lock made ``ready()`` (the consumer thread, every poll)
    and every worker with a message of an unknown name wait for it: the poll stopped, the group
    session lapsed. Now a reading under way is not waited for: ``ready`` returns, the message of
    an unknown name waits on its lane, and a known tenant's message applies meanwhile."""
    hang, release = threading.Event(), threading.Event()
    listed = [Tenant(name, database=f"sqlite:///{tmp_path}/{name}.db") for name in SERVED]

    def source() -> list[Tenant]:
        if hang.is_set():
            release.wait(30)
        return listed

    tenants = Tenants(tmp_path, source=source, tenant_header=HEADER, tenant_refresh=0.01)
    router = tenants.inbox.router
    assert router is not None
    router.refresh(force=True)
    hang.set()
    try:
        time.sleep(0.02)  # the refresh is due
        router.ready()  # starts the background reading, which hangs
        deadline = time.monotonic() + 5
        while not router.places._reading.locked() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert router.places._reading.locked(), "the background reading did not start"

        done: dict[str, Any] = {}
        polled = threading.Thread(target=lambda: done.update(ready=router.ready()), daemon=True)
        polled.start()
        polled.join(2)
        assert "ready" in done, "ready() waited for the hung tenant source"

        unknown = decode(_with_tenant("initech"))
        worker = threading.Thread(target=lambda: done.update(
            settled=router.settle([router.tag(unknown)])), daemon=True)
        worker.start()
        worker.join(2)
        assert "settled" in done, "a worker waited for the hung tenant source"
        assert done["settled"].done == [] and len(done["settled"].later) == 1  # waits, not parked

        message_id = uuid.uuid4()
        assert tenants.inbox.handle(_with_tenant("acme", message_id)) is Disposition.APPLIED
        assert tenants.where(message_id) == {"acme": ["applied"]}
    finally:
        release.set()


def _with_tenant(name: str, message_id: uuid.UUID | None = None) -> Record:
    r = record(TOPIC, None, None, message_id=message_id)
    r.headers.append((HEADER, name.encode()))
    return r



# -- a tenant whose tables would be the default database's ----------------------------------------

def test_a_tenant_in_the_default_databases_own_tables_is_refused(tmp_path: Path) -> None:
    """Unknown tenants park in the default database's ``inbox_parked``. A tenant placed there too
    (no schema, no database of its own: ``from_query`` rows with NULLs give that) listed the
    unknown messages as its own parked ones, and ``replay(tenant=…)`` applied another tenant's
    message in its tables. Such a tenant is refused by name, as the first reading's error
    (``run()`` and ``handle()`` say it; a later reading keeps the tenants it had)."""
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    for same in (Tenant("acme"), Tenant("acme", database=default),
                 Tenant("acme", database=f"sqlite:///{tmp_path}/default.db")):
        inbox = Inbox(default, group="g", tenants=[same], tenant_header=HEADER)
        inbox.handler(TOPIC)(lambda session, message: None)
        with pytest.raises(ConfigurationError, match="tenant acme: its inbox tables would be the "
                                                     "default database's"):
            assert inbox.tenants
        with pytest.raises(ConfigurationError, match="tenant acme"):
            inbox.handle(_with_tenant("initech"))
    apart = Inbox(default, group="g", tenant_header=HEADER, tenants=[
        Tenant("acme", schema="acme"), Tenant("globex", database=f"sqlite:///{tmp_path}/globex.db")])
    assert [t.name for t in apart.tenants] == ["acme", "globex"]

    listed = [Tenant("globex", database=f"sqlite:///{tmp_path}/globex.db")]
    later = Inbox(default, group="g", tenant_header=HEADER, tenants=lambda: listed)
    assert [t.name for t in later.tenants] == ["globex"]
    listed = [*listed, Tenant("acme")]
    assert later.router is not None
    later.router.refresh(force=True)
    assert [t.name for t in later.tenants] == ["globex"]
    default.dispose()


# -- a tenant that leaves ---------------------------------------------------------------------------

def test_a_tenant_database_no_tenant_is_in_any_more_has_its_pool_closed(tmp_path: Path) -> None:
    """The engine made for a tenant's database URL kept its pooled connections open after the
    tenant left the source, for as long as the process ran: on PostgreSQL a ``DROP DATABASE`` of
    the departed tenant then fails ("is being accessed by other users"). Now the next reading
    closes them; the tenant coming back gets a fresh engine and is served again."""
    tenants = Tenants(tmp_path, tenant_header=HEADER, tenant_refresh=0.01)
    router = tenants.inbox.router
    assert router is not None
    url = f"sqlite:///{tmp_path}/gone.db"
    gone = Tenant("gone", database=url)
    tenants.listed.append(gone)
    tenants.inbox.create_tables(tenant="gone")
    assert tenants.inbox.handle(_with_tenant("gone")) is Disposition.APPLIED
    pool = router.place("gone").engine.pool
    assert isinstance(pool, sa.pool.QueuePool) and pool.checkedin() >= 1

    tenants.listed.remove(gone)
    router.refresh(force=True)
    assert pool.checkedin() == 0
    tenants.listed.append(gone)
    message_id = uuid.uuid4()
    assert tenants.inbox.handle(_with_tenant("gone", message_id)) is Disposition.APPLIED
    assert found(sa.create_engine(url), message_id) == ["applied"]


# -- unreadable records of no known tenant ----------------------------------------------------------

def test_an_unreadable_record_of_an_unknown_tenant_is_never_applied_by_a_replay(tmp_path: Path) -> None:
    """A foreign record and one whose JSON payload is broken, naming a tenant not served yet, were
    parked as ``tenant_unknown``; once the tenant existed, ``replay`` sent them to it as messages
    and the handler ran on them (a single-database inbox never applies either). They are parked
    for what they are (``foreign``, ``undecodable``) in the default database instead, and a
    routing replay has nothing to move."""
    listed: list[Tenant] = []
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    inbox = Inbox(default, group="g", tenants=lambda: listed, tenant_header=HEADER, tenant_refresh=0.01)
    applied: list[bytes] = []
    inbox.handler(TOPIC)(lambda session, message: applied.append(message.payload))
    inbox.create_tables()
    broken_json = record(TOPIC, "k", 1, payload=b"not json")
    foreign = Record(topic=TOPIC, key=b"k", value=b"raw", partition=0, offset=7)
    for r in (broken_json, foreign):
        r.headers.append((HEADER, b"initech"))
        assert inbox.handle(r) is Disposition.PARKED
    assert sorted(p.reason.value for p in inbox.parked()) == ["foreign", "undecodable"]

    listed.append(Tenant("initech", database=f"sqlite:///{tmp_path}/initech.db"))
    inbox.create_tables(tenant="initech")
    with pytest.raises(NotParkedError, match="tenant_unknown"):
        inbox.replay(TOPIC, "k")
    assert applied == [] and inbox.parked(tenant="initech") == []
    default.dispose()


@pytest.mark.postgres
def test_a_tenant_in_the_default_schema_by_name_is_refused_too(postgres_db: str) -> None:
    """``--tenants like:%`` or a list holding ``public``: the tenant's schema is named, the default
    database's tables are not, yet both are PostgreSQL's ``public``: the same tables. Refused as
    the default database's own once the inbox has connected to it (``run()`` does that first)."""
    default = sa.create_engine(postgres_db)
    inbox = Inbox(default, group="g", tenants=["public", "t_x"], tenant_header=HEADER)
    inbox.handler(TOPIC)(lambda session, message: None)
    inbox.create_tables()  # connects, as run()'s check of the default database does
    with pytest.raises(ConfigurationError, match="tenant public: its inbox tables would be the default"):
        assert inbox.tenants
    default.dispose()


@pytest.mark.parametrize("header", ["outbox-message-id", "outbox-seq", "content-type", "x-tenant ",
                                    " x-tenant", "Outbox-Message-Id", "OUTBOX-SEQ", "Content-Type"])
def test_a_tenant_header_no_record_can_route_by_is_refused_when_the_inbox_is_built(
        tmp_path: Path, header: str) -> None:
    """An envelope header is read into the envelope, never into ``message.headers``; a name with
    a space around it is no header the relay stamps: every record parked as ``tenant_unknown``,
    silently. Refused by name instead."""
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    with pytest.raises(ConfigurationError, match="tenant_header"):
        Inbox(default, group="g", tenants=["a"], tenant_header=header)


@pytest.mark.parametrize("stamped", ["x-tenant", "X-Tenant", "X-TENANT"])
def test_the_tenant_header_is_its_name_in_any_case(tmp_path: Path, stamped: str) -> None:
    """A relay stamping ``--tenant-header X-Tenant`` and an inbox reading ``tenant_header="x-tenant"``
    name one header: its messages reach their tenant, not ``tenant_unknown``. Two spellings of it with
    two values name no tenant (which one counts would depend on the reader)."""
    tenants = Tenants(tmp_path, tenant_header="x-Tenant", tenant_refresh=0.01)
    try:
        r = record(TOPIC, None, None)
        r.headers.append((stamped, b"acme"))
        message_id = decode(r).message.message_id
        assert tenants.inbox.handle(r) is Disposition.APPLIED
        assert tenants.where(message_id) == {"acme": ["applied"]}
        two = record(TOPIC, None, None)
        two.headers += [(stamped, b"acme"), ("x-tenant" if stamped != "x-tenant" else "X-Tenant", b"globex")]
        message_id = decode(two).message.message_id
        assert tenants.inbox.handle(two) is Disposition.PARKED
        assert tenants.where(message_id) == {None: ["parked:tenant_unknown"]}
    finally:
        for engine in [tenants.default, *tenants.engines.values()]:
            engine.dispose()


def test_a_message_replayed_to_its_tenant_is_settled_as_a_new_arrival_retries_and_alert_included(
        tmp_path: Path) -> None:
    """Parked as ``tenant_unknown``, then replayed once its tenant exists, a message whose handler
    fails takes the live path's settle stage in the tenant: ``max_attempts`` attempts, then parked
    there with its key and one ``key_parked`` alert labelled with the tenant. It used to be parked
    at its first failure, no attempt counted (a hand-made apply → park → alert beside the settle
    stage's)."""
    listed: list[Tenant] = []
    alerts: list[Any] = []
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    inbox = Inbox(default, group="g", tenants=lambda: listed, tenant_header=HEADER, tenant_refresh=0.01,
                  max_attempts=3, retry_backoff=0.001, retry_backoff_max=0.01, alert=alerts.append)
    calls: list[int | None] = []

    def handler(session: Any, message: Any) -> None:
        calls.append(message.seq)
        raise RuntimeError("the fix is not deployed yet")

    inbox.handler(TOPIC)(handler)
    inbox.create_tables()
    r = record(TOPIC, "k", 1)
    r.headers.append((HEADER, b"initech"))
    assert inbox.handle(r) is Disposition.PARKED
    alerts.clear()

    listed.append(Tenant("initech", database=f"sqlite:///{tmp_path}/initech.db"))
    inbox.create_tables(tenant="initech")
    moved = inbox.replay(TOPIC, "k")
    assert (moved.applied, moved.remaining, moved.unparked) == (1, 0, True)  # it left the default
    assert calls == [1, 1, 1]
    [parked] = inbox.parked(tenant="initech")
    assert (parked.seq, parked.reason.value, parked.attempts) == (1, "failed", 3)
    assert [(a.kind, a.tenant) for a in alerts] == [("key_parked", "initech")]
    assert inbox.parked() == []
    default.dispose()


# -- held messages a transaction takes up, sent back to wait ---------------------------------------

def test_held_messages_a_budget_defers_come_back_to_their_own_tenant(tmp_path: Path) -> None:
    """Found by an attack on ``batch_budget``: a transaction takes up a key's held messages right
    after their predecessor, read from ``inbox_held``, which names no tenant; deferred by the budget
    (or blocked behind a failure) they came back to the scheduler naming none, and their next turn
    parked them as ``tenant_unknown`` in the default database, with an alert, while they waited,
    held, in their tenant's. Each is applied once, in its tenant's database, in seq order."""
    from tests.inbox_support import AlertLog

    acme = sa.create_engine(f"sqlite:///{tmp_path}/acme.db")
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    alerts = AlertLog()
    inbox = Inbox(default, group="g", tenants=lambda: [Tenant("acme", database=acme)], tenant_header=HEADER,
                  tenant_refresh=0.01, batch_budget=0.05, alert=alerts)
    applied: list[int] = []

    @inbox.handler(TOPIC)
    def slow(session, message):  # type: ignore[no-untyped-def]
        time.sleep(0.1)  # past the budget: every transaction runs one message
        applied.append(message.seq)

    inbox.create_tables()
    inbox.create_tables(tenant="acme")
    router = inbox.router
    assert router is not None
    router.refresh(force=True)
    ids = {seq: uuid.uuid4() for seq in (1, 2, 3)}
    records = {seq: record(TOPIC, "k", seq, message_id=ids[seq]) for seq in (1, 2, 3)}
    for r in records.values():
        r.headers.append((HEADER, b"acme"))
    for seq in (2, 3):  # ahead of a gap: held
        assert router.settle([router.tag(decode(records[seq]))]).done[0][1] is Disposition.HELD
    batch = [router.tag(decode(records[1]))]
    for _ in range(10):
        settled = router.settle(batch)
        assert [d.tenant for d, _ in settled.later] == [Named("acme")] * len(settled.later)
        batch = [d for d, _ in settled.later]
        if not batch:
            break
    assert applied == [1, 2, 3]
    assert {seq: (found(acme, m), found(default, m)) for seq, m in ids.items()} == {
        seq: (["applied"], []) for seq in ids}
    assert not alerts
    for engine in (acme, default):
        engine.dispose()


# -- a tenant's tables gone while it is served, and made again ------------------------------------

def test_a_tenants_tables_made_again_just_after_a_transaction_missed_them_count_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """acme's inbox tables are dropped while it is served, and made again right after a
    transaction missed them: the router finds them there when it checks, and tries the batch
    again. Nothing counts or parks, and the database's error does not escape into the consumer."""
    from outbox.core._tables import OutboxTables

    made = Tenants(tmp_path, tenant_header=HEADER)
    try:
        def of_acme(key: str) -> Record:
            r = record(TOPIC, key, 1)
            r.headers.append((HEADER, b"acme"))
            return r

        assert made.inbox.handle(of_acme("before")) is Disposition.APPLIED  # acme's tables checked
        for table in reversed(OutboxTables().inbox_tables):
            table.drop(made.engines["acme"])
        router = made.inbox.router
        assert router is not None
        step = router.place("acme").step
        apply, missed = step.apply, []

        def tables_made_just_after(deliveries):  # type: ignore[no-untyped-def]
            try:
                return apply(deliveries)
            except sa.exc.DBAPIError:
                missed.append(deliveries)
                made.inbox.create_tables(tenant="acme")
                raise

        monkeypatch.setattr(step, "apply", tables_made_just_after)
        late = of_acme("after")
        assert made.inbox.handle(late) is Disposition.APPLIED
        assert len(missed) == 1
        assert made.where(decode(late).message.message_id) == {"acme": ["applied"]}
        assert made.inbox.parked(tenant="acme") == []
    finally:
        for engine in [made.default, *made.engines.values()]:
            engine.dispose()


def test_an_idle_tenants_gap_is_parked_after_an_outage_its_sweep_met(tmp_path: Path) -> None:
    """A sweep that meets a tenant's database outage closes its gate. Only a probe opens a gate, and
    the sweep skipped a closed one: a tenant with no traffic was never swept again, its gap never
    parked nor alerted, however long past ``gap_timeout``. The sweep now probes a closed gate in its
    turn (``OutageGate.admit``), and its answer opens it."""
    default = sa.create_engine(f"sqlite:///{tmp_path}/default.db")
    # A short busy timeout: the sweep's read of a locked file fails fast ("database is locked": an outage).
    acme = sa.create_engine(f"sqlite:///{tmp_path}/acme.db", connect_args={"timeout": 0.1})
    inbox = Inbox(default, group="g", tenants=[Tenant("acme", database=acme)], tenant_header=HEADER,
                  gap_timeout=1.0)
    inbox.handler(TOPIC)(lambda session, message: None)
    inbox.create_tables()
    inbox.create_tables(tenant="acme")
    held = record(TOPIC, "k", 2)
    held.headers.append((HEADER, b"acme"))
    assert inbox.handle(held) == Disposition.HELD  # seq 1 never comes
    locker = acme.raw_connection()
    try:
        locker.execute("BEGIN EXCLUSIVE")
        inbox.sweep()  # the outage: acme's gate closes
    finally:
        locker.rollback()
        locker.close()
    # Swept as the runner's sweep does every second, until the gap is parked.
    wait_for(lambda: inbox.sweep() or bool(inbox.parked(tenant="acme")), "acme's gap parked", timeout=15)
    assert [m.seq for m in inbox.parked(tenant="acme")] == [2]
    default.dispose()
    acme.dispose()
