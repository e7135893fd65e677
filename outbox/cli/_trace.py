"""``outbox trace``: where is message X? By id, or by topic and key, across the outbox and inbox databases.

Read-only, indexed lookups only (``ops._trace`` says which). A table for
people, ``--json`` for scripts (the document is ``ops.trace_message``'s or
``ops.trace_key``'s, documented in docs/operations.md).
"""

from __future__ import annotations

import json
import unicodedata
from datetime import datetime
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy import Engine

from ..core._age import ago
from ..core._envelope import utcnow
from ..core._errors import ConfigurationError
from ..core._secrets import database_secrets, scrub
from ..core._tables import OutboxTables
from ..inbox import Reason
from ..ops import Database, trace_key, trace_message
from ..ops._trace import DEFAULT_LIMIT, MAX_LIMIT, State
from . import app
from ._db import open_engine
from ._errors import naming
from ._options import PREFIX, SCHEMA


@app.command("trace")
def trace(
    message_id: str | None = typer.Argument(None, help="The message id (a UUID) to trace; "
                                                       "or give --topic and --key instead."),
    db: str | None = typer.Option(None, "--db", help="SQLAlchemy URL of the outbox database "
                                  "(it may hold inbox tables too), e.g. postgresql+psycopg://… "
                                  "or sqlite:///app.db"),
    inbox_db: list[str] = typer.Option([], "--inbox-db", help="SQLAlchemy URL of a consumer's inbox "
                                       "database (every group in it is shown). Repeat for several."),
    topic: str | None = typer.Option(None, "--topic", help="Trace a key: its topic (with --key)."),
    key: str | None = typer.Option(None, "--key", help="Trace a key: the key, e.g. an order number "
                                   "(with --topic)."),
    group: list[str] = typer.Option([], "--group", help="Only this consumer group. Repeat for several."),
    event_type: str | None = typer.Option(None, "--event-type", help="Of a key's waiting messages, show "
                                          "only those of this event type (with --topic and --key)."),
    limit: int = typer.Option(DEFAULT_LIMIT, "--limit", min=1, max=MAX_LIMIT,
                              help="At most this many of a key's waiting messages."),
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (see docs/operations.md)."),
) -> None:
    """Show where a message is: written, sent (partition/offset), and per consumer group
    applied, discarded, parked, held or never seen. With --topic and --key: where the key
    stands and what waits behind what."""
    by_key = topic is not None or key is not None
    if message_id is not None and by_key:
        raise typer.BadParameter("give a message id, or --topic and --key, not both")
    if message_id is None and not by_key:
        raise typer.BadParameter("give a message id, or --topic and --key")
    if by_key and (topic is None or key is None):
        raise typer.BadParameter("a key trace needs both --topic and --key")
    if event_type is not None and not by_key:
        raise typer.BadParameter("--event-type filters a key trace: give --topic and --key")
    if db is None and not inbox_db:
        raise typer.BadParameter("give --db (the outbox database), --inbox-db, or both")
    secrets = [s for url in [*([db] if db else []), *inbox_db] for s in database_secrets(url)]
    try:
        tables = OutboxTables(prefix=prefix, schema=schema)
        engines: dict[str, Engine] = {}  # a URL given twice is one engine: read once, even when down
        outbox_db = _database(db, tables, engines) if db else None
        inbox_dbs = [_database(url, tables, engines) for url in inbox_db]
        if message_id is not None:
            doc = trace_message(outbox_db, inbox_dbs, message_id, groups=group)
        else:
            assert topic is not None and key is not None
            doc = trace_key(outbox_db, inbox_dbs, topic, key, groups=group, limit=limit,
                            event_type=event_type)
    except ConfigurationError:
        raise
    except Exception as exc:
        # Several databases: a driver's message may repeat any one's credentials.
        text = str(exc)
        if scrub(text, secrets) != text:
            raise RuntimeError(scrub(text, secrets)) from None
        raise
    if as_json:
        typer.echo(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        print_trace(doc)


def _database(url: str, tables: OutboxTables, engines: dict[str, Engine]) -> Database:
    name = naming(url)
    if url not in engines:
        engines[url] = open_engine(url)
    return Database(name=name, engine=engines[url], tables=tables)


def _when(value: str | None, now: datetime) -> str:
    """``2026-11-25 13:02:11 UTC (3 min ago)``: the absolute time with its zone, and how long ago."""
    if value is None:
        return ""
    at = datetime.fromisoformat(value)
    return f"{at:%Y-%m-%d %H:%M:%S} UTC ({ago((now - at).total_seconds())})"


def describe_group(g: dict[str, Any], now: datetime) -> str:
    """One consumer group's state of a message, as a sentence."""
    state = g["state"]
    where = "" if g.get("partition") is None else f" from partition {g['partition']} offset {g['offset']}"
    if state == State.APPLIED:
        return f"applied {_when(g['processed_at'], now)}{where}, {g['deliveries']} delivery(ies)"
    if state == State.DISCARDED:
        return f"discarded {_when(g['processed_at'], now)}{where}: {g['note'] or ''}"
    if state == State.PARKED:
        if g["reason"] == Reason.KEY_PARKED and not g["attempts"]:
            cause = (f"parked behind seq {g['parked_behind_seq']} of its key" if g["parked_behind_seq"]
                     else "parked behind its key")
            return f"{cause} (never ran), since {_when(g['first_failure_at'], now)}"
        error = (g["error"] or "").strip().splitlines()
        return (f"parked ({g['reason']}) after {g['attempts']} attempt(s), last "
                f"{_when(g['last_failure_at'], now)}" + (f": {error[-1][:120]}" if error else ""))
    if state == State.HELD:
        return f"held since {_when(g['received_at'], now)}, waiting for seq {g['waiting_for_seq']}{where}"
    past = g.get("key_last_seq")
    return "never seen" + (f" (the group's key is at seq {past})" if past else "")


def describe_outbox(o: dict[str, Any] | None, now: datetime) -> str:
    if o is None:
        return "not in the outbox database (written elsewhere, or removed by retention)"
    status = o["status"]
    written = f"written {_when(o['created_at'], now)}"
    if status == "published":
        where = "" if o["partition"] is None else f" to partition {o['partition']} offset {o['offset']}"
        # The relay counts the send that succeeded too: 1 is "sent at the first try".
        retried = f" at attempt {o['attempts']}" if o["attempts"] else ""
        return f"{written}; sent {_when(o['published_at'], now)}{where}{retried}"
    error = f"; last error: {(o['last_error'] or '').strip()[:200]}" if o["last_error"] else ""
    if status == "pending":
        due = f", due {_when(o['available_at'], now)}" if o["available_at"] != o["created_at"] else ""
        return f"{written}; not sent yet{due}, {o['attempts']} failed attempt(s){error}"
    return f"{written}; {status} after {o['attempts']} attempt(s){error}"


def print_trace(doc: dict[str, Any]) -> None:
    console = Console(width=160, highlight=False)
    now = utcnow()
    for u in doc.get("unreachable") or []:
        console.print(cell(f"{u['database']}: could not be read ({u['error']}); the other databases "
                           "are shown"))
    key = doc["key"]
    if key is not None:
        console.print(f"key {cell(repr(key['key']))} of topic {cell(key['topic'])}")
        table = Table("where", "position", title_justify="left", box=None, pad_edge=False)
        o = key["outbox"]
        if o is not None:
            table.add_row("outbox", cell(
                f"last seq written {o['last_seq']}, last sent {o['last_sent_seq'] or '-'}"
                + (f", first unsent {o['first_unsent_seq']}" if o["first_unsent_seq"] else "")
                + f"; {o['pending']} pending, {o['failed']} failed, {o['skipped']} skipped"
                + (" (more)" if o["more"] else "")))
        for g in key["groups"]:
            label = cell(_group_label(g, key["groups"]))
            if not g["seen"]:
                table.add_row(label, "never seen")
                continue
            text = f"last applied {g['last_applied_seq'] or '-'}"
            if g["parked"]:
                text += f"; PARKED {_when(g['parked_at'], now)}: {(g['parked_reason'] or '')[:160]}"
            if g["parked_messages"]:
                text += f"; {g['parked_messages']} parked message(s): seqs {_seqs(g['parked_seqs'])}"
            if g["held_seqs"]:
                text += (f"; held seqs {_seqs(g['held_seqs'])}{' …' if g['held_more'] else ''} "
                         f"waiting for seq {g['waiting_for_seq']}")
            table.add_row(label, cell(text))
        console.print(table)
        if not doc["messages"]:
            of_type = doc["query"].get("event_type")
            console.print(f"no message of this key{escape(f' and event type {of_type}' if of_type else '')} "
                          "waits anywhere; trace a sent one by its id")
    for m in doc["messages"]:
        console.print()
        of_type = f"  type {m['event_type']}" if m.get("event_type") else ""
        console.print(cell(f"message {m['message_id']}  topic {m['topic']}  key {m['key']!r}  "
                           f"seq {m['seq']}{of_type}"))
        table = Table("where", "state", box=None, pad_edge=False)
        table.add_row("outbox", cell(describe_outbox(m["outbox"], now)))
        for g in m["groups"]:
            table.add_row(cell(_group_label(g, m["groups"])), cell(describe_group(g, now)))
        console.print(table)
    if doc.get("more"):
        console.print(f"(more messages wait; showing {len(doc['messages'])}: raise --limit)")


def cell(text: str) -> str:
    """``text`` for a terminal: rich markup escaped, and every character that could move the
    cursor, recolour or reorder what follows (controls, ANSI escapes, bidi marks, line and
    paragraph separators, lone surrogates) shown as its escape (``\\x1b``, ``\\u202e``), so a
    key, group or error from the databases cannot forge or hide a line."""
    return escape("".join(_visible(c) for c in text))


def _visible(c: str) -> str:
    if unicodedata.category(c) not in _HIDDEN:
        return c
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


_HIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _group_label(g: dict[str, Any], groups: list[dict[str, Any]]) -> str:
    """``group billing``, with its database named when the groups come from several."""
    several = len({x["database"] for x in groups}) > 1
    return f"group {g['group']}" + (f" in {g['database']}" if several else "")


def _seqs(seqs: list[int | None]) -> str:
    return ", ".join(str(s) for s in seqs)
