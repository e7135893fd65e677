"""The audit finds exactly the lost, duplicated and reordered messages of a known scenario."""

from __future__ import annotations

import json
from datetime import timedelta

import pandas as pd
import pytest
import sqlalchemy as sa
from _spark_seed import AS_OF, SLA, build, seed, spark_for_tests

from outbox import ConfigurationError, OutboxTables
from outbox.spark import audit
from outbox.testing import fresh_database, fresh_mysql_database

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark(java_home):
    return spark_for_tests()


@pytest.fixture(scope="module")
def scenario():
    # 20,000 messages over 200 keys: 50 a topic and key, as 100,000 over 1,000 had, so every fault
    # of ``build`` lands where it did (parked, held, reordered keys deep in their seqs); still at most
    # the audit's ``SMALL_INPUT`` rows, the path it took. 100,000 only made each database's seeding
    # and reads five times longer (the SQLite case 88 s in CI).
    return build(n=20_000, keys=200)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mysql", marks=pytest.mark.mysql)])
def two_databases(request, tmp_path):
    """(outbox URL, inbox URL): two separate databases of the same kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'producer.db'}", f"sqlite:///{tmp_path / 'consumer.db'}"
        return
    outbox_db = request.getfixturevalue(f"{request.param}_db")
    fresh = fresh_database if request.param == "postgres" else fresh_mysql_database
    with fresh(request.getfixturevalue(f"{request.param}_server")) as inbox_db:
        yield outbox_db, inbox_db


def _ids(frame: pd.DataFrame, *columns: str) -> set[tuple]:
    return set(frame[list(columns)].itertuples(index=False, name=None))


def test_audit_reports_exactly_the_seeded_faults(spark, scenario, two_databases, tmp_path):
    sc = scenario
    outbox_url, inbox_url = two_databases
    seed(sc, outbox_url, inbox_url)
    window = (sc.start + timedelta(seconds=sc.window_start), AS_OF)
    out = tmp_path / "audit"

    result = audit(outbox_url, inbox_url, out_dir=out, window=window, sla=SLA, as_of=AS_OF,
                   spark=spark)

    in_window = set(range(sc.window_start, sc.n))
    lost = pd.read_parquet(out / "lost")
    assert _ids(lost, "consumer_group", "message_id") == {
        (group, str(sc.ids[i])) for group, found in sc.lost.items() for i in found
    }
    duplicates = pd.read_parquet(out / "duplicates")
    assert _ids(duplicates, "message_id", "deliveries") == {
        (str(sc.ids[i]), n) for i, n in sc.deliveries.items()
    }
    assert set(duplicates.consumer_group) == {"billing"}
    reordered = pd.read_parquet(out / "out_of_order")
    assert reordered.to_dict("records") == [{
        "consumer_group": "billing", "topic": "orders", "key": "k7", "seq": 11, "event_type": None,
        "processed_after_seq": 13, "message_id": str(sc.ids[sc.out_of_order]),
        "processed_at": reordered.processed_at[0],
    }]

    s = result.summary
    assert result.ok is False
    for topic in ("orders", "payments"):
        mine = {i for i in in_window if sc.topic(i) == topic}
        assert s["topics"][topic] | {"relay_lag_ms": None} == {
            "produced": len(mine), "pending": len(mine & sc.pending),
            "failed": len(mine & sc.failed), "published": len(mine - sc.pending - sc.failed),
            "relay_lag_ms": None,
        }
    assert set(s["groups"]) == {"billing", "shipping"}
    assert set(s["groups"]["shipping"]) == {"orders"}  # never consumed payments: not audited for it
    billing_payments = s["groups"]["billing"]["payments"]
    assert (billing_payments["parked"], billing_payments["held"]) == (5, 3)
    assert {k: s["totals"][k] for k in ("lost", "duplicated_messages", "extra_deliveries",
                                        "out_of_order_messages", "out_of_order_keys",
                                        "parked", "held")} == {
        "lost": 42, "duplicated_messages": 55, "extra_deliveries": 60,
        "out_of_order_messages": 1, "out_of_order_keys": 1, "parked": 5, "held": 3,
    }
    delivered = in_window - sc.pending - sc.failed - sc.in_flight
    assert s["groups"]["billing"]["orders"]["consumed"] == len(
        {i for i in delivered if sc.topic(i) == "orders"} - sc.lost["billing"])
    assert json.loads((out / "summary.json").read_text()) == s
    assert "PROBLEM: 42 lost, 1 out of order" in (out / "report.md").read_text()
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_audit_of_clean_data_is_ok(spark, tmp_path):
    sc = build(n=2_000, keys=50)
    sc.lost = {"billing": set(), "shipping": set()}
    sc.deliveries, sc.out_of_order = {}, -1
    url = f"sqlite:///{tmp_path / 'one.db'}"
    seed(sc, url, url)

    result = audit(url, out_dir=tmp_path / "audit", sla="10m", as_of=AS_OF, spark=spark)

    assert result.ok
    assert result.totals["lost"] == result.totals["out_of_order_messages"] == 0
    assert result.totals["produced"] == 2_000


def test_the_audit_of_one_event_type_counts_and_names_only_its_messages(spark, tmp_path):
    """--event-type: the producer counts, the lost messages and the report are of that type only."""
    sc = build(n=2_000, keys=50)
    sc.lost = {"billing": set(), "shipping": set()}
    sc.deliveries, sc.out_of_order = {}, -1
    url = f"sqlite:///{tmp_path / 'one.db'}"
    seed(sc, url, url)
    tables = OutboxTables()
    m, i = tables.messages, tables.inbox_messages
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.update(m).where(m.c.id % 4 == 0).values(event_type="OrderPaid"))
        overdue = (m.c.status == "published") & (m.c.published_at < AS_OF - SLA)
        typed = list(conn.execute(sa.select(m.c.message_id).where(m.c.id % 4 == 0, overdue)
                                  .limit(3)).scalars())
        untyped = list(conn.execute(sa.select(m.c.message_id).where(m.c.id % 4 == 1, overdue)
                                    .limit(2)).scalars())
        conn.execute(sa.delete(i).where(i.c.consumer_group == "billing",
                                        i.c.message_id.in_(typed + untyped)))
    engine.dispose()

    result = audit(url, out_dir=tmp_path / "audit", sla="10m", as_of=AS_OF, spark=spark,
                   event_type="OrderPaid")

    assert result.totals["produced"] == 500 and result.totals["lost"] == 3
    assert result.summary["event_type"] == "OrderPaid"
    lost = pd.read_parquet(result.path("lost"))
    assert set(lost["event_type"]) == {"OrderPaid"}
    assert set(lost["message_id"].astype(str)) == {str(x) for x in typed}
    assert "only messages of event type OrderPaid" in result.path("report.md").read_text()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"event_type": "Order\nPaid"}, "control characters"),
    ({"window": "-3h"}, "invalid window"),
    ({"window": ("2026-01-02", "2026-01-01")}, "empty window"),
    ({"sla": "soon"}, "invalid SLA"),
    ({"sla": 0}, "SLA must be positive"),
])
def test_bad_arguments_fail_before_spark_runs(tmp_path, kwargs, message):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ConfigurationError, match=message):
        audit(url, out_dir=tmp_path / "out", **kwargs)


def test_bad_url_and_missing_table_are_named(spark, tmp_path):
    with pytest.raises(ConfigurationError, match="invalid database URL"):
        audit("nosuchdb://x", out_dir=tmp_path / "out", spark=spark)
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    with pytest.raises(ConfigurationError, match="outbox_messages does not exist"):
        audit(empty, out_dir=tmp_path / "out", spark=spark)



def test_the_audit_of_a_large_input_with_whole_stage_codegen_finds_what_the_small_input_path_finds(
        spark, tmp_path, monkeypatch):
    """Above ``SMALL_INPUT`` outbox rows the audit compiles its stages (whole-stage codegen), which
    every other audit test, at most that many rows, runs without: the same seeded faults through both
    paths give the same summary and the same findings, and the session's setting is restored."""
    import outbox.spark._audit as audit_module

    sc = build(n=2_000, keys=50)
    url = f"sqlite:///{tmp_path / 'one.db'}"
    seed(sc, url, url)
    window = (sc.start + timedelta(seconds=sc.window_start), AS_OF)
    codegen = spark.conf.get("spark.sql.codegen.wholeStage", "true")
    real_codegen, taken = audit_module._codegen, []

    def recorded(session, *, enabled):
        taken.append(enabled)
        return real_codegen(session, enabled=enabled)

    monkeypatch.setattr(audit_module, "_codegen", recorded)
    results = {}
    for path, small_input in (("small", audit_module.SMALL_INPUT), ("large", sc.n - 1)):
        monkeypatch.setattr(audit_module, "SMALL_INPUT", small_input)
        results[path] = audit(url, out_dir=tmp_path / path, window=window, sla=SLA, as_of=AS_OF,
                              spark=spark)
    assert taken == [False, True], f"codegen per run: {taken}"
    assert spark.conf.get("spark.sql.codegen.wholeStage", "true") == codegen
    small, large = results["small"], results["large"]
    assert small.totals["lost"] > 0 and small.totals["out_of_order_messages"] > 0, small.totals
    assert large.summary == small.summary
    for finding in ("lost", "duplicates", "out_of_order"):
        rows_of = {p: pd.read_parquet(tmp_path / p / finding) for p in results}
        columns = sorted(rows_of["small"].columns)
        assert sorted(rows_of["large"].columns) == columns, finding
        assert (sorted(map(repr, rows_of["large"][columns].itertuples(index=False)))
                == sorted(map(repr, rows_of["small"][columns].itertuples(index=False)))), finding
