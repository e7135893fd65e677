"""``/trace``: where is message X — the console's view of ``ops.trace_message``/``trace_key``.

A GET form (``?id=…`` or ``?topic=…&key=…``) over the console's outbox
database and its inbox databases; the same indexed lookups as ``outbox trace``.
Input the trace refuses (not a UUID, an unknown topic) is shown on the page,
status 400/404, beside the search form.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from .._errors import ConfigurationError
from ..ops import Database, trace_key, trace_message
from ._context import Context

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
        if any(len(v) > MAX_INPUT for v in (message_id, topic, key)):
            error, status = f"an id, topic or key is at most {MAX_INPUT} characters", 400
        elif message_id or topic or key:
            try:
                if message_id:
                    doc = await run_in_threadpool(trace_message, outbox_db, inbox_dbs, message_id)
                elif topic and key:
                    doc = await run_in_threadpool(trace_key, outbox_db, inbox_dbs, topic, key)
                else:
                    error, status = "a key trace needs both the topic and the key", 400
            except ConfigurationError as exc:
                error = str(exc)
                status = 404 if "in none of the databases" in error else 400
        return ctx.render(request, "trace.html", status=status, who=who, doc=doc, error=error,
                          query={"id": message_id, "topic": topic, "key": key},
                          searching=bool(message_id or topic or key), several=bool(inbox_dbs),
                          db_index=db_index)
    return page
