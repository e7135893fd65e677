"""The pages: each reads one page of data through the owning module's query and renders it.

Every list is keyset-paged (``after`` names the last row of the page before),
so a page costs the same however large the table behind it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import text
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..core._envelope import utcnow
from ..inbox.admin import held_lanes, parked_lanes, parked_page, parked_unkeyed
from ..ops import gather
from ..relay import failed_rows
from ._context import Context, group_of, page_size
from ._groups import database_index, inbox_groups
from ._reads import Unreadable
from ._refused import Refused

Handler = Callable[[Request], Awaitable[Response]]


def _lane_after(request: Request) -> tuple[str, str] | None:
    raw = request.query_params.get("after")
    if not raw:
        return None
    try:
        topic, key = json.loads(raw)
    except (ValueError, TypeError, RecursionError):  # RecursionError: lists nested ~1000 deep
        raise Refused(400, "after must be a [topic, key] pair, as the next-page link gives it") from None
    return str(topic), str(key)


def _int_after(request: Request) -> int | None:
    raw = request.query_params.get("after")
    try:
        return None if not raw else int(raw)
    except ValueError:
        raise Refused(400, "after must be a row id, as the next-page link gives it") from None


def _topics(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The backlog per topic (``outbox status`` lists it per topic and shard)."""
    topics: dict[str, dict[str, Any]] = {}
    for r in (doc["outbox"] or {"backlog": []})["backlog"]:
        t = topics.setdefault(r["topic"], {"topic": r["topic"], "pending": 0, "failed": 0,
                                           "oldest": None, "shards": 0})
        t["pending"] += r["pending"]
        t["failed"] += r["failed"]
        t["shards"] += 1
        age = r["oldest_pending_age_s"]
        if age is not None and (t["oldest"] is None or age > t["oldest"]):
            t["oldest"] = age
    return list(topics.values())


def overview(ctx: Context) -> Handler:
    async def page(request: Request) -> Response:
        who = ctx.viewer(request)
        # Every database at once, each within its deadline: one that cannot be read is one line.
        main, *others = await asyncio.gather(
            ctx.read(0, lambda: gather(ctx.outbox, stuck_after=ctx.stuck_after)),
            *(ctx.read(index, partial(inbox_groups, index, db, ctx.stuck_after))
              for index, db in enumerate(ctx.databases[1:], start=1)),
            return_exceptions=True)
        readings = [main, *others]
        for reading in readings:
            if isinstance(reading, BaseException) and not isinstance(reading, Unreadable):
                raise reading
        unread = [str(r) for r in readings if isinstance(r, Unreadable)]
        if len(unread) == len(readings):
            raise readings[0]  # nothing to show: the page of its own (503)
        groups: list[dict[str, Any]] = []
        stuck: list[str] = []
        for found in others:
            if not isinstance(found, BaseException):
                groups += found[0]
                stuck += found[1]
        doc = main if isinstance(main, dict) else _nothing_read(ctx)
        own = (doc["inbox"] or {"groups": []})["groups"]
        groups = [{**g, "db": 0, "database": ctx.databases[0].name} for g in own] + groups
        relays = ctx.heartbeats.judge(doc["outbox"]["relays"] if doc["outbox"] else [],
                                      datetime.fromisoformat(doc["checked_at"]))
        return ctx.render(request, "overview.html", who=who, doc=doc, topics=_topics(doc), relays=relays,
                          groups=groups, stuck=doc["stuck"] + stuck, unreadable=unread,
                          main_read=isinstance(main, dict), several=len(ctx.databases) > 1,
                          replayable=[f"{g} ({ctx.databases[i].name})" if len(ctx.databases) > 1 else g
                                      for i, g in sorted(ctx.inboxes)])
    return page


def _nothing_read(ctx: Context) -> dict[str, Any]:
    """The overview's document for an outbox database that could not be read."""
    return {"outbox": None, "inbox": None, "stuck": [], "checked_at": utcnow().isoformat(),
            "stuck_after_s": ctx.stuck_after}


def failed(ctx: Context) -> Handler:
    async def page(request: Request) -> Response:
        who = ctx.viewer(request)
        limit = page_size(request)
        topic = request.query_params.get("topic") or None
        after = _int_after(request)
        rows = await ctx.read(0, lambda: failed_rows(ctx.outbox, topic=topic, limit=limit + 1, after=after))
        rows, more = _split(rows, limit)
        return ctx.render(request, "failed.html", who=who, rows=rows, topic=topic, limit=limit,
                          next_after=rows[-1].id if more else None)
    return page


def parked(ctx: Context) -> Handler:
    async def page(request: Request) -> Response:
        who = ctx.viewer(request)
        group = group_of(request.query_params)
        index = database_index(request.query_params, ctx.databases)
        limit, after = page_size(request), _lane_after(request)

        def read() -> tuple[list[Any], list[Any]]:
            with ctx.databases[index].engine.connect() as conn:
                lanes = parked_lanes(conn, ctx.outbox.tables, group, after=after, limit=limit + 1)
                unkeyed = parked_unkeyed(conn, ctx.outbox.tables, group) if after is None else []
            return lanes, unkeyed

        lanes, unkeyed = await ctx.read(index, read)
        lanes, more = _split(lanes, limit)
        return ctx.render(request, "parked.html", who=who, group=group, lanes=lanes, unkeyed=unkeyed,
                          limit=limit, can_replay=(index, group) in ctx.inboxes, json=json.dumps,
                          **_where(ctx, index),
                          next_after=json.dumps([lanes[-1].topic, lanes[-1].key]) if more else None)
    return page


def parked_key(ctx: Context) -> Handler:
    async def page(request: Request) -> Response:
        who = ctx.viewer(request)
        group = group_of(request.query_params)
        topic = request.query_params.get("topic")
        if not topic:
            raise Refused(400, "name the topic (?topic=...&key=...)")
        key = request.query_params.get("key")  # absent: the topic's unkeyed messages
        index = database_index(request.query_params, ctx.databases)
        limit, after = page_size(request), _int_after(request)

        def read() -> list[Any]:
            with ctx.databases[index].engine.connect() as conn:
                return parked_page(conn, ctx.outbox.tables, group, topic, key, after=after,
                                   limit=limit + 1)

        rows = await ctx.read(index, read)
        rows, more = _split(rows, limit)
        return ctx.render(request, "key.html", who=who, group=group, topic=topic, key=key, rows=rows,
                          limit=limit, can_replay=(index, group) in ctx.inboxes,
                          lane=json.dumps([topic, key]), **_where(ctx, index),
                          next_after=rows[-1].id if more else None, payload=_payload)
    return page


def held(ctx: Context) -> Handler:
    async def page(request: Request) -> Response:
        who = ctx.viewer(request)
        group = group_of(request.query_params)
        index = database_index(request.query_params, ctx.databases)
        limit, after = page_size(request), _lane_after(request)

        def read() -> list[Any]:
            with ctx.databases[index].engine.connect() as conn:
                return held_lanes(conn, ctx.outbox.tables, group, after=after, limit=limit + 1)

        lanes = await ctx.read(index, read)
        lanes, more = _split(lanes, limit)
        return ctx.render(request, "held.html", who=who, group=group, lanes=lanes, limit=limit, now=utcnow(),
                          **_where(ctx, index),
                          next_after=json.dumps([lanes[-1].topic, lanes[-1].key]) if more else None)
    return page


def ping(ctx: Context) -> Handler:
    """``SELECT 1`` through the app: the round trip every page pays, the benchmarks' baseline."""
    async def page(request: Request) -> Response:
        ctx.viewer(request)

        def select_one() -> None:
            with ctx.engine.connect() as conn:
                conn.execute(text("SELECT 1"))

        await ctx.read(0, select_one)
        return PlainTextResponse("ok")
    return page


def _where(ctx: Context, index: int) -> dict[str, Any]:
    """What a group's page says and links about its database: ``db`` is left out of links for
    the outbox's own (index 0, the links of earlier releases)."""
    return {"db": index or None, "database": ctx.databases[index].name if len(ctx.databases) > 1 else None}


def _split(rows: list[Any], limit: int) -> tuple[list[Any], bool]:
    """A page read with ``limit + 1`` rows: the page, and whether another follows."""
    return rows[:limit], len(rows) > limit


def _payload(raw: bytes | None, limit: int = 4000) -> str:
    """The payload as text for a person (undecodable bytes shown as replacements), cut at ``limit``."""
    if raw is None:
        return ""
    shown = bytes(raw[:limit]).decode("utf-8", errors="replace")
    return shown + (f" … ({len(raw)} bytes)" if len(raw) > limit else "")
