"""Operations over many tenants: ``init-db``, ``status`` and ``housekeeping run`` with ``--tenants``.

A fleet on real PostgreSQL: two tenant schemas of one database, a tenant
that is a whole second database, a schema without tables (or without even
the schema), and a tenant whose database is down (a closed port) or frozen
(it accepts the connection and never answers). Each command must do its
work for the healthy tenants, name every tenant in what it says, report the
broken ones by name without a traceback, keep their databases' passwords out
of its output, and exit as the command would for that tenant alone.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from outbox import Outbox, create_engine
from outbox.cli import app
from outbox.housekeeping import run_retention_for_tenants, tenant_retention_pass
from outbox.ops import gather_tenants
from outbox.tenants import Tenant, TenantDatabases, tenant_source
from tests._retention_rows import outbox_row
from tests.tenant_support import SECRET, Fleet, frozen_port, tenant_fleet  # noqa: F401 (fixtures)

runner = CliRunner()


def cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    assert SECRET not in result.output
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def lines_of(output: str, tenant: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"tenant {tenant}: ")]


def tables_in(engine: sa.Engine, schema: str | None) -> set[str]:
    return set(sa.inspect(engine).get_table_names(schema=schema))


def test_init_db_makes_every_tenants_tables_and_names_each_failure(fleet: Fleet) -> None:
    fleet.write([{"name": "a", "schema": "t_a"}, {"name": "b", "schema": "t_b"},
                 {"name": "nope", "schema": "t_nope"}, {"name": "second", "database": fleet.second},
                 {"name": "down", "database": fleet.down_url}])
    status, out = cli("init-db", "--db", fleet.first, "--tenants", fleet.spec, "--shards", "4")

    assert status == 1, out  # a database that is down is a runtime failure, as for one tenant
    for schema in ("t_a", "t_b"):
        assert "outbox_messages" in tables_in(fleet.engine, schema)
        assert fleet.outbox(schema[2:]).load_schema().shard_count == 4
    assert "outbox_messages" in tables_in(fleet.second_engine, None)
    assert "outbox_messages" not in tables_in(fleet.engine, None)  # no tenant lives in public
    for name in ("a", "b", "second"):
        said = lines_of(out, name)
        assert any("created" in line for line in said) and not any("FAILED" in line for line in said)
    (nope,) = lines_of(out, "nope")
    assert "FAILED" in nope and "t_nope" in nope
    (down,) = lines_of(out, "down")
    assert "FAILED" in down and "cannot reach" in down and "Connection refused" in down
    assert "3 of 5 tenant(s) done, 2 failed" in out

    # Again, only the healthy ones: nothing to do, exit 0; --tenant picks one.
    status, out = cli("init-db", "--db", fleet.first, "--tenants", "t_a,t_b")
    assert status == 0 and len(lines_of(out, "t_a")) == 2 and "nothing created" in lines_of(out, "t_b")[0]
    status, out = cli("init-db", "--db", fleet.first, "--tenants", "t_a,t_b", "--tenant", "t_b")
    assert status == 0 and lines_of(out, "t_b") and not lines_of(out, "t_a")


def test_init_db_refuses_schema_with_tenants_and_an_unknown_tenant(fleet: Fleet) -> None:
    status, out = cli("init-db", "--db", fleet.first, "--tenants", "t_a", "--schema", "t_b")
    assert status == 2 and "--schema" in out
    status, out = cli("init-db", "--db", fleet.first, "--tenants", "t_a", "--tenant", "zz")
    assert status == 2 and "'zz' is not one of the tenants" in out
    assert "outbox_messages" not in tables_in(fleet.engine, "t_a")


def test_status_reports_every_tenant_and_names_each_finding(fleet: Fleet) -> None:
    fleet.create("a", "b", "second")
    with fleet.engine.begin() as conn:  # tenant b: a pending row that no relay owns, a failed one
        conn.execute(fleet.outbox("b").tables.messages.insert(), [
            outbox_row("pending", datetime.now(UTC)), outbox_row("failed", datetime.now(UTC))])

    status, out = cli("status", "--db", fleet.first, "--tenants", fleet.spec, "--json")
    assert status == 1, out  # "down" could not be read: its database is a runtime failure
    report = json.loads(out)
    assert [t["tenant"] for t in report["tenants"]] == ["a", "b", "broken", "second", "down"]
    by_name = {t["tenant"]: t for t in report["tenants"]}
    assert by_name["a"]["stuck"] == [] and by_name["a"]["problem"] is None
    assert by_name["second"]["outbox"] is not None and by_name["second"]["stuck"] == []
    assert {f["tenant"] for f in report["stuck"]} == {"b"}
    assert any("failed outbox row" in f["reason"] for f in report["stuck"])
    assert by_name["b"]["schema"] == "t_b" and by_name["b"]["stuck"]
    problems = {f["tenant"]: f["reason"] for f in report["problems"]}
    assert set(problems) == {"broken", "down"}
    assert "no outbox tables" in problems["broken"] and "t_broken" in problems["broken"]
    assert "cannot reach" in problems["down"] and "***" in by_name["down"]["database"]

    status, out = cli("status", "--db", fleet.first, "--tenants", fleet.spec)
    assert status == 1
    assert "== tenant second (database" in out and "== tenant b (schema t_b)" in out
    assert re.search(r"^STUCK: tenant b: \d+ failed outbox row", out, re.M)
    assert re.search(r"^PROBLEM: tenant broken: no outbox tables", out, re.M)
    assert re.search(r"^PROBLEM: tenant down: cannot reach", out, re.M)

    # The exit status of the tenants that could be read: stuck (3), or fine (0).
    assert cli("status", "--db", fleet.first, "--tenants", "t_a,t_b")[0] == 3
    status, out = cli("status", "--db", fleet.first, "--tenants", "t_a,t_b", "--tenant", "t_a")
    assert status == 0 and "nothing stuck in 1 tenant(s)" in out
    # Missing tables alone: exit 2, as `outbox status --schema t_broken` does.
    assert cli("status", "--db", fleet.first, "--tenants", "t_a,t_broken")[0] == 2


def test_status_gives_up_on_a_frozen_database_in_time_and_reports_the_rest(
        fleet: Fleet, frozen: int, tmp_path: Path) -> None:
    fleet.create("a")
    stuck_url = f"postgresql+psycopg://ops:{SECRET}@127.0.0.1:{frozen}/frozen?connect_timeout=60"
    fleet.write([{"name": "ice", "database": stuck_url},
                 {"name": "ice2", "schema": "s2", "database": stuck_url}, {"name": "a", "schema": "t_a"}])
    started = time.monotonic()
    # A process, so that the thread left inside the frozen connect cannot hold its exit either.
    result = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--db", fleet.first, "--tenants", fleet.spec, "--json",
         "--tenant-timeout", "1"], capture_output=True, text=True, timeout=50)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert took < 30, took  # one tenant's deadline (1 s), not the 60 s connect timeout, twice
    report = json.loads(result.stdout)
    problems = {f["tenant"]: f["reason"] for f in report["problems"]}
    assert set(problems) == {"ice", "ice2"}
    # The second one either shared the deadline or was not tried once its database had failed it.
    assert "no answer within 1 s" in problems["ice"] and "answer" in problems["ice2"]
    assert [t["tenant"] for t in report["tenants"] if t["problem"] is None] == ["a"]
    assert SECRET not in result.stdout + result.stderr


def test_gather_tenants_shares_one_engine_per_database(fleet: Fleet) -> None:
    fleet.create("a", "b", "second")
    made: list[str] = []

    def make(url: str) -> sa.Engine:
        made.append(url)
        return create_engine(url)

    databases = TenantDatabases(fleet.engine, make=make)
    tenants = [Tenant(f"s{i}", schema=f"t_{'ab'[i % 2]}x{i}") for i in range(6)]
    tenants += [Tenant("a", schema="t_a"), Tenant("b", schema="t_b"),
                Tenant("second", database=fleet.second), Tenant("second-again", schema="public",
                                                                database=fleet.second)]
    try:
        report = gather_tenants(tenants, databases)
    finally:
        databases.dispose()
    assert made == [fleet.second]  # one engine for the second database, the first's reused
    assert {p["tenant"] for p in report["problems"]} == {f"s{i}" for i in range(6)}
    assert [t["tenant"] for t in report["tenants"] if t["problem"] is None] == ["a", "b", "second",
                                                                                 "second-again"]


def old_published(outbox: Outbox, engine: sa.Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(outbox.tables.messages.insert(),
                     [outbox_row("published", datetime.now(UTC) - timedelta(days=3)) for _ in range(n)]
                     + [outbox_row("published", datetime.now(UTC))])


def count(outbox: Outbox, engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(outbox.tables.messages)).scalar_one())


def test_retention_cleans_every_tenant_and_names_each_failure(fleet: Fleet) -> None:
    fleet.create("a", "b", "second")
    for name, n in (("a", 3), ("b", 2), ("second", 4)):
        engine = fleet.second_engine if name == "second" else fleet.engine
        old_published(fleet.outbox(name), engine, n)
    status, out = cli("housekeeping", "run", "--db", fleet.first, "--tenants", fleet.spec,
                      "--older-than", "1d", "--batch-size", "2")
    assert status == 1, out
    assert [count(fleet.outbox(n), fleet.second_engine if n == "second" else fleet.engine)
            for n in ("a", "b", "second")] == [1, 1, 1]  # each tenant's old rows gone, new ones kept
    assert re.search(r"^tenant a: outbox_messages: 3 row\(s\) before .* deleted", out, re.M)
    assert re.search(r"^tenant second: outbox_messages: 4 row\(s\)", out, re.M)
    (broken,) = lines_of(out, "broken")
    assert "FAILED" in broken and "t_broken" in broken
    (down,) = lines_of(out, "down")
    assert "FAILED" in down and "cannot reach" in down and "Connection refused" in down
    assert "3 of 5 tenant(s) cleaned, 2 failed" in out


def test_retention_for_tenants_as_a_library_and_as_a_workers_pass(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    fleet.create("a", "b", "second")
    for name in ("a", "b"):
        old_published(fleet.outbox(name), fleet.engine, 2)
    old_published(fleet.outbox("second"), fleet.second_engine, 5)
    tenants = [Tenant("a", schema="t_a"), Tenant("broken", schema="t_broken"),
               Tenant("down", database=fleet.down_url), Tenant("second", database=fleet.second)]

    outcomes = run_retention_for_tenants(tenants, fleet.engine, older_than="1d", dry_run=True)
    assert [(o.tenant.name, o.value.total if o.value else o.problem is not None) for o in outcomes] == [
        ("a", 2), ("broken", True), ("down", True), ("second", 5)]
    assert outcomes[2].unreachable and not outcomes[1].unreachable

    databases = TenantDatabases(fleet.engine)
    run_pass = tenant_retention_pass(tenant_source([*tenants, Tenant("b", schema="t_b")]), databases,
                                     older_than=timedelta(days=1))
    result = run_pass(threading.Event())
    databases.dispose()
    assert result.deleted == {"a/outbox_messages": 2, "second/outbox_messages": 5, "b/outbox_messages": 2}
    failures = [r.getMessage() for r in caplog.records if "retention of tenant" in r.getMessage()]
    assert len(failures) == 2 and any("tenant broken" in m for m in failures)
    assert any("tenant down" in m for m in failures) and not any(SECRET in m for m in failures)


def test_status_and_retention_never_create_a_tenants_missing_database_file(tmp_path: Path) -> None:
    home = f"sqlite:///{tmp_path / 'home.db'}"
    Outbox(create_engine(home)).create_tables()
    missing = tmp_path / "acme.db"
    spec = tmp_path / "tenants.json"
    spec.write_text(json.dumps([{"name": "acme", "database": f"sqlite:///{missing}"},
                                {"name": "home", "database": home}]))
    status, out = cli("status", "--db", home, "--tenants", f"file:{spec}")
    assert status == 2
    assert re.search(r"^PROBLEM: tenant acme: database file .*acme.db does not exist", out, re.M)
    status, out = cli("housekeeping", "run", "--db", home, "--tenants", f"file:{spec}", "--older-than", "1d")
    assert status == 2 and "tenant acme: FAILED database file" in out
    assert "tenant home: outbox_messages" in out
    assert not missing.exists()
