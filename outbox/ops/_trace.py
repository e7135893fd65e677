"""``trace``: where a message is, by id or by topic and key, across an outbox and its inbox databases.

The document ``outbox trace --json`` prints and the console's trace page shows
(its shape is documented in docs/operations.md, "Where is message X?", and
versioned by ``"version"``). Read-only, and every query is a point or range
lookup on an index the tables already have, so a trace costs the same on a
table of a hundred rows or a hundred million:

- outbox row by id: ``outbox_messages.message_id`` (unique);
- a key's position: ``outbox_keys`` primary key (topic, key); its unsent,
  failed and skipped rows: ``ix_outbox_open_key`` (topic, key, seq, partial on
  ``status != 'published'``, the term every such query repeats);
- consumer groups: the leading ``consumer_group`` column of each inbox
  table's primary key or index, read as a loose index scan (one seek per group);
- per group: ``inbox_messages`` and ``inbox_held`` primary keys (group, id),
  ``ux_inbox_parked_message`` (group, id), ``inbox_keys`` primary key, and
  ``ix_inbox_parked_key`` / ``ux_inbox_held_seq`` (group, topic, key, seq).

What no index answers is not asked: a key's *published* outbox rows and its
applied inbox rows have no (topic, key) index (one would cost every publish and
every applied message a write), so a key trace shows the key's position and the
messages still waiting anywhere; trace a sent message by its id.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, inspect, select
from sqlalchemy.exc import SQLAlchemyError

from transports._errors import InvalidTopicError, validate_topic

from ..core._errors import ConfigurationError, MessageValidationError
from ..core._identity import tables_identity
from ..core._secrets import database_secrets, scrub
from ..core._tables import InboxOutcome, OutboxTables
from ..core._tables import OutboxStatus as Status
from ..core._validation import checked_event_type, checked_key, shown
from ..inbox import Reason

VERSION = 1
DEFAULT_LIMIT = 20
MAX_LIMIT = 500


class State(enum.StrEnum):
    """A message's state in one consumer group (the ``state`` of a group entry).

    A ``StrEnum``: a member is its value, so the JSON document and the templates
    read the same strings as before.
    """

    APPLIED = "applied"
    DISCARDED = "discarded"
    PARKED = "parked"
    HELD = "held"
    NOT_SEEN = "not_seen"


@dataclass(frozen=True)
class Database:
    """One database a trace reads: its printable name (no password), engine and tables."""

    name: str
    engine: Engine
    tables: OutboxTables


# -- input ------------------------------------------------------------------------------


def parse_message_id(text: str) -> uuid.UUID:
    """``text`` as a message id, or ``ConfigurationError`` naming what is wrong."""
    try:
        return uuid.UUID(text.strip())
    except (ValueError, AttributeError, TypeError):
        raise ConfigurationError(f"message id {shown(text)} is not a UUID "
                                 "(e.g. 0b9c6a52-5d0e-4b59-9c4e-0f4f1f0c2a11)") from None


def checked_topic_key(topic: str, key: str) -> tuple[str, str]:
    """(topic, key) as ``publish()`` would accept them, or ``ConfigurationError``."""
    try:
        topic = validate_topic(topic)
        text, _ = checked_key(key)
    except (InvalidTopicError, MessageValidationError) as exc:
        raise ConfigurationError(str(exc)) from None
    assert text is not None
    return topic, text


def _limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    return limit


# -- what each database holds ------------------------------------------------------------


@dataclass
class _Open:
    db: Database
    conn: Connection
    has_outbox: bool
    has_inbox: bool
    groups: list[str]
    error: str | None = None
    """Why a query on this database failed mid-trace (an older schema, a lost connection); it is
    then left out of the rest of the trace and listed in ``unreachable``."""

    def failed(self, exc: SQLAlchemyError) -> None:
        self.error = _unreadable(self.db, exc)


def _same_tables(a: Database, b: Database) -> bool:
    """One set of tables: one prefix, in one schema of one database, as its server says (both answered):
    ``out_`` and ``OUT_`` are one prefix on SQLite."""
    return (tables_identity(a.engine, a.tables.schema, a.tables.prefix)
            == tables_identity(b.engine, b.tables.schema, b.tables.prefix))


def _open(db: Database, conn: Connection, only: Sequence[str] | None, outbox_side: bool) -> _Open:
    t = db.tables
    found = inspect(conn)
    has_outbox = outbox_side and all(found.has_table(x.name, schema=t.schema) for x in (t.messages, t.keys))
    has_inbox = all(found.has_table(x.name, schema=t.schema) for x in t.inbox_tables)
    groups = _groups(conn, t) if has_inbox else []
    if only:
        groups = [g for g in groups if g in only]
    return _Open(db, conn, has_outbox, has_inbox, groups)


def _groups(conn: Connection, t: OutboxTables) -> list[str]:
    """Every consumer group with a row in an inbox table: one index seek per group and table."""
    found: set[str] = set()
    for table in (t.inbox_keys, t.inbox_messages, t.inbox_parked, t.inbox_held):
        column = table.c.consumer_group
        last = conn.scalar(select(func.min(column)))
        while last is not None:
            found.add(last)
            last = conn.scalar(select(func.min(column)).where(column > last))
    return sorted(found)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


# -- one message ---------------------------------------------------------------------------


def _outbox_row(conn: Connection, t: OutboxTables, message_id: uuid.UUID) -> dict[str, Any] | None:
    m = t.messages.c
    row = conn.execute(select(m.topic, m.key, m.seq, m.shard, m.status, m.created_at, m.available_at,
                              m.attempts, m.last_error, m.published_at, m.kafka_partition,
                              m.kafka_offset, m.event_type).where(m.message_id == message_id)).first()
    if row is None:
        return None
    return {"topic": row.topic, "key": row.key, "seq": row.seq, "event_type": row.event_type,
            "shard": row.shard, "status": row.status,
            "created_at": _iso(row.created_at), "available_at": _iso(row.available_at),
            "attempts": row.attempts, "last_error": row.last_error, "published_at": _iso(row.published_at),
            "partition": row.kafka_partition, "offset": row.kafka_offset}


def _key_row(conn: Connection, t: OutboxTables, group: str, topic: str, key: str) -> Any:
    k = t.inbox_keys.c
    return conn.execute(select(k.last_seq, k.parked, k.parked_reason, k.parked_at, k.started_at_seq)
                        .where(k.consumer_group == group, k.topic == topic, k.key == key)).first()


def _first_parked_seq(conn: Connection, t: OutboxTables, group: str, topic: str, key: str) -> int | None:
    p = t.inbox_parked.c
    return conn.scalar(select(p.seq).where(p.consumer_group == group, p.topic == topic, p.key == key,
                                           p.seq.is_not(None)).order_by(p.seq).limit(1))


def _in_group(conn: Connection, t: OutboxTables, group: str, message_id: uuid.UUID) -> dict[str, Any]:
    """The message's state in ``group``, with what identifies it (topic, key, seq) when seen."""
    i = t.inbox_messages.c
    row: Any = conn.execute(select(i.topic, i.key, i.seq, i.kafka_partition, i.kafka_offset, i.received_at,
                              i.processed_at, i.deliveries, i.outcome, i.note)
                       .where(i.consumer_group == group, i.message_id == message_id)).first()
    if row is not None:
        return {"state": State.DISCARDED if row.outcome == InboxOutcome.DISCARDED else State.APPLIED,
                "topic": row.topic, "key": row.key, "seq": row.seq, "partition": row.kafka_partition,
                "offset": row.kafka_offset, "received_at": _iso(row.received_at),
                "processed_at": _iso(row.processed_at), "deliveries": row.deliveries, "note": row.note}
    p = t.inbox_parked.c
    row = conn.execute(select(p.topic, p.key, p.seq, p.kafka_partition, p.kafka_offset, p.reason, p.error,
                              p.attempts, p.first_failure_at, p.last_failure_at, p.event_type)
                       .where(p.consumer_group == group, p.message_id == message_id)).first()
    if row is not None:
        behind = None
        if row.key is not None and row.reason == Reason.KEY_PARKED:
            behind = _first_parked_seq(conn, t, group, row.topic, row.key)
        return {"state": State.PARKED, "topic": row.topic, "key": row.key, "seq": row.seq,
                "event_type": row.event_type,
                "partition": row.kafka_partition, "offset": row.kafka_offset, "reason": row.reason,
                "error": row.error, "attempts": row.attempts, "parked_behind_seq": behind,
                "first_failure_at": _iso(row.first_failure_at), "last_failure_at": _iso(row.last_failure_at)}
    h = t.inbox_held.c
    row = conn.execute(select(h.topic, h.key, h.seq, h.kafka_partition, h.kafka_offset, h.received_at,
                              h.event_type)
                       .where(h.consumer_group == group, h.message_id == message_id)).first()
    if row is not None:
        position = None if row.key is None else _key_row(conn, t, group, row.topic, row.key)
        last = position.last_seq if position is not None else 0
        return {"state": State.HELD, "topic": row.topic, "key": row.key, "seq": row.seq,
                "event_type": row.event_type,
                "partition": row.kafka_partition, "offset": row.kafka_offset,
                "received_at": _iso(row.received_at), "waiting_for_seq": last + 1}
    return {"state": State.NOT_SEEN}


def _message(opened: Sequence[_Open], message_id: uuid.UUID) -> dict[str, Any]:
    outbox: dict[str, Any] | None = None
    outbox_db: str | None = None
    groups: list[dict[str, Any]] = []
    for o in opened:
        if o.error:
            continue
        try:
            row = _outbox_row(o.conn, o.db.tables, message_id) if o.has_outbox and outbox is None else None
            found = [{"database": o.db.name, "group": group,
                      **_in_group(o.conn, o.db.tables, group, message_id)} for group in o.groups]
        except SQLAlchemyError as exc:
            o.failed(exc)
            continue
        if row is not None:
            outbox, outbox_db = row, o.db.name
        groups += found
    known = outbox or next((g for g in groups if g["state"] != State.NOT_SEEN), None)
    topic, key, seq = (known["topic"], known["key"], known["seq"]) if known else (None, None, None)
    # Applied inbox rows keep no event type: the outbox row's, else a parked or held copy's.
    event_type = next((x["event_type"] for x in (outbox, *groups) if x and x.get("event_type")), None)
    for g in groups:
        for name in ("topic", "key", "seq", "event_type"):
            g.pop(name, None)
        if g["state"] == State.NOT_SEEN and key is not None and topic is not None:
            o = next(x for x in opened if x.db.name == g["database"])
            try:
                position = None if o.error else _key_row(o.conn, o.db.tables, g["group"], topic, key)
            except SQLAlchemyError as exc:
                o.failed(exc)
                position = None
            # Past the seq: the group applied it and retention removed its record, or a
            # start policy skipped it; either way it will not arrive as new.
            g["key_last_seq"] = None if position is None else position.last_seq
    return {"message_id": str(message_id), "found": known is not None, "topic": topic, "key": key,
            "seq": seq, "event_type": event_type, "outbox_database": outbox_db, "outbox": outbox,
            "groups": groups}


# -- one key ---------------------------------------------------------------------------------


def _outbox_key(conn: Connection, t: OutboxTables, topic: str, key: str,
                limit: int) -> tuple[dict[str, Any] | None, list[tuple[int | None, uuid.UUID]]]:
    keys, m = t.keys.c, t.messages.c
    last_seq = conn.scalar(select(keys.last_seq).where(keys.topic == topic, keys.key == key))
    if last_seq is None:
        return None, []
    # ``status != 'published'`` repeats ix_outbox_open_key's predicate: the unsent, failed
    # and skipped rows of the key, in seq order, without touching its published ones.
    rows = conn.execute(select(m.seq, m.status, m.message_id)
                        .where(m.topic == topic, m.key == key, m.status != Status.PUBLISHED)
                        .order_by(m.seq).limit(limit + 1)).all()
    first_unsent = next((r.seq for r in rows if r.status in (Status.PENDING, Status.FAILED)), None)
    if first_unsent is None and len(rows) > limit:
        first_unsent = conn.scalar(select(func.min(m.seq)).where(
            m.topic == topic, m.key == key, m.status != Status.PUBLISHED, m.status != Status.SKIPPED))
    last_sent = last_seq if first_unsent is None else first_unsent - 1
    skipped = {r.seq for r in rows if r.status == Status.SKIPPED}
    while last_sent in skipped:
        last_sent -= 1
    part = {"last_seq": last_seq, "last_sent_seq": last_sent if last_sent > 0 else None,
            "first_unsent_seq": first_unsent,
            "pending": sum(r.status == Status.PENDING for r in rows[:limit]),
            "failed": sum(r.status == Status.FAILED for r in rows[:limit]),
            "skipped": sum(r.status == Status.SKIPPED for r in rows[:limit]), "more": len(rows) > limit}
    return part, [(r.seq, r.message_id) for r in rows[:limit]]


def _inbox_key(conn: Connection, t: OutboxTables, group: str, topic: str, key: str,
               limit: int) -> tuple[dict[str, Any] | None, list[tuple[int | None, uuid.UUID]]]:
    position = _key_row(conn, t, group, topic, key)
    p, h = t.inbox_parked.c, t.inbox_held.c
    parked = conn.execute(select(p.seq, p.message_id).where(
        p.consumer_group == group, p.topic == topic, p.key == key).order_by(p.seq).limit(limit + 1)).all()
    parked_count = len(parked) if len(parked) <= limit else conn.scalar(select(func.count()).where(
        p.consumer_group == group, p.topic == topic, p.key == key))
    held = conn.execute(select(h.seq, h.message_id).where(
        h.consumer_group == group, h.topic == topic, h.key == key).order_by(h.seq).limit(limit + 1)).all()
    if position is None and not parked and not held:
        return None, []
    last = position.last_seq if position is not None else 0
    part = {"last_applied_seq": last or None, "parked": bool(position is not None and position.parked),
            "parked_reason": position.parked_reason if position is not None else None,
            "parked_at": _iso(position.parked_at) if position is not None else None,
            "started_at_seq": position.started_at_seq if position is not None else None,
            "parked_messages": parked_count, "parked_seqs": [r.seq for r in parked[:limit]],
            "held_seqs": [r.seq for r in held[:limit]], "held_more": len(held) > limit,
            "waiting_for_seq": last + 1 if held else None}
    return part, [(r.seq, r.message_id) for r in [*parked[:limit], *held[:limit]]]


# -- the documents ----------------------------------------------------------------------------


def trace_message(outbox_db: Database | None, inbox_dbs: Iterable[Database], message_id: uuid.UUID | str,
                  *, groups: Sequence[str] | None = None) -> dict[str, Any]:
    """The journey of one message: its outbox row and its state in every consumer group found.

    ``outbox_db`` holds the outbox tables (and maybe inbox tables too); each of
    ``inbox_dbs`` holds inbox tables of one or several groups. ``groups``
    limits the groups shown. Raises ``ConfigurationError`` for an id that is no
    UUID or that no database knows.
    """
    mid = message_id if isinstance(message_id, uuid.UUID) else parse_message_id(message_id)
    databases = _opened(outbox_db, inbox_dbs, groups)
    with databases as opened:
        message = _message(opened, mid)
    down = databases.unreachable + _failed(opened)
    if not message["found"]:
        raise ConfigurationError(f"message {mid} is in none of the databases ("
                                 + _where(opened) + _down(down) + ")")
    return {"version": VERSION, "query": {"message_id": str(mid)}, "messages": [message], "key": None,
            "unreachable": down}


def trace_key(outbox_db: Database | None, inbox_dbs: Iterable[Database], topic: str, key: str, *,
              groups: Sequence[str] | None = None, limit: int = DEFAULT_LIMIT,
              event_type: str | None = None) -> dict[str, Any]:
    """Where a key stands (last seq written, sent, applied per group) and its waiting messages.

    Lists at most ``limit`` of the key's messages waiting in the outbox (unsent,
    failed, skipped) and in each group (parked, held), each traced like
    ``trace_message``. ``event_type`` keeps, of those messages, the ones of that
    event type (the key's positions are the key's, whatever the type). Raises
    ``ConfigurationError`` for a topic or key that ``publish()`` would refuse, an
    event type it would refuse, a topic no database knows, or a key none knows.
    """
    topic, key = checked_topic_key(topic, key)
    if event_type is not None:
        try:
            event_type = checked_event_type(event_type)[0]
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    limit = _limit(limit)
    databases = _opened(outbox_db, inbox_dbs, groups)
    with databases as opened:
        outbox_part: dict[str, Any] | None = None
        ids: list[tuple[int | None, uuid.UUID]] = []
        group_parts: list[dict[str, Any]] = []
        for o in opened:
            try:
                here, here_ids = (_outbox_key(o.conn, o.db.tables, topic, key, limit)
                                  if o.has_outbox and outbox_part is None else (None, []))
                here_groups = []
                for group in o.groups:
                    part, found = _inbox_key(o.conn, o.db.tables, group, topic, key, limit)
                    here_groups.append({"database": o.db.name, "group": group, "seen": part is not None,
                                        **(part or {})})
                    here_ids += found
            except SQLAlchemyError as exc:
                o.failed(exc)
                continue
            if here is not None:
                outbox_part = {**here, "database": o.db.name}
            group_parts += here_groups
            ids += here_ids
        if outbox_part is None and not any(g["seen"] for g in group_parts):
            known = any([_knows_topic(o, topic) for o in opened])  # every database asked: all failures named
            where = _where(opened) + _down(databases.unreachable + _failed(opened))
            if not known:
                raise ConfigurationError(f"topic {shown(topic)} is in none of the databases ({where})")
            raise ConfigurationError(f"key {shown(key)} of topic {topic!r} is in none of the databases "
                                     f"({where})")
        # The key's waiting messages by seq, traced up to ``limit`` and the rest only counted
        # (each trace is a few lookups per database: 500 per group would be thousands of
        # queries); with an event type, each is traced to learn its type, then cut.
        unique = sorted(dict(reversed([(mid, seq) for seq, mid in ids])).items(),
                        key=lambda x: (x[1] is None, x[1] or 0))
        wanted = unique if event_type is not None else unique[:limit]
        messages = [_message(opened, mid) for mid, _ in wanted]
    if event_type is not None:
        messages = [m for m in messages if m["event_type"] == event_type]
    more = len(messages) > limit if event_type is not None else len(unique) > limit
    query: dict[str, Any] = {"topic": topic, "key": key, "limit": limit}
    if event_type is not None:
        query["event_type"] = event_type
    return {"version": VERSION, "query": query,
            "key": {"topic": topic, "key": key, "outbox": outbox_part, "groups": group_parts},
            "messages": messages[:limit], "more": more,
            "unreachable": databases.unreachable + _failed(opened)}


def _knows_topic(o: _Open, topic: str) -> bool:
    if o.error:
        return False
    try:
        return _topic_here(o, topic)
    except SQLAlchemyError as exc:
        o.failed(exc)
        return False


def _topic_here(o: _Open, topic: str) -> bool:
    t = o.db.tables
    keys, k = t.keys.c, t.inbox_keys.c
    if o.has_outbox and o.conn.scalar(select(keys.key).where(keys.topic == topic).limit(1)) is not None:
        return True
    return any(o.conn.scalar(select(k.key).where(k.consumer_group == g, k.topic == topic).limit(1))
               is not None for g in o.groups)


def _unreadable(db: Database, exc: SQLAlchemyError) -> str:
    """The driver's first line, without the database's credentials."""
    first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]
    return scrub(first[:300], database_secrets(db.engine.url.render_as_string(hide_password=False)))


def _failed(opened: Sequence[_Open]) -> list[dict[str, str]]:
    return [{"database": o.db.name, "error": o.error} for o in opened if o.error]


def _down(unreachable: list[dict[str, str]]) -> str:
    return "".join(f"; {u['database']}: could not be read ({u['error']})" for u in unreachable)


def _where(opened: Sequence[_Open]) -> str:
    parts = []
    for o in opened:
        if o.error:
            continue  # named by ``_down``
        held = (["outbox"] if o.has_outbox else []) + [f"group {g!r}" for g in o.groups]
        parts.append(f"{o.db.name}: {', '.join(held) or 'no outbox or inbox tables'}")
    return "; ".join(parts) or "no database given"


class _opened:
    """Connections to every database for one trace, closed together; tables and groups looked up once."""

    def __init__(self, outbox_db: Database | None, inbox_dbs: Iterable[Database],
                 groups: Sequence[str] | None) -> None:
        # One set of tables named twice (as outbox and as inbox database, in any spelling) is read
        # once: the same pool here, and what the servers say once they answered (``__enter__``).
        # Not the URL: two engines spelled alike to the letter may be two (two in-memory SQLite
        # databases; ``connect_args`` setting two search paths, so two schemas).
        plan = ([(outbox_db, True)] if outbox_db else []) + [(db, False) for db in inbox_dbs]
        pooled = {(db.engine.pool, db.tables.schema, db.tables.prefix): (db, outbox_side)
                  for db, outbox_side in reversed(plan)}
        self.plan = list(pooled.values())[::-1]
        if not self.plan:
            raise ConfigurationError("give an outbox database, an inbox database, or both")
        self.groups = list(groups) if groups else None
        self.conns: list[Connection] = []
        self.unreachable: list[dict[str, str]] = []
        """``{"database", "error"}`` for each database that could not be read (the rest are traced)."""

    def __enter__(self) -> list[_Open]:
        opened: list[_Open] = []
        first_error: SQLAlchemyError | None = None
        try:
            for db, outbox_side in self.plan:
                try:
                    conn = db.engine.connect()
                    self.conns.append(conn)
                    if any(_same_tables(db, earlier.db) for earlier in opened):
                        continue  # another spelling of a database read already
                    opened.append(_open(db, conn, self.groups, outbox_side))
                except SQLAlchemyError as exc:
                    # One database down must not hide what the others know: one line for it.
                    first_error = first_error or exc
                    self.unreachable.append({"database": db.name, "error": _unreadable(db, exc)})
        except BaseException:
            self.__exit__()
            raise
        if not opened and first_error is not None:
            self.__exit__()
            raise first_error
        if not any(o.has_outbox or o.has_inbox for o in opened):
            self.__exit__()
            names = ", ".join(db.name for db, _ in self.plan)
            raise ConfigurationError(f"no outbox or inbox tables in {names} (check --prefix/--schema)")
        return opened

    def __exit__(self, *exc: object) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()
