"""``/trace``: where is message X — the console's view of ``ops.trace_message``/``trace_key``.

A GET form (``?id=…`` or ``?topic=…&key=…``) over the console's outbox
database and its inbox databases; the same indexed lookups as ``outbox trace``.
Input the trace refuses (not a UUID, an unknown topic) is shown on the page,
status 400/404, beside the search form. A database that cannot be read (down,
frozen, refusing the password) is one line; the others are traced
(``_traced``), and only when none can be read is the page a 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from sqlalchemy import text
from starlette.requests import Request
from starlette.responses import Response

from ..core._errors import ConfigurationError
from ..ops import Database, trace_key, trace_message
from ._context import Context
from ._reads import Unreadable, within

Handler = Callable[[Request], Awaitable[Response]]
MAX_INPUT = 1000  # characters of an id, topic or key accepted from the query (a key is at most 255)


def trace(ctx: Context, outbox_db: Database, inbox_dbs: list[Database]) -> Handler:
    # A group's parked-messages link names its database (``?db=N``, left out for the outbox's own).
    db_index: dict[str, int | None] = {}
    for index, db in enumerate([outbox_db, *inbox_dbs]):
        db_index.setdefault(db.name, index or None)

    async def page(request: Request) -> Response:
        who = ctx.viewer(request)
        q = request.query_params
        message_id, topic, key = (q.get(n, "").strip() if n != "key" else q.get(n, "")
                                  for n in ("id", "topic", "key"))
        doc, error, status = None, None, 200
        down: list[dict[str, str]] = []
        if any(len(v) > MAX_INPUT for v in (message_id, topic, key)):
            error, status = f"an id, topic or key is at most {MAX_INPUT} characters", 400
        elif message_id or topic or key:
            try:
                if message_id:
                    doc, down = await _traced(ctx, lambda o, i: trace_message(o, i, message_id))
                elif topic and key:
                    doc, down = await _traced(ctx, lambda o, i: trace_key(o, i, topic, key))
                else:
                    error, status = "a key trace needs both the topic and the key", 400
            except _NotTraced as exc:
                error, down = str(exc.error), exc.down
                status = (404 if "in none of the databases" in error
                          else 503 if error.startswith("no outbox or inbox tables") else 400)
        return ctx.render(request, "trace.html", status=status, who=who, doc=doc, error=error,
                          unreachable=down + (doc["unreachable"] if doc else []),
                          query={"id": message_id, "topic": topic, "key": key},
                          searching=bool(message_id or topic or key), several=bool(inbox_dbs),
                          db_index=db_index)
    return page


class _NotTraced(Exception):
    def __init__(self, error: ConfigurationError, down: list[dict[str, str]]) -> None:
        super().__init__(str(error))
        self.error, self.down = error, down


async def _traced(ctx: Context, trace_of: Callable[[Database | None, list[Database]], dict[str, Any]]
                  ) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """``trace_of(outbox_db, inbox_dbs)`` over the databases that answer now, and a line for each
    that does not (down, frozen: the trace itself has no deadline per database, so each is asked for
    ``SELECT 1`` within its deadline first). 503 (``Unreadable``) when none answers."""
    pings = await asyncio.gather(*(ctx.read(index, partial(_select_1, db))
                                   for index, db in enumerate(ctx.databases)), return_exceptions=True)
    for ping in pings:
        if isinstance(ping, BaseException) and not isinstance(ping, Unreadable):
            raise ping
    up = [index for index, ping in enumerate(pings) if not isinstance(ping, BaseException)]
    down = [{"database": p.database, "error": p.reason} for p in pings if isinstance(p, Unreadable)]
    if not up:
        raise next(p for p in pings if isinstance(p, Unreadable))
    main = ctx.databases[0] if up[0] == 0 else None
    others = [ctx.databases[index] for index in up if index]
    names = ", ".join(ctx.databases[index].name for index in up)
    try:
        doc = await within(ctx.database_timeout, names, lambda: trace_of(main, others))
    except ConfigurationError as exc:
        raise _NotTraced(exc, down) from None
    return doc, down


def _select_1(db: Database) -> None:
    with db.engine.connect() as conn:
        conn.execute(text("SELECT 1"))
