"""``each_tenant``: every tenant gets exactly one outcome, in order, whatever the others do.

Over every mix of tenants that succeed, fail on their own, or find their database down,
spread over a few databases and run a few at a time: the outcomes keep the tenants'
order, a failure names what went wrong for that tenant only, and a tenant skipped
because its database was found down is so only after an earlier tenant of that database
found it down. A tenant that hangs is given up on at its deadline and its thread left
behind, while the others are served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import ConfigurationError, create_engine
from outbox.tenants import Tenant, TenantDatabases, each_tenant


@pytest.fixture(scope="module", name="memory")
def memory_engine() -> Iterator[sa.Engine]:
    engine = create_engine("sqlite://")
    yield engine
    engine.dispose()


def fleet(plan: list[tuple[str, int]]) -> list[Tenant]:
    return [Tenant(f"t{i}", schema=f"s{i}", database=f"sqlite:///db{db}.db")
            for i, (_, db) in enumerate(plan)]


@settings(max_examples=60, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["ok", "error", "outage"]), st.integers(0, 2)), max_size=12),
       concurrency=st.integers(1, 4))
def test_every_tenant_gets_one_outcome_in_order(memory: sa.Engine, plan: list[tuple[str, int]],
                                                 concurrency: int) -> None:
    tenants = fleet(plan)
    called: list[str] = []
    lock = threading.Lock()

    def work(tenant: Tenant, bind: sa.Engine) -> str:
        assert bind is memory
        with lock:
            called.append(tenant.name)
        kind = plan[int(tenant.name[1:])][0]
        if kind == "error":
            raise ValueError(f"boom {tenant.name}")
        if kind == "outage":
            raise sa.exc.InterfaceError("SELECT 1", {}, Exception(f"gone {tenant.name}"))
        return tenant.name

    outcomes = each_tenant(tenants, work, databases=TenantDatabases(memory, make=lambda url: memory),
                           concurrency=concurrency)

    assert [o.tenant for o in outcomes] == tenants
    assert len(called) == len(set(called))
    for index, (outcome, (kind, db)) in enumerate(zip(outcomes, plan, strict=True)):
        name = outcome.tenant.name
        if name not in called:  # skipped: an earlier tenant of its database found it down
            assert outcome.unreachable and "unreachable (found by tenant t" in (outcome.problem or "")
            finder = int((outcome.problem or "").rsplit("tenant t", 1)[1].rstrip(")"))
            assert finder < index and plan[finder] == ("outage", db)
        elif kind == "ok":
            assert outcome.ok and outcome.value == name
        elif kind == "error":
            assert outcome.problem == f"ValueError: boom {name}" and not outcome.unreachable
        else:
            assert outcome.unreachable and f"cannot reach database sqlite:///db{db}.db: gone {name}" == \
                outcome.problem
    if concurrency == 1:  # one at a time: nothing of a database found down runs after it
        for index, (kind, db) in enumerate(plan):
            if kind == "outage" and tenants[index].name in called:
                later = [t.name for t, (_, d) in zip(tenants[index + 1:], plan[index + 1:], strict=True)
                         if d == db]
                assert not set(later) & set(called)


class Deadlines:
    """``each_tenant``'s clock (``outbox.tenants._each.time``), moved only by a tenant that hangs.

    The deadlines are short (a test waits each out) and were the host's: a loaded CI host that
    stalls a tenant that answers for 0.2 s would have it reported "no answer", the wrong outcome.
    Here a hanging tenant moves the clock past its deadline as it starts to hang (as a frozen
    database does to the wall clock); no other tenant is ever late, however slow the host.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, timeout: float) -> None:
        from outbox.tenants import _each

        self.now, self.timeout = 1000.0, timeout
        monkeypatch.setattr(_each, "time", self)

    def monotonic(self) -> float:
        return self.now

    def hang(self) -> None:
        self.now += self.timeout + 0.001


def test_a_hanging_tenant_is_given_up_on_at_its_deadline(memory: sa.Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tenants of one database past their deadline, none answering between: the database is
    frozen, and its next tenant is reported so without waiting out a deadline of its own."""
    clock = Deadlines(monkeypatch, 0.3)
    release = threading.Event()
    tenants = [Tenant("ice", database="sqlite:///frozen.db"), Tenant("a", schema="a"),
               Tenant("ice2", schema="x", database="sqlite:///frozen.db"),
               Tenant("ice3", schema="y", database="sqlite:///frozen.db"), Tenant("b", schema="b")]

    def work(tenant: Tenant, bind: sa.Engine) -> str:
        if tenant.name.startswith("ice"):
            clock.hang()
            release.wait(30)
        return tenant.name

    started = time.monotonic()
    try:
        outcomes = each_tenant(tenants, work, databases=TenantDatabases(memory, make=lambda url: memory),
                               timeout=0.3, concurrency=1)
    finally:
        release.set()
    assert time.monotonic() - started < 5
    assert [o.problem for o in outcomes] == [
        "no answer within 0.3 s (is its database frozen?)", None,
        "no answer within 0.3 s (is its database frozen?)",
        "database sqlite:///frozen.db did not answer (found by tenant ice2)", None]
    assert [o.value for o in outcomes] == [None, "a", None, None, "b"]


def test_one_tenant_waiting_on_a_lock_of_its_own_does_not_condemn_its_databases_other_tenants(
        memory: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """500 schemas in one database, one of them locked (a migration, ``VACUUM FULL``): that tenant
    alone is past its deadline. Its database answered the next tenant, so the later ones are
    read, not reported "did not answer" (one timeout used to mark the whole database frozen)."""
    clock = Deadlines(monkeypatch, 0.2)
    release = threading.Event()
    tenants = [Tenant("locked", schema="locked"), Tenant("a", schema="a"), Tenant("locked2", schema="l2"),
               Tenant("b", schema="b"), Tenant("c", schema="c")]

    def work(tenant: Tenant, bind: sa.Engine) -> str:
        if tenant.name.startswith("locked"):
            clock.hang()
            release.wait(30)
        return tenant.name

    try:
        outcomes = each_tenant(tenants, work, databases=TenantDatabases(memory), timeout=0.2,
                               concurrency=1)
    finally:
        release.set()
    assert [o.value for o in outcomes] == [None, "a", None, "b", "c"]
    late = "no answer within 0.2 s (is its database frozen?)"
    assert [o.problem for o in outcomes] == [late, None, late, None, None]


def test_a_tenant_started_after_the_caller_began_waiting_is_still_given_up_on_at_its_deadline(
        memory: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's thread watches the deadlines of the tenants it has seen start. A worker thread
    that a loaded host runs late starts its tenant while the caller already waits with no deadline
    to watch: unannounced, that start went unwatched, and a frozen database held the report until
    its work ended (here 10 s later, with a value) instead of its 0.3 s deadline."""
    from outbox.tenants import _each

    serve = _each._Run._serve

    def late(run: _each._Run[str]) -> None:
        time.sleep(0.2)  # the worker thread runs after the caller began to wait
        serve(run)

    monkeypatch.setattr(_each._Run, "_serve", late)
    release = threading.Event()

    def work(tenant: Tenant, bind: sa.Engine) -> str:
        release.wait(10)
        return tenant.name

    try:
        [outcome] = each_tenant([Tenant("ice", schema="ice")], work, databases=TenantDatabases(memory),
                                timeout=0.3)
    finally:
        release.set()
    assert (outcome.value, outcome.problem) == (None, "no answer within 0.3 s (is its database frozen?)")


def test_bad_arguments_are_refused_by_name(memory: sa.Engine) -> None:
    databases = TenantDatabases(memory)
    with pytest.raises(ConfigurationError, match="concurrency"):
        each_tenant([], lambda t, e: None, databases=databases, concurrency=0)
    with pytest.raises(ConfigurationError, match="timeout"):
        each_tenant([], lambda t, e: None, databases=databases, timeout=0)
    (outcome,) = each_tenant([Tenant("lost")], lambda t, e: None, databases=TenantDatabases(None))
    assert outcome.problem == "tenant lost names no database and there is no default"
