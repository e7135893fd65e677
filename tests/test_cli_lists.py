"""Every list command prints a table for people and ``--json`` for scripts; ``parked list --tsv``
keeps 0.1's lines. Values go through as text: markup in a key or an error is printed, not eaten."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from outbox import Inbox, Outbox, create_engine
from outbox.cli import app
from tests.inbox_support import record

runner = CliRunner()
KEY = "[red]order-17[/red]"  # rich markup, as a key can hold


def parked_db(tmp_path) -> str:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'inbox.db'}"
    inbox = Inbox(create_engine(url), group="billing", retry_backoff=0.001)

    @inbox.handler("orders")
    def handle(session, message):  # type: ignore[no-untyped-def]
        raise KeyError("[spark] currency")

    inbox.create_tables()
    for seq in (1, 2):
        inbox.handle(record("orders", KEY, seq))
    return url


def test_parked_list_is_a_table_with_markup_kept_and_json_and_tsv_for_scripts(tmp_path):
    url = parked_db(tmp_path)
    base = ["parked", "list", "--db", url, "--group", "billing"]
    table = runner.invoke(app, base)
    assert table.exit_code == 0, table.output
    header, *_ = [line for line in table.output.splitlines() if "reason" in line]
    assert all(column in header for column in ("topic", "key", "seq", "reason", "attempts", "message id"))
    assert table.output.count(KEY) == 2 and "[spark] currency" in table.output
    assert "2 parked message(s)" in table.output

    rows = json.loads(runner.invoke(app, [*base, "--json"]).output)
    assert [(r["key"], r["seq"], r["reason"]) for r in rows] == [(KEY, 1, "failed"), (KEY, 2, "key_parked")]
    assert rows[0]["error"].startswith("KeyError: '[spark] currency'") and rows[0]["attempts"] == 3

    lines = runner.invoke(app, [*base, "--tsv"]).output.splitlines()
    assert lines[-1] == "2 parked message(s)"
    assert lines[0].split("\t")[:5] == ["orders", KEY, "seq=1", "failed", "attempts=3"]
    assert runner.invoke(app, [*base, "--tsv", "--json"]).exit_code == 2


def test_failed_list_is_a_table_with_markup_kept_and_json_for_scripts(tmp_path):
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert runner.invoke(app, ["init-db", "--db", url]).exit_code == 0
    assert "no failed rows" in runner.invoke(app, ["failed", "list", "--db", url]).output
    assert json.loads(runner.invoke(app, ["failed", "list", "--db", url, "--json"]).output) == []
    engine = create_engine(url)
    outbox = Outbox(engine)
    with Session(engine) as session, session.begin():
        message_id = outbox.publish(session, "orders", {"n": 1}, key=KEY)
    with engine.begin() as conn:  # as the relay marks a row the broker refused for good
        conn.execute(sa.text("UPDATE outbox_messages SET status = 'failed', attempts = 1, "
                             "last_error = '[bold]too large[/bold]'"))
    table = runner.invoke(app, ["failed", "list", "--db", url])
    assert table.exit_code == 0 and KEY in table.output and "[bold]too large[/bold]" in table.output
    (row,) = json.loads(runner.invoke(app, ["failed", "list", "--db", url, "--json"]).output)
    assert (row["message_id"], row["key"], row["last_error"]) == (
        str(message_id), KEY, "[bold]too large[/bold]")


def test_failed_list_says_when_it_shows_only_the_first_thousand(tmp_path):
    """It read at most 1000 rows and said nothing: 1000 looked like all of them."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert runner.invoke(app, ["init-db", "--db", url]).exit_code == 0
    engine = create_engine(url)
    outbox = Outbox(engine)
    with Session(engine) as session, session.begin():
        for n in range(1001):
            outbox.publish(session, "orders", {"n": n}, key=str(n))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_messages SET status = 'failed', attempts = 1, last_error = 'x'"))
    listed = runner.invoke(app, ["failed", "list", "--db", url, "--json"])
    assert len(json.loads(listed.stdout)) == 1000
    assert listed.stderr == "more than 1000 failed rows; the first 1000 are shown (narrow with --topic)\n"


def test_stats_has_json(tmp_path):
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert runner.invoke(app, ["init-db", "--db", url]).exit_code == 0
    engine = create_engine(url)
    with Session(engine) as session, session.begin():
        Outbox(engine).publish(session, "orders", {"n": 1}, key="k")
    (row,) = json.loads(runner.invoke(app, ["stats", "--db", url, "--json"]).stdout)
    assert (row["topic"], row["pending"], row["failed"]) == ("orders", 1, 0) and row["oldest_pending"]
