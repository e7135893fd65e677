"""Every ``outbox`` command, given a bad command line, says what is wrong in one or two lines.

Each case runs ``python -m outbox …`` as an operator would and checks the exit
status (2 usage and configuration, 1 runtime), that stderr names the problem,
that it is at most two lines without a traceback, and that a command that only
reads left no SQLite file behind. The mapping itself is ``outbox/cli/_errors.py``.

Most cases run that entry point in the test's process (``_in_process``: a
process start is a second and more, the command's failure milliseconds); one
case of each way a failure leaves the process runs as a process of its own
(``AS_A_PROCESS``), as do the tests below that need a process's start, signals
or exit.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from _in_process import outbox_in_process
from _relay_helpers import wait_for

from outbox import Outbox, create_engine
from outbox.testing import LocalPostgres
from transports.kafka import embedded_kafka

ROOT = Path(__file__).resolve().parents[1]
NOWHERE = "postgresql+psycopg://outbox@127.0.0.1:1/x"  # nothing listens on port 1
UNKNOWN_ID = "0195c3a4-0000-7000-8000-000000000000"

INBOX_APP = """
from outbox import Inbox, create_engine

inbox = Inbox(create_engine({db!r}), group="billing")


@inbox.handler("orders")
def handle(session, message):
    pass
"""


def outbox_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def assert_one_sentence(result: subprocess.CompletedProcess[str], status: int, *names: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status, result.stderr
    assert 1 <= len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("error: "), result.stderr
    for name in names:
        assert name in result.stderr, result.stderr


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """SQLite files: ``empty.db`` (no tables), ``ready.db`` (initialised), ``outboxonly.db``
    (no inbox tables); and inbox app modules on them."""
    sqlite3.connect(tmp_path / "empty.db").close()
    outbox = Outbox(create_engine(f"sqlite:///{tmp_path / 'ready.db'}"))
    outbox.create_tables()
    outbox.engine.dispose()  # type: ignore[union-attr]
    outbox = Outbox(create_engine(f"sqlite:///{tmp_path / 'outboxonly.db'}"))
    outbox.create_tables()
    with outbox.engine.begin() as conn:  # type: ignore[union-attr]
        for table in ("inbox_held", "inbox_parked", "inbox_keys", "inbox_messages"):
            conn.exec_driver_sql(f"DROP TABLE {table}")
    outbox.engine.dispose()  # type: ignore[union-attr]
    (tmp_path / "outboxonlyapp.py").write_text(
        INBOX_APP.format(db=f"sqlite:///{tmp_path / 'outboxonly.db'}"))
    (tmp_path / "emptyapp.py").write_text(INBOX_APP.format(db=f"sqlite:///{tmp_path / 'empty.db'}"))
    (tmp_path / "missingapp.py").write_text(INBOX_APP.format(db=f"sqlite:///{tmp_path / 'gone.db'}"))
    return tmp_path


# (command line, exit status, what stderr must name); {d} is the work directory.
WHO = ["--by", "me", "--reason", "x"]  # an operator action says who and why

CASES = [
    # the eight
    (["stats", "--db", "sqlite:///{d}/missing.db"], 2, ["missing.db does not exist", "init-db"]),
    (["parked", "list", "--db", "sqlite:///{d}/empty.db", "--group", "g"], 2,
     ["inbox_parked", "empty.db", "init-db"]),
    (["relay", "--db", "notadb://x", "--bootstrap-servers", "127.0.0.1:1"], 2,
     ["unknown database dialect", "notadb://x"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--prefix", "app_", "--bootstrap-servers", "127.0.0.1:1"], 2,
     ["no outbox tables with prefix 'app_'", "ready.db", "init-db"]),
    (["failed", "retry", "--all", "--db", "sqlite:///{d}/empty.db", *WHO], 2,
     ["no outbox tables", "init-db"]),
    (["inbox", "run", "emptyapp:inbox", "--bootstrap-servers", "127.0.0.1:1"], 2,
     ["no outbox tables", "empty.db", "init-db"]),
    (["inbox", "run", "outboxonlyapp:inbox", "--bootstrap-servers", "127.0.0.1:1"], 2,
     ["table inbox_messages does not exist", "outboxonly.db", "init-db"]),
    (["inbox", "run", "nosuchmodule:inbox", "--bootstrap-servers", "127.0.0.1:1"], 2,
     ["cannot import 'nosuchmodule:inbox'"]),
    (["spark", "audit", "--outbox-db", "sqlite:///{d}/missing.db"], 2,
     ["outbox_messages does not exist", "missing.db: there is no such database file"]),
    # outbox status: nothing created, missing tables and a dead database named like everywhere
    (["status", "--db", "sqlite:///{d}/missing.db"], 2, ["missing.db does not exist", "init-db"]),
    (["status", "--db", "sqlite:///{d}/empty.db"], 2, ["no outbox tables and no inbox tables", "init-db"]),
    (["status", "--db", "sqlite:///{d}/ready.db", "--prefix", "app_"], 2,
     ["no outbox tables and no inbox tables with prefix 'app_'", "ready.db"]),
    (["status", "--db", NOWHERE, "--json"], 1, ["cannot reach", "127.0.0.1:1"]),
    (["status", "--db", "sqlite:///{d}/ready.db", "--stuck-after", "-1"], 2, ["--stuck-after"]),
    # outbox trace: bad ids, unknown names, databases without tables or unreachable
    (["trace", "not-a-uuid", "--db", "sqlite:///{d}/ready.db"], 2, ["'not-a-uuid' is not a UUID"]),
    (["trace", UNKNOWN_ID, "--db", "sqlite:///{d}/ready.db"], 2, [UNKNOWN_ID, "in none of the databases"]),
    (["trace", "--topic", "orders", "--key", "1", "--db", "sqlite:///{d}/ready.db"], 2,
     ["topic 'orders' is in none of the databases"]),
    (["trace", UNKNOWN_ID, "--db", "sqlite:///{d}/empty.db"], 2, ["no outbox or inbox tables", "empty.db"]),
    (["trace", UNKNOWN_ID, "--db", "sqlite:///{d}/missing.db"], 2, ["missing.db does not exist"]),
    (["trace", UNKNOWN_ID, "--inbox-db", NOWHERE], 1, ["cannot reach", "127.0.0.1:1"]),
    # a missing driver, an unparseable URL, a missing option
    (["stats", "--db", "postgresql+asyncpg://u@h/x"], 2, ["asyncpg", "driver"]),
    (["failed", "list", "--db", "not a url"], 2, ["invalid database URL"]),
    (["stats"], 2, ["Missing option '--db'", "--help"]),
    # an operator action records who and why, like the console's: both required, neither blank
    (["failed", "skip", "--all", "--db", "sqlite:///{d}/ready.db"], 2, ["Missing option '--by'"]),
    (["failed", "retry", "--all", "--by", "me", "--db", "sqlite:///{d}/ready.db"], 2,
     ["Missing option '--reason'"]),
    (["failed", "retry", "--all", "--by", "me", "--reason", " ", "--db", "sqlite:///{d}/ready.db"], 2,
     ["--reason", "say why"]),
    (["parked", "replay", "--all", "--app", "emptyapp:inbox", "--by", " ", "--reason", "x"], 2,
     ["--by", "say who"]),
    (["parked", "replay", "--all", "--app", "emptyapp:inbox", "--by", "me"], 2,
     ["Missing option '--reason'"]),
    # a database that does not answer, for a one-shot command: a runtime failure
    (["stats", "--db", NOWHERE], 1, ["cannot reach", "127.0.0.1:1", "Connection refused"]),
    (["init-db", "--db", NOWHERE], 1, ["cannot reach", "127.0.0.1:1"]),
    # unknown and malformed message ids
    (["failed", "retry", UNKNOWN_ID, "--db", "sqlite:///{d}/ready.db", *WHO], 2,
     [UNKNOWN_ID, "no failed row", "outbox failed list"]),
    (["failed", "skip", "not-an-id", "--db", "sqlite:///{d}/ready.db", *WHO], 2,
     ["not a message id: not-an-id"]),
    (["parked", "discard", UNKNOWN_ID, "--by", "me", "--reason", "x", "--db", "sqlite:///{d}/ready.db",
      "--group", "g"], 1, [UNKNOWN_ID, "not parked"]),
    (["failed", "retry", "--db", "sqlite:///{d}/ready.db", *WHO], 2, ["message ids or --all"]),
    # bad -X settings
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "-X", "linger.ms"], 2,
     ["--kafka-config", "KEY=VALUE"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "-X", "lingerr=5"], 2,
     ["unknown Kafka setting 'lingerr'"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "-X", "linger.ms=soon"], 2,
     ["invalid Kafka setting"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "-X",
      "default.topic.config=x"], 2,
     ["'default.topic.config' must be a mapping"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "-X",
      "message.max.bytes=500000"], 2,
     ["at most 500000 bytes (message.max.bytes)", "max_record_bytes=1000000"]),
    (["inbox", "run", "emptyapp:inbox", "--bootstrap-servers", "x:9", "-X", "enable.auto.commit=true"], 2,
     ["enable.auto.commit must stay off"]),
    # the other commands
    (["init-db", "--db", "notadb://x"], 2, ["unknown database dialect"]),
    (["init-db", "--db", "sqlite:///{d}/ready.db", "--max-record-bytes", "100"], 2,
     ["max_record_bytes must be an int from 4096"]),
    (["demo", "--orders", "1"], 2, ["--orders", "greater than or equal to 10"]),
    (["spark", "archive", "--db", "sqlite:///{d}/missing.db", "--archive-dir", "{d}/arch",
      "--retention", "7d"], 2, ["outbox_messages does not exist", "no such database file"]),
    (["spark", "replay", "--archive-dir", "{d}/nowhere", "--db", "sqlite:///{d}/ready.db",
      "--topic", "orders"], 2, ["archive directory", "does not exist"]),
    (["nosuch"], 2, ["No such command 'nosuch'"]),
    (["dev-broker", "--brokers", "0"], 2, ["--brokers", "greater than or equal to 1"]),
    # an app whose SQLite file does not exist
    (["parked", "replay", "orders", "k", "--app", "missingapp:inbox", *WHO], 2, ["gone.db does not exist"]),
    # parked replay: one key or --all, never neither nor both; parked list's --prefix is checked
    (["parked", "replay", "--app", "emptyapp:inbox", *WHO], 2, ["give TOPIC [KEY]", "--all"]),
    (["parked", "replay", "orders", "k", "--all", "--app", "emptyapp:inbox", *WHO], 2, ["a KEY or --all"]),
    (["parked", "replay", "--all", "--app", "emptyapp:inbox", *WHO], 2,
     ["inbox_parked", "empty.db", "init-db"]),
    (["parked", "list", "--db", "sqlite:///{d}/ready.db", "--group", "g", "--prefix", "app_"], 2,
     ["app_inbox_parked", "init-db"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "--key-stuck-after", "0"],
     2, ["--key-stuck-after"]),
    # the console: a missing database, and a network address without a credential
    (["console", "--db", "sqlite:///{d}/missing.db"], 2, ["missing.db does not exist", "init-db"]),
    # housekeeping: nothing to delete named, a bad period, a missing database; a worker's --retention
    (["housekeeping", "run", "--db", "sqlite:///{d}/ready.db"], 2, ["--older-than", "--dedup-window"]),
    (["init-db", "--db", "sqlite:///{d}/ready.db", "--partitioned"], 2, ["--partitioned", "PostgreSQL"]),
    (["housekeeping", "run", "--db", "sqlite:///{d}/ready.db", "--older-than", "7days"], 2,
     ["--older-than", "'7days'", "7d"]),
    (["housekeeping", "run", "--db", "sqlite:///{d}/missing.db", "--older-than", "7d"], 2,
     ["missing.db does not exist"]),
    (["inbox", "run", "emptyapp:inbox", "--bootstrap-servers", "x:9", "--retention", "30d"], 2,
     ["--retention", "dedup_window"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "--retention", "0d"], 2,
     ["retention must be positive"]),
    (["relay", "--db", "sqlite:///{d}/ready.db", "--bootstrap-servers", "x:9", "--delivery-timeout",
      "inf"], 2, ["--delivery-timeout", "less than or equal to 3600"]),
    (["console", "--db", "sqlite:///{d}/ready.db", "--host", "0.0.0.0"], 2,
     ["--host", "OUTBOX_CONSOLE_TOKEN"]),
]

# One case of each way a failure leaves ``python -m outbox``, run as that process: click's usage
# error before any command runs (``main`` reports it), a command's configuration error (its
# ``reporting`` wrapper exits 2), a database that does not answer (1), a command that configured
# logging before it failed (the relay). Also run as processes: what gets as far as a worker
# (``inbox run`` on an app whose tables are missing makes its Kafka consumer and tunes the
# garbage collector for the process before the inbox finds no tables), and the Spark commands,
# which never run in a test worker's process (it has a Spark session of its own).
AS_A_PROCESS = [
    ["stats"],
    ["stats", "--db", "sqlite:///{d}/missing.db"],
    ["stats", "--db", NOWHERE],
    ["relay", "--db", "notadb://x", "--bootstrap-servers", "127.0.0.1:1"],
    ["inbox", "run", "emptyapp:inbox", "--bootstrap-servers", "127.0.0.1:1"],
    ["inbox", "run", "outboxonlyapp:inbox", "--bootstrap-servers", "127.0.0.1:1"],
]
assert all(any(args == case[0] for case in CASES) for args in AS_A_PROCESS)

# Commands whose bad input is tested elsewhere in this file (they need more than one command line).
TESTED_APART = {"spark warm-up": "test_spark_warm_up_with_archives_turned_off_says_so"}


@pytest.mark.parametrize("args, status, names", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_a_bad_command_line_gets_one_clear_sentence(
    workdir: Path, args: list[str], status: int, names: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    before = databases(workdir)
    command_line = [a.format(d=workdir) for a in args]
    if args in AS_A_PROCESS or args[0] == "spark":
        result = outbox_cli(*command_line, cwd=workdir)
    else:
        result = outbox_in_process(capfd, *command_line, cwd=workdir)
    assert_one_sentence(result, status, *names)
    assert databases(workdir) == before, "a failed command created a database file"


def test_every_command_has_a_bad_input_case() -> None:
    import typer
    from typer.core import TyperGroup

    from outbox.cli import app

    def paths(command: object, prefix: str) -> list[str]:
        if isinstance(command, TyperGroup):
            return [p for name, sub in command.commands.items()
                    for p in paths(sub, f"{prefix} {name}".strip())]
        return [prefix]
    covered = {" ".join(a for a in args[:2] if not a.startswith("-")) for args, _, _ in CASES}
    covered |= {args[0] for args, _, _ in CASES}
    every = paths(typer.main.get_command(app), "")
    missing = [p for p in every if p not in covered and p not in TESTED_APART]
    assert missing == [], f"commands without a bad-input case: {missing}"
    assert all(name in globals() for name in TESTED_APART.values())


def databases(directory: Path) -> set[str]:
    """The SQLite files (SQLite's -wal/-shm companions of an existing one are no new database)."""
    return {p.name for p in directory.iterdir() if p.suffix == ".db"}


def test_the_traceback_is_there_at_debug(workdir: Path) -> None:
    result = outbox_cli("relay", "--db", "notadb://x", "--bootstrap-servers", "x:9",
                        "--log-level", "DEBUG", cwd=workdir)
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown database dialect")


@pytest.mark.postgres
def test_a_wrong_schema_on_postgresql_is_named(postgres_db: str, tmp_path: Path) -> None:
    outbox = Outbox(create_engine(postgres_db))
    outbox.create_tables()
    outbox.engine.dispose()  # type: ignore[union-attr]
    for command in (["stats"], ["failed", "list"], ["status"]):
        result = outbox_cli(*command, "--db", postgres_db, "--schema", "nosuch", cwd=tmp_path)
        assert_one_sentence(result, 2, "no outbox tables", "init-db")


@pytest.mark.slow
def test_a_relay_waits_for_a_database_that_does_not_answer_yet(tmp_path: Path) -> None:
    """It may be starting: one line saying so, no traceback, and SIGTERM ends the wait with 0."""
    relay = subprocess.Popen([sys.executable, "-m", "outbox", "relay", "--db", NOWHERE,
                              "--bootstrap-servers", "127.0.0.1:1"], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(6)  # start-up, and a few retries
        assert relay.poll() is None, relay.communicate()[1]
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=30)
    finally:
        relay.kill()
    assert relay.returncode == 0, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "127.0.0.1:1/x unreachable" in lines[0] and "waiting for it" in lines[0]


@pytest.mark.slow
@pytest.mark.postgres
def test_a_relay_started_before_its_database_starts_once_it_answers(
    own_postgres: LocalPostgres, tmp_path: Path
) -> None:
    """Started while PostgreSQL is down: one line each way, then it takes its shards."""
    engine = create_engine(own_postgres.url)
    Outbox(engine).create_tables()
    engine.dispose()
    own_postgres.stop()
    log = tmp_path / "relay.err"
    with log.open("w") as err:
        relay = subprocess.Popen([sys.executable, "-m", "outbox", "relay", "--db", own_postgres.url,
                                  "--bootstrap-servers", "127.0.0.1:1"], cwd=tmp_path, text=True,
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        # The database starts only once the relay has met it down: a fixed sleep raced a slow
        # start under load (the relay had not tried yet, so it never saw the outage).
        wait_for(lambda: "waiting for it" in log.read_text() or relay.poll() is not None, 60,
                 "the relay to meet its database down")
        assert relay.poll() is None, log.read_text()
        own_postgres.start()
        wait_for(lambda: owned_shards(own_postgres.url) or relay.poll() is not None, 60,
                 "the relay to take its shards")
        assert relay.poll() is None, log.read_text()
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    finally:
        relay.kill()
    stderr = log.read_text()
    assert relay.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert sum("unreachable" in line and "waiting for it" in line for line in stderr.splitlines()) == 1
    assert sum("reachable again" in line for line in stderr.splitlines()) == 1, stderr


def owned_shards(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql(
                "SELECT count(*) FROM outbox_leases WHERE owner IS NOT NULL").scalar_one())
    except sa.exc.OperationalError:
        return 0  # not up yet
    finally:
        engine.dispose()


@pytest.mark.slow
def test_a_relay_with_no_broker_logs_through_python_logging(workdir: Path) -> None:
    """librdkafka's refused connections: no raw ``%3|…|FAIL|`` lines, at most one logged line."""
    outbox = Outbox(create_engine(f"sqlite:///{workdir / 'ready.db'}"))
    from sqlalchemy.orm import Session

    with Session(outbox.engine) as session, session.begin():
        outbox.publish(session, "orders", {"n": 1}, key="k")
    outbox.engine.dispose()  # type: ignore[union-attr]
    relay = subprocess.Popen([sys.executable, "-m", "outbox", "relay", "--db", f"sqlite:///{workdir}/ready.db",
                              "--bootstrap-servers", "127.0.0.1:1", "--poll-interval", "0.2"],
                             cwd=workdir, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(15)  # the first publish waits for metadata (10 s), then backs off
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=60)
    finally:
        relay.kill()
    assert relay.returncode == 0, stderr
    assert "%3|" not in stderr and "Traceback" not in stderr, stderr
    assert sum("transports.kafka.librdkafka" in line for line in stderr.splitlines()) <= 2, stderr
    assert sum("broker unreachable" in line for line in stderr.splitlines()) == 1, stderr


def test_spark_warm_up_with_archives_turned_off_says_so(tmp_path: Path) -> None:
    """An empty OUTBOX_SPARK_CLASS_CACHE turns archives off: warm-up refuses in one line,
    before Spark starts."""
    import os

    result = subprocess.run([sys.executable, "-m", "outbox", "spark", "warm-up"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=120,
                            env={**os.environ, "OUTBOX_SPARK_CLASS_CACHE": ""})
    assert_one_sentence(result, 2, "OUTBOX_SPARK_CLASS_CACHE")
    assert list(tmp_path.iterdir()) == []


def test_exactly_once_over_tenants_with_a_bad_progress_topic_is_refused_in_one_line(tmp_path: Path) -> None:
    result = outbox_cli("relay", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--bootstrap-servers",
                        "127.0.0.1:9", "--tenants", "a,b", "--exactly-once", "--progress-topic", "no good",
                        cwd=tmp_path)
    assert_one_sentence(result, 1, "no good")


def test_exactly_once_with_a_batch_its_progress_record_could_not_carry_is_refused_in_one_line(
        tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert outbox_cli("init-db", "--db", db, cwd=tmp_path).returncode == 0
    result = outbox_cli("relay", "--db", db, "--bootstrap-servers", "127.0.0.1:9", "--exactly-once",
                        "--batch-size", "50000", cwd=tmp_path)
    assert_one_sentence(result, 2, "batch_size=50000", "use batch_size 87")  # 8,742-8,744 by relay name


def test_exactly_once_on_the_embedded_broker_is_refused_in_one_line(tmp_path: Path) -> None:
    """librdkafka's mock cluster (``outbox dev-broker``) answers neither the progress topic's creation
    nor a look at its configuration, and fences no producer: exactly once there waited as in a broker
    outage, for good. It is refused at the relay's start, by the cluster's own id."""
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert outbox_cli("init-db", "--db", db, cwd=tmp_path).returncode == 0
    with embedded_kafka(brokers=1) as bootstrap:
        result = outbox_cli("relay", "--db", db, "--bootstrap-servers", bootstrap, "--exactly-once",
                            "--log-level", "ERROR", cwd=tmp_path)
    assert_one_sentence(result, 2, "mock cluster", "mockCluster", "Exactly once needs Apache Kafka")


def test_a_tenant_fleets_exactly_once_on_the_embedded_broker_is_refused_in_one_line(
        postgres_db: str, tmp_path: Path) -> None:
    """Its tenants share the broker: the refusal ends the fleet (it was logged per tenant and tried
    again with backoff for good, the command never exiting)."""
    engine = sa.create_engine(postgres_db)
    with engine.begin() as conn:
        for schema in ("acme", "globex"):
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    engine.dispose()
    made = outbox_cli("init-db", "--db", postgres_db, "--tenants", "acme,globex", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    with embedded_kafka(brokers=1) as bootstrap:
        result = outbox_cli("relay", "--db", postgres_db, "--bootstrap-servers", bootstrap, "--tenants",
                            "acme,globex", "--exactly-once", "--log-level", "ERROR", cwd=tmp_path)
    assert_one_sentence(result, 2, "mock cluster", "Exactly once needs Apache Kafka")


def test_a_missing_module_is_blamed_on_what_is_missing_not_always_the_database_driver(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A module of our own that cannot be imported (a broken installation: seen when a file moved
    under a running relay) said "install the database driver this URL names"; an extra's missing
    library said the same over the extra's own instructions."""
    from outbox.cli import report

    def reported(exc: BaseException) -> tuple[str, int]:
        status = report(exc)
        return capsys.readouterr().err, status

    ours, _ = reported(ModuleNotFoundError("No module named 'transports.kafka._weak'",
                                           name="transports.kafka._weak"))
    assert "installation is broken" in ours and "database driver" not in ours, ours
    try:
        try:
            raise ModuleNotFoundError("No module named 'confluent_kafka'", name="confluent_kafka")
        except ModuleNotFoundError as cause:
            raise ImportError('transports.kafka needs confluent-kafka: pip install '
                              '"transactional-outbox[kafka]"') from cause
    except ImportError as extra:
        message, status = reported(extra)
    assert "error: transports.kafka needs confluent-kafka: pip install" in message and status == 2, message
    driver, status = reported(ModuleNotFoundError("No module named 'psycopg'", name="psycopg"))
    assert "install the database driver this URL names" in driver and status == 2, driver
