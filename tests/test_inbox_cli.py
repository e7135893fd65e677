"""The inbox CLI: ``outbox parked list|replay|discard`` and ``outbox inbox run MODULE:ATTRIBUTE``."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from outbox.cli import app
from tests.inbox_support import INBOX_KINDS, applied, async_url, business, record
from tests.test_inbox_kafka import produce

WHO = ["--by", "alice", "--reason", "the fix is deployed"]  # every operator action says who and why
ROOT = Path(__file__).resolve().parents[1]

APP_MODULE = '''
from outbox import Inbox, create_engine
from tests.inbox_support import apply_effect

inbox = Inbox(create_engine({db!r}), group="cli", retry_backoff=0.001)
BROKEN = {{"seq": 2}}


@inbox.handler({topic!r})
def handle(session, message):
    if message.seq == BROKEN["seq"]:
        raise RuntimeError("bug 42")
    apply_effect(session, message)
'''

ASYNC_APP_MODULE = '''
from outbox import Inbox, create_async_engine
from tests.inbox_support import apply_effect

inbox = Inbox(create_async_engine({db!r}), group="cli", retry_backoff=0.001)


@inbox.handler({topic!r})
async def handle(session, message):
    await session.run_sync(apply_effect, message)
'''


@pytest.fixture
def app_module(sqlite_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    name = f"cliapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(APP_MODULE.format(db=sqlite_db, topic="orders"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    module.inbox.create_tables()
    business.create_all(module.inbox.sessions.kw["bind"])
    yield module
    sys.modules.pop(name, None)


def test_list_replay_and_discard_from_the_command_line(app_module, sqlite_db: str, caplog) -> None:  # type: ignore[no-untyped-def]
    inbox, cli = app_module.inbox, CliRunner()
    for seq in (1, 2, 3):
        inbox.handle(record("orders", "k", seq))
    target = f"{app_module.__name__}:inbox"

    listed = cli.invoke(app, ["parked", "list", "--db", sqlite_db, "--group", "cli"])
    assert listed.exit_code == 0, listed.output
    assert "bug 42" in listed.output and "key_parked" in listed.output
    assert "2 parked message(s)" in listed.output

    still_broken = cli.invoke(app, ["parked", "replay", "orders", "k", "--app", target, *WHO])
    assert still_broken.exit_code == 1 and "stopped: RuntimeError: bug 42" in still_broken.output

    typo = cli.invoke(app, ["parked", "replay", "orders", "K", "--app", target, *WHO])
    assert typo.exit_code == 1 and "no key 'K' of topic 'orders' is parked in group 'cli'" in typo.output
    assert len(typo.output.strip().splitlines()) <= 2, typo.output
    keys = inbox.tables.inbox_keys
    with inbox.sessions.kw["bind"].connect() as conn:  # the typo made up no key row
        assert conn.scalar(sa.select(sa.func.count()).select_from(keys).where(keys.c.key == "K")) == 0

    app_module.BROKEN["seq"] = 5  # the fix
    with caplog.at_level(logging.INFO, logger="outbox.cli.audit"):
        fixed = cli.invoke(app, ["parked", "replay", "orders", "k", "--app", target, *WHO])
    assert fixed.exit_code == 0, fixed.output
    assert "replayed by alice: the fix is deployed" in fixed.output
    assert [r.getMessage() for r in caplog.records if r.name == "outbox.cli.audit"] == [
        "replay orders/k group cli by alice (the fix is deployed): applied 2, remaining 0, unparked True, "
        "error None"]  # the console's audit line, from the command line
    assert "applied 2" in fixed.output and "unparked" in fixed.output
    assert applied(inbox.sessions.kw["bind"], "k") == [("k", 1), ("k", 2), ("k", 3)]

    for seq in (4, 5, 6):
        inbox.handle(record("orders", "k", seq))
    poison, behind = (p.message_id for p in inbox.parked())
    skip_ahead = cli.invoke(app, ["parked", "discard", str(behind), "--by", "alice", "--reason", "x",
                                  "--db", sqlite_db, "--group", "cli"])
    assert skip_ahead.exit_code == 1 and "replay or discard them first" in " ".join(skip_ahead.output.split())
    args = ["parked", "discard", str(poison), "--by", "alice", "--reason", "duplicate order",
            "--db", sqlite_db, "--group", "cli"]
    assert cli.invoke(app, args).exit_code == 0
    again = cli.invoke(app, args)
    assert again.exit_code == 1 and "not parked" in again.output


def test_every_parked_action_from_the_command_line_is_one_audit_line_refused_ones_too(  # type: ignore[no-untyped-def]
        app_module, sqlite_db: str, caplog) -> None:
    """The command line records what the console records (one ``ParkedActions`` service): a replay
    of a key with nothing parked, a refused discard and a done one, each naming who and why."""
    inbox, cli = app_module.inbox, CliRunner()
    for seq in (1, 2, 3):
        inbox.handle(record("orders", "k", seq))  # parks at seq 2, seq 3 behind it
    poison, behind = (p.message_id for p in inbox.parked())
    target = f"{app_module.__name__}:inbox"
    where = ["--db", sqlite_db, "--group", "cli"]
    with caplog.at_level(logging.INFO, logger="outbox.cli.audit"):
        assert cli.invoke(app, ["parked", "replay", "orders", "K", "--app", target, *WHO]).exit_code == 1
        refused = cli.invoke(app, ["parked", "discard", str(behind), "--by", "bob", "--reason", "x", *where])
        assert refused.exit_code == 1
        # The id in another spelling (upper case, braces): the audit line names the message, as listed.
        done = cli.invoke(app, ["parked", "discard", f"{{{str(poison).upper()}}}", "--by", "bob", "--reason",
                                "dup", *where])
        assert done.exit_code == 0, done.output
    lines = [r.getMessage() for r in caplog.records if r.name == "outbox.cli.audit"]
    assert lines[0] == "replay orders/K group cli by alice (the fix is deployed): nothing parked"
    assert lines[1].startswith(f"discard {behind} group cli by bob (x): refused: message {behind} is seq 3")
    assert lines[2:] == [f"discard {poison} group cli by bob (dup): done"]


def test_replay_all_unparks_each_fixed_key_and_leaves_a_still_broken_one(app_module) -> None:  # type: ignore[no-untyped-def]
    inbox, cli = app_module.inbox, CliRunner()
    engine = inbox.sessions.kw["bind"]
    for key, seqs in (("a", (1, 2, 3)), ("b", (1, 2))):
        for seq in seqs:
            inbox.handle(record("orders", key, seq))  # both park at seq 2
    app_module.BROKEN["seq"] = 5
    for seq in range(1, 6):
        inbox.handle(record("orders", "x", seq))  # parks at seq 5
    assert sorted({p.key for p in inbox.parked()}) == ["a", "b", "x"]
    target = f"{app_module.__name__}:inbox"

    # seq 2 is fixed, seq 5 is not: a and b unpark, x fails again, stays parked, and says so.
    partly = cli.invoke(app, ["parked", "replay", "--all", "--app", target, *WHO])
    assert partly.exit_code == 1, partly.output
    assert "2 of 3 key(s) unparked" in partly.output and partly.output.count("bug 42") == 1
    assert applied(engine, "a") == [("a", 1), ("a", 2), ("a", 3)]
    assert applied(engine, "b") == [("b", 1), ("b", 2)]
    assert [(p.key, p.seq) for p in inbox.parked()] == [("x", 5)]

    app_module.BROKEN["seq"] = 99
    done = cli.invoke(app, ["parked", "replay", "--all", "--app", target, *WHO])
    assert done.exit_code == 0 and "1 of 1 key(s) unparked" in done.output, done.output
    assert applied(engine, "x")[-1] == ("x", 5) and inbox.parked() == []


def test_bad_targets_and_options_are_named(app_module, sqlite_db: str) -> None:  # type: ignore[no-untyped-def]
    cli = CliRunner()
    missing = cli.invoke(app, ["inbox", "run", "no_such_module:inbox", "--bootstrap-servers", "x:9"])
    assert missing.exit_code == 2 and "cannot import" in missing.output
    wrong = cli.invoke(app, ["inbox", "run", f"{app_module.__name__}:BROKEN",
                             "--bootstrap-servers", "x:9"])
    assert wrong.exit_code == 2 and "not an outbox.Inbox" in wrong.output
    setting = cli.invoke(app, ["inbox", "run", f"{app_module.__name__}:inbox",
                               "--bootstrap-servers", "x:9", "-X", "lingerr=5"])
    assert setting.exit_code == 2 and "lingerr" in setting.output
    nothing = cli.invoke(app, ["parked", "list"])
    assert nothing.exit_code == 2 and "--db and --group" in nothing.output


@contextmanager
def cli_app(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            prefix: str | None = None) -> Iterator[str]:
    """An app module of ``APP_MODULE`` on ``db_url`` (its inbox's tables made, of ``prefix``); its
    ``--app`` target. Disposed and forgotten after."""
    name = f"cliapp_{uuid.uuid4().hex[:8]}"
    source = APP_MODULE.format(db=db_url, topic="orders")
    if prefix is not None:
        source = source.replace('group="cli"', f'group="cli", prefix="{prefix}"')
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    try:
        module.inbox.create_tables()
        yield f"{name}:inbox"
    finally:
        module.inbox.engine.dispose()
        sys.modules.pop(name, None)


def test_schema_given_with_app_is_the_apps_when_the_server_says_so(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--schema`` beside ``--app`` names the app's tables by what the database says, not by spelling:
    the app's ``schema=None`` is the default schema by name (``public``; ``main`` on SQLite). SQLite takes
    a schema's name in any case; PostgreSQL's ``PUBLIC`` (sent quoted) is another schema, refused."""
    with cli_app(db_url, tmp_path, monkeypatch) as target:
        cli = CliRunner()
        default = "main" if db_url.startswith("sqlite") else "public"
        same = [default, default.upper()] if db_url.startswith("sqlite") else [default]
        for schema in same:
            given = cli.invoke(app, ["parked", "list", "--app", target, "--schema", schema])
            assert given.exit_code == 0 and "no parked messages" in given.output, (schema, given.output)
        others = ["other"] if db_url.startswith("sqlite") else ["other", default.upper()]
        for schema in others:
            other = cli.invoke(app, ["parked", "list", "--app", target, "--schema", schema])
            assert other.exit_code == 2, (schema, other.output)
            assert "differ from the app's tables" in " ".join(other.output.split())
        prefix = cli.invoke(app, ["parked", "list", "--app", target, "--prefix", "x_"])
        assert prefix.exit_code == 2 and "differ from the app's tables" in " ".join(prefix.output.split())


def test_prefix_given_with_app_in_another_case_is_the_apps_where_the_database_says_so(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite takes a table name in any case: ``--prefix OUT_`` names an app's ``out_`` tables there.
    On PostgreSQL ``OUT_outbox_messages`` (sent quoted) is another table: refused."""
    with cli_app(db_url, tmp_path, monkeypatch, prefix="out_") as target:
        listed = CliRunner().invoke(app, ["parked", "list", "--app", target, "--prefix", "OUT_"])
    if db_url.startswith("sqlite"):
        assert listed.exit_code == 0 and "no parked messages" in listed.output, listed.output
    else:
        assert listed.exit_code == 2 and "differ from the app's tables" in " ".join(listed.output.split())


def test_prefix_given_with_app_that_sqlite_takes_for_another_is_refused(
        sqlite_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite folds only ASCII letters: ``--prefix \u212a_`` (the Kelvin sign, which ``str.lower`` makes
    ``k``) names other tables than an app's ``k_``; refused, not taken for the app's."""
    with cli_app(sqlite_db, tmp_path, monkeypatch, prefix="k_") as target:
        cli = CliRunner()
        same = cli.invoke(app, ["parked", "list", "--app", target, "--prefix", "K_"])
        assert same.exit_code == 0 and "no parked messages" in same.output, same.output
        other = cli.invoke(app, ["parked", "list", "--app", target, "--prefix", "\u212a_"])
        assert other.exit_code == 2, other.output
        assert "differ from the app's tables" in " ".join(other.output.split())


@pytest.mark.any_kafka
@pytest.mark.parametrize("kind", INBOX_KINDS)
def test_inbox_run_consumes_until_sigterm(sqlite_db: str, tmp_path: Path, any_kafka: str, topic: str,
                                          kind: str) -> None:
    module = APP_MODULE if kind == "sync" else ASYNC_APP_MODULE
    db = sqlite_db if kind == "sync" else async_url(sqlite_db)
    (tmp_path / "service.py").write_text(module.format(db=db, topic=topic))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "outbox", "init-db", "--db", sqlite_db], check=True,
                   cwd=tmp_path, env=env, capture_output=True)
    from outbox import create_engine

    engine = create_engine(sqlite_db)
    business.create_all(engine)
    produce(any_kafka, [record(topic, "k", 1), record(topic, "j", 1)])
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", "inbox", "run", "service:inbox", "--bootstrap-servers",
         any_kafka, "-X", "fetch_max_wait_ms=10", "-X", "session_timeout_ms=4000"],
        cwd=tmp_path, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while len(applied(engine)) < 2:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    assert sorted(applied(engine)) == [("j", 1), ("k", 1)]
