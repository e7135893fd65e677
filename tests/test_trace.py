"""``outbox trace`` and ``ops.trace_message``/``trace_key``: a message's journey through real tables.

The rows are written by the real relay (on the in-memory broker, through
``OutboxTestHarness``) and the real inbox of two consumer groups: one in the
outbox's database, one in a database of its own, as a consumer team has.
"""

from __future__ import annotations

import json
import unicodedata
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from outbox import Inbox, Message, Outbox, OutboxTables, create_engine, record_to_message
from outbox.cli import app
from outbox.core._wire import EVENT_TYPE
from outbox.ops import Database, trace_key, trace_message
from outbox.testing import InMemoryBroker, OutboxTestHarness, fresh_database
from tests.inbox_support import record

TOPIC = "orders"


@dataclass
class World:
    outbox_url: str
    inbox_url: str
    outbox: Outbox
    billing: Inbox
    shipping: Inbox
    ids: dict[str, list[uuid.UUID]]

    def dbs(self) -> tuple[Database, list[Database]]:
        return (Database("outbox-db", self.outbox.engine, self.outbox.tables),  # type: ignore[arg-type]
                [Database("shipping-db", self.shipping.engine, self.shipping.tables)])


def _publish(outbox: Outbox, key: str, n: int) -> list[uuid.UUID]:
    assert isinstance(outbox.engine, sa.Engine)
    with Session(outbox.engine) as session, session.begin():
        return [outbox.publish(session, TOPIC, {"n": i}, key=key) for i in range(n)]


@contextmanager
def built_world(db_url: str, folder: Path) -> Iterator[World]:
    """order-1: sent, applied by both groups; bad-1: billing parked it at seq 1, seq 2 behind it;
    late-1: written, not sent; gap-1 (billing only): seq 3 arrived without 1 and 2, held."""
    engine = create_engine(db_url)
    inbox_url = f"sqlite:///{folder}/shipping.db"
    inbox_engine = create_engine(inbox_url)
    outbox = Outbox(engine)
    outbox.create_tables()
    billing = Inbox(engine, group="billing", retry_backoff=0, max_attempts=2)
    shipping = Inbox(inbox_engine, group="shipping", retry_backoff=0)
    shipping.create_tables()

    @billing.handler(TOPIC)
    def bill(session: Session, message: Message) -> None:
        if message.key == "bad-1":
            raise RuntimeError("card declined")

    @shipping.handler(TOPIC)
    def ship(session: Session, message: Message) -> None:
        pass

    broker = InMemoryBroker(partitions=3)
    ids = {"order-1": _publish(outbox, "order-1", 3), "bad-1": _publish(outbox, "bad-1", 2)}
    with OutboxTestHarness(outbox, billing, broker=broker) as producer, \
            OutboxTestHarness(None, shipping, broker=broker) as consumer:
        assert producer.relay() == 5
        producer.deliver()
        consumer.deliver()
    ids["late-1"] = _publish(outbox, "late-1", 1)
    ids["gap-1"] = [uuid.uuid4()]
    billing.handle(record(TOPIC, "gap-1", 3, message_id=ids["gap-1"][0]))
    try:
        yield World(db_url, inbox_url, outbox, billing, shipping, ids)
    finally:
        engine.dispose()
        inbox_engine.dispose()


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[World]:
    """The world (``built_world``) of one test, which may change it: publish, handle, alter a
    table, listen on its engine."""
    with built_world(db_url, tmp_path) as built:
        yield built


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def seen_world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One world for the module's tests that only read it (traces, the command, the console page),
    on SQLite and PostgreSQL as ``db_url``: building it runs the relay and two inboxes, about a
    second a test on PostgreSQL under the suite's load, for 16 tests a database. A test that
    changes anything takes ``world``."""
    folder = tmp_path_factory.mktemp("trace-world")
    if request.param == "sqlite":
        with built_world(f"sqlite:///{folder}/outbox.db", folder) as built:
            yield built
        return
    with fresh_database(request.getfixturevalue("postgres_server")) as url, \
            built_world(url, folder) as built:
        yield built


def _groups(message: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["group"]: g for g in message["groups"]}


def test_a_sent_and_applied_message_shows_where_it_went_and_when_each_group_applied_it(
        seen_world: World) -> None:
    outbox_db, inbox_dbs = seen_world.dbs()
    doc = trace_message(outbox_db, inbox_dbs, seen_world.ids["order-1"][1])
    [m] = doc["messages"]
    assert (m["topic"], m["key"], m["seq"]) == (TOPIC, "order-1", 2)
    assert m["outbox"]["status"] == "published" and m["outbox"]["published_at"]
    assert m["outbox"]["partition"] is not None and m["outbox"]["offset"] is not None
    groups = _groups(m)
    assert set(groups) == {"billing", "shipping"}
    for g in groups.values():
        assert g["state"] == "applied" and g["processed_at"]
        assert (g["partition"], g["offset"]) == (m["outbox"]["partition"], m["outbox"]["offset"])
    assert groups["shipping"]["database"] == "shipping-db"


def test_a_parked_message_and_the_one_behind_it_say_why(seen_world: World) -> None:
    outbox_db, inbox_dbs = seen_world.dbs()
    first, second = seen_world.ids["bad-1"]
    parked = _groups(trace_message(outbox_db, inbox_dbs, first)["messages"][0])
    assert parked["billing"]["state"] == "parked" and parked["billing"]["reason"] == "failed"
    assert parked["billing"]["attempts"] == 2 and "card declined" in parked["billing"]["error"]
    assert parked["shipping"]["state"] == "applied"
    behind = _groups(trace_message(outbox_db, inbox_dbs, second)["messages"][0])["billing"]
    assert (behind["state"], behind["reason"], behind["attempts"]) == ("parked", "key_parked", 0)
    assert behind["parked_behind_seq"] == 1


def test_an_unsent_message_is_never_seen_by_the_groups(seen_world: World) -> None:
    outbox_db, inbox_dbs = seen_world.dbs()
    [m] = trace_message(outbox_db, inbox_dbs, seen_world.ids["late-1"][0])["messages"]
    assert m["outbox"]["status"] == "pending" and m["outbox"]["published_at"] is None
    assert {g["state"] for g in m["groups"]} == {"not_seen"}


def test_a_key_shows_its_position_and_what_waits_behind_what(seen_world: World) -> None:
    outbox_db, inbox_dbs = seen_world.dbs()
    doc = trace_key(outbox_db, inbox_dbs, TOPIC, "bad-1")
    key = doc["key"]
    assert key["outbox"]["last_seq"] == 2 and key["outbox"]["last_sent_seq"] == 2
    groups = {g["group"]: g for g in key["groups"]}
    assert groups["billing"]["parked"] and groups["billing"]["parked_messages"] == 2
    assert groups["billing"]["parked_seqs"] == [1, 2] and groups["billing"]["last_applied_seq"] is None
    assert groups["shipping"]["last_applied_seq"] == 2 and not groups["shipping"]["parked"]
    assert [m["seq"] for m in doc["messages"]] == [1, 2]

    held = trace_key(outbox_db, inbox_dbs, TOPIC, "gap-1")
    billing = {g["group"]: g for g in held["key"]["groups"]}["billing"]
    assert billing["held_seqs"] == [3] and billing["waiting_for_seq"] == 1
    assert held["key"]["outbox"] is None
    [m] = held["messages"]
    assert _groups(m)["billing"]["state"] == "held" and _groups(m)["shipping"]["state"] == "not_seen"

    late = trace_key(outbox_db, inbox_dbs, TOPIC, "late-1")["key"]["outbox"]
    assert (late["last_seq"], late["last_sent_seq"], late["first_unsent_seq"]) == (1, None, 1)
    assert late["pending"] == 1


def test_unknown_ids_topics_and_keys_are_errors_naming_what_is_missing(seen_world: World) -> None:
    outbox_db, inbox_dbs = seen_world.dbs()
    from outbox import ConfigurationError
    with pytest.raises(ConfigurationError, match="in none of the databases"):
        trace_message(outbox_db, inbox_dbs, uuid.uuid4())
    with pytest.raises(ConfigurationError, match="topic 'nope' is in none"):
        trace_key(outbox_db, inbox_dbs, "nope", "order-1")
    with pytest.raises(ConfigurationError, match="key 'order-9' of topic 'orders' is in none"):
        trace_key(outbox_db, inbox_dbs, TOPIC, "order-9")


runner = CliRunner()


def _cli(*args: str) -> Any:
    return runner.invoke(app, ["trace", *args])


def test_the_command_prints_the_journey_and_json_for_scripts(seen_world: World) -> None:
    mid = str(seen_world.ids["bad-1"][1])
    shown = _cli(mid, "--db", seen_world.outbox_url, "--inbox-db", seen_world.inbox_url)
    assert shown.exit_code == 0, shown.output
    assert "parked behind seq 1 of its key" in shown.output and "attempts 0" not in shown.output
    assert "group shipping" in shown.output and "applied" in shown.output
    as_json = _cli("--topic", TOPIC, "--key", "bad-1", "--db", seen_world.outbox_url, "--inbox-db",
                   seen_world.inbox_url, "--json")
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)
    assert doc["version"] == 1 and doc["query"] == {"topic": TOPIC, "key": "bad-1", "limit": 20}


def test_a_key_trace_filters_its_messages_by_event_type(world: World) -> None:
    """The outbox row's type, else a parked copy's (applied inbox rows keep none); --event-type
    keeps the key's messages of that type, the key's positions stay the key's."""
    assert isinstance(world.outbox.engine, sa.Engine)
    with Session(world.outbox.engine) as session, session.begin():
        typed = [world.outbox.publish(session, TOPIC, {"n": i}, key="typed-1", event_type=kind)
                 for i, kind in enumerate(["OrderCreated", "OrderPaid", "OrderCreated"])]
    outbox_db, inbox_dbs = world.dbs()
    doc = trace_key(outbox_db, inbox_dbs, TOPIC, "typed-1", event_type="OrderCreated")
    assert [(m["seq"], m["event_type"]) for m in doc["messages"]] == [(1, "OrderCreated"),
                                                                       (3, "OrderCreated")]
    assert doc["key"]["outbox"]["pending"] == 3 and doc["query"]["event_type"] == "OrderCreated"
    assert trace_key(outbox_db, inbox_dbs, TOPIC, "typed-1", event_type="Nope")["messages"] == []
    assert trace_message(outbox_db, inbox_dbs, typed[1])["messages"][0]["event_type"] == "OrderPaid"
    # Parked behind bad-1's first message, seen from the inbox side alone: the parked row's type.
    behind = record(TOPIC, "bad-1", 3)
    behind.headers.append((EVENT_TYPE, b"OrderShipped"))
    world.billing.handle(behind)
    only_inbox = [Database("outbox-db", world.billing.engine, world.billing.tables)]
    [m] = trace_message(None, only_inbox, record_to_message(behind).message_id)["messages"]
    assert m["event_type"] == "OrderShipped" and m["outbox"] is None
    shown = _cli("--topic", TOPIC, "--key", "typed-1", "--event-type", "OrderPaid", "--db", world.outbox_url)
    assert shown.exit_code == 0, shown.output
    assert "type OrderPaid" in shown.output and "OrderCreated" not in shown.output


@pytest.mark.parametrize(("args", "says"), [
    (["not-a-uuid"], "is not a UUID"),
    (["--topic", TOPIC, "--key", "k", "--event-type", "a\nb"], "control characters"),
    ([str(uuid.uuid4()), "--event-type", "A"], "--event-type filters a key trace"),
    (["--topic", "nope", "--key", "k"], "topic 'nope' is in none"),
    (["--topic", "bad topic", "--key", "k"], "invalid topic"),
    (["--topic", TOPIC], "needs both --topic and --key"),
    ([], "give a message id, or --topic and --key"),
])
def test_bad_input_is_one_error_line_and_a_failing_exit(seen_world: World, args: list[str],
                                                        says: str) -> None:
    result = runner.invoke(app, ["trace", *args, "--db", seen_world.outbox_url])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.output


ANY_CHARACTER = st.characters(categories=None, codec=None)  # lone surrogates included


@pytest.fixture(scope="module")
def small_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('trace')}/small.db"
    outbox = Outbox(create_engine(url))
    outbox.create_tables()
    _publish(outbox, "k", 1)  # the one key found: every other input is an error
    yield url


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(topic=st.one_of(st.text(ANY_CHARACTER, max_size=300), st.sampled_from([TOPIC, "nope"])),
       key=st.one_of(st.text(ANY_CHARACTER, max_size=300), st.just("k")))
def test_any_text_as_topic_and_key_gets_an_answer_or_a_clean_error(small_db: str, topic: str,
                                                                   key: str) -> None:
    result = _cli("--topic", topic, "--key", key, "--db", small_db, "--json")
    if result.exit_code == 0:
        assert json.loads(result.output)["key"]["key"] == key and (topic, key) == (TOPIC, "k")
    else:
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
        assert "Traceback" not in result.output


def test_every_trace_query_is_an_index_lookup(world: World) -> None:
    """The plan of every statement a trace runs: no full scan of any table (of its index neither).

    On PostgreSQL sequential scans are switched off for the check, so a plan
    that still scans is one no index can serve, however small the test tables.
    """
    engine = world.outbox.engine
    postgres = engine.dialect.name == "postgresql"
    plans: list[tuple[str, str]] = []

    def explain(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("SELECT") and "pg_catalog" not in statement:
            prefix = "EXPLAIN " if postgres else "EXPLAIN QUERY PLAN "
            rows = conn.exec_driver_sql(prefix + statement, parameters).all()
            plans.append((statement, "\n".join(str(r[-1]) for r in rows)))

    def no_seqscan(conn, record):  # type: ignore[no-untyped-def]
        conn.cursor().execute("SET enable_seqscan = off")

    if postgres:
        engine.dispose()
        sa.event.listen(engine, "connect", no_seqscan)
    sa.event.listen(engine, "before_cursor_execute", explain)
    try:
        outbox_db, _ = world.dbs()
        trace_message(outbox_db, [], world.ids["bad-1"][1])
        trace_message(outbox_db, [], world.ids["gap-1"][0])
        trace_key(outbox_db, [], TOPIC, "bad-1")
        trace_key(outbox_db, [], TOPIC, "gap-1")
        trace_key(outbox_db, [], TOPIC, "late-1")
    finally:
        sa.event.remove(engine, "before_cursor_execute", explain)
        if postgres:
            sa.event.remove(engine, "connect", no_seqscan)
    # Every index read is bounded: a condition on its leading columns, or min() under a Limit.
    scans = [(s, p) for s, p in plans if "Seq Scan" in p or "SCAN " in p.replace("SCAN CONSTANT", "")
             or ("Index" in p and "Index Cond" not in p and "Limit" not in p)]
    assert len(plans) > 20 and not scans, scans


def test_a_database_named_twice_is_read_once(seen_world: World) -> None:
    outbox_db, inbox_dbs = seen_world.dbs()
    doc = trace_message(outbox_db, [*inbox_dbs, outbox_db, *inbox_dbs], seen_world.ids["order-1"][0])
    [m] = doc["messages"]
    assert sorted(g["group"] for g in m["groups"]) == ["billing", "shipping"]
    assert m["outbox"] is not None


def test_two_in_memory_databases_spelled_alike_are_two() -> None:
    """``sqlite://`` names a new database for each engine: the inbox's is read, not taken for the outbox's."""
    outbox = Outbox(sa.create_engine("sqlite://"))
    outbox.create_tables()
    inbox = Inbox(sa.create_engine("sqlite://"), group="billing", concurrency=1)
    inbox.handler(TOPIC)(lambda session, message: None)
    inbox.create_tables()
    message_id = uuid.uuid4()
    inbox.handle(record(TOPIC, "k", 1, message_id=message_id))
    assert isinstance(outbox.engine, sa.Engine) and isinstance(inbox.engine, sa.Engine)
    doc = trace_message(Database("outbox-db", outbox.engine, outbox.tables),
                        [Database("inbox-db", inbox.engine, inbox.tables)], message_id)
    [m] = doc["messages"]
    assert [(g["group"], g["state"]) for g in m["groups"]] == [("billing", "applied")]


def test_a_prefix_in_another_case_is_one_set_of_tables_where_the_database_says_so(db_url: str) -> None:
    """SQLite takes a table name in any case: ``out_`` and ``OUT_`` name one set of tables there, read
    once. On PostgreSQL ``OUT_outbox_messages`` (sent quoted) is another table: read apart, it has none."""
    engine = create_engine(db_url)
    outbox = Outbox(engine, prefix="out_")
    outbox.create_tables()
    inbox = Inbox(engine, group="billing", prefix="out_", concurrency=1)
    inbox.handler(TOPIC)(lambda session, message: None)
    message_id = uuid.uuid4()
    inbox.handle(record(TOPIC, "k", 1, message_id=message_id))
    upper = Database("upper", engine, OutboxTables(prefix="OUT_"))
    doc = trace_message(Database("lower", engine, outbox.tables), [upper], message_id)
    [m] = doc["messages"]
    assert [(g["group"], g["state"]) for g in m["groups"]] == [("billing", "applied")]
    assert doc["unreachable"] == []  # SQLite: read again, it waited for the first read's lock
    if engine.dialect.name == "sqlite":
        assert "upper" not in json.dumps(doc)  # not read: the lower-case name's tables, read already
    engine.dispose()


_HIDDEN_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _printed(doc: dict[str, Any]) -> str:
    import contextlib
    import io

    from outbox.cli._trace import print_trace
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_trace(doc)
    return out.getvalue()


def _traced(key: str, group: str, error: str) -> dict[str, Any]:
    """A key trace's document as ``trace_key`` gives it, with database-held text in every field."""
    group_part = {"database": "db", "group": group, "state": "parked", "reason": error, "attempts": 2,
                  "error": error, "last_failure_at": "2026-11-25T10:00:00+00:00", "partition": None}
    outbox_part = {"status": "failed", "created_at": "2026-11-25T10:00:00+00:00", "attempts": 2,
                   "last_error": error, "available_at": None, "partition": None}
    return {"key": {"topic": "orders", "key": key, "outbox": None,
                    "groups": [{"database": "db", "group": group, "seen": True, "last_applied_seq": 1,
                                "parked": True, "parked_at": "2026-11-25T10:00:00+00:00",
                                "parked_reason": error, "parked_messages": 1, "parked_seqs": [2],
                                "held_seqs": []}]},
            "messages": [{"message_id": "m", "topic": "orders", "key": key, "seq": 2,
                          "outbox": outbox_part, "groups": [group_part]}]}


@settings(max_examples=150, deadline=None)
@given(key=st.text(max_size=5), group=st.text(max_size=5), error=st.text(max_size=5))
def test_text_from_the_databases_cannot_forge_or_hide_a_line_of_the_table(key: str, group: str,
                                                                          error: str) -> None:
    """A key, group or error holding newlines, ANSI escapes, bidi overrides, separators or lone
    surrogates is printed as visible escapes: the table has the lines it has for plain text."""
    shown = _printed(_traced(key, group, error))
    assert not any(unicodedata.category(c) in _HIDDEN_CATEGORIES for c in shown.replace("\n", ""))
    assert len(shown.splitlines()) == len(_printed(_traced("k", "g", "e")).splitlines())


DOWN = "postgresql+psycopg://ops:pw-s3cr3t-9@127.0.0.1:1/shipping?connect_timeout=2"


def test_an_inbox_database_that_is_down_is_one_line_and_the_others_are_traced(seen_world: World) -> None:
    mid = str(seen_world.ids["bad-1"][1])
    shown = _cli(mid, "--db", seen_world.outbox_url, "--inbox-db", DOWN, "--inbox-db", seen_world.inbox_url)
    assert shown.exit_code == 0, shown.output
    down = [line for line in shown.output.splitlines() if "could not be read" in line]
    assert len(down) == 1 and "127.0.0.1:1/shipping" in down[0], shown.output
    assert "parked behind seq 1 of its key" in shown.output and "group shipping" in shown.output
    as_json = _cli("--topic", TOPIC, "--key", "bad-1", "--db", seen_world.outbox_url, "--inbox-db", DOWN,
                   "--json")
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)
    assert [u["database"] for u in doc["unreachable"]] == ["postgresql+psycopg://ops:***@127.0.0.1:1/shipping"
                                                            "?connect_timeout=2"]
    assert doc["key"]["outbox"] is not None
    assert "pw-s3cr3t-9" not in shown.output + as_json.output
    only_down = _cli(mid, "--inbox-db", DOWN)
    assert only_down.exit_code == 1 and "pw-s3cr3t-9" not in only_down.output


def test_the_console_trace_page_shows_the_databases_it_can_read(seen_world: World) -> None:
    from starlette.testclient import TestClient

    from outbox.console import create_app
    down = sa.create_engine(DOWN)
    client = TestClient(create_app(seen_world.outbox, inbox_databases=[down, seen_world.shipping.engine]),
                        base_url="http://127.0.0.1")
    page = client.get("/trace", params={"id": str(seen_world.ids["bad-1"][1])})
    assert page.status_code == 200, page.text
    assert "could not be read" in page.text and "group shipping" in page.text
    assert "pw-s3cr3t-9" not in page.text


def test_a_key_trace_traces_only_the_messages_it_shows(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each traced message costs lookups in every database: a key with many waiting messages in
    many groups traces ``limit`` of them (the first by seq) and only counts the rest."""
    import outbox.ops._trace as module
    traced: list[uuid.UUID] = []
    real = module._message

    def counting(opened, message_id):  # type: ignore[no-untyped-def]
        traced.append(message_id)
        return real(opened, message_id)

    first, _ = _publish(world.outbox, "mix-1", 2)  # unsent: the outbox lists seq 1
    world.billing.handle(record(TOPIC, "mix-1", 2))  # another id at seq 2, held in billing
    monkeypatch.setattr(module, "_message", counting)
    outbox_db, inbox_dbs = world.dbs()
    doc = trace_key(outbox_db, inbox_dbs, TOPIC, "mix-1", limit=1)
    assert traced == [first] and doc["more"] is True
    assert [m["seq"] for m in doc["messages"]] == [1]


def test_an_inbox_database_of_an_older_schema_is_one_line_and_the_others_are_traced(world: World) -> None:
    """A query that fails on one database mid-trace (here a column its schema lacks) leaves that
    database out with its reason; the outbox and the other groups are still shown."""
    with world.shipping.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE inbox_messages DROP COLUMN kafka_offset")
    mid = str(world.ids["bad-1"][1])
    shown = _cli(mid, "--db", world.outbox_url, "--inbox-db", world.inbox_url)
    assert shown.exit_code == 0, shown.output
    down = [line for line in shown.output.splitlines() if "could not be read" in line]
    assert len(down) == 1 and "shipping.db" in down[0] and "kafka_offset" in down[0], shown.output
    assert "parked behind seq 1 of its key" in shown.output and "group shipping" not in shown.output
    as_json = _cli("--topic", TOPIC, "--key", "bad-1", "--db", world.outbox_url, "--inbox-db",
                   world.inbox_url, "--json")
    assert as_json.exit_code == 0, as_json.output
    doc = json.loads(as_json.output)
    assert [u["error"] for u in doc["unreachable"]] == ["no such column: inbox_messages.kafka_offset"]
    assert doc["messages"] and all([g["group"] for g in m["groups"]] == ["billing"] for m in doc["messages"])


def test_a_database_named_twice_in_two_spellings_is_read_once(world: World) -> None:
    """Two URLs of one database (``dir/./file``, ``localhost``): its server says it is one."""
    outbox_db, inbox_dbs = world.dbs()
    url = world.outbox.engine.url
    if url.get_backend_name() == "sqlite":
        folder, _, file = str(url.database).rpartition("/")
        again = url.set(database=f"{folder}/./{file}")
    else:
        again = url.set(host="localhost")
    respelled = Database("outbox-db-again", create_engine(again.render_as_string(hide_password=False)),
                         world.outbox.tables)
    doc = trace_message(outbox_db, [*inbox_dbs, respelled], world.ids["bad-1"][0])
    [m] = doc["messages"]
    assert sorted(g["group"] for g in m["groups"]) == ["billing", "shipping"]
    assert doc["unreachable"] == []  # not read at all (SQLite: read, it waited for the first's lock)
    doc = trace_key(respelled, [outbox_db, *inbox_dbs], TOPIC, "bad-1")
    assert sorted(g["group"] for g in doc["key"]["groups"]) == ["billing", "shipping"]
    assert doc["unreachable"] == []
    respelled.engine.dispose()
