"""What every page's navigation shows: failed, parked and held counts, and auto-refresh.

``navigated`` wraps a page handler: it checks the viewer first (a stranger is
refused before any count is read, so a count never reaches a sign-in or 401
page and an anonymous request costs no query), then reads the counts in the
thread pool and leaves them on ``request.state`` for ``Context.render``. Each
count is bounded: it counts at most ``CAP`` rows through an index (failed rows
through ``ix_outbox_key_waits``; parked and held rows through their tables'
primary keys) and shows ``1000+`` beyond, so the navigation costs the same
whatever is stuck. A database without a table shows no count for it.

Auto-refresh is a ``<meta http-equiv="refresh">`` (the pages run no script):
on every page without an action form, every ``REFRESH_SECONDS``; an operator
turns it off or on with ``/refresh``, remembered in a cookie.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import Connection, Select, func, inspect, literal_column, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .._tables import OutboxStatus as Status
from ..ops import Database
from ._context import REFRESH_COOKIE, Context
from ._links import base, console_path, cookie_path

Handler = Callable[[Request], Awaitable[Response]]
CAP = 1000




class Counts:
    """Counts over the console's databases; which tables each holds is looked up once."""

    def __init__(self, databases: list[Database]) -> None:
        self.databases = databases
        self._present: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def _tables(self, db: Database, conn: Connection) -> set[str]:
        with self._lock:
            if db.name not in self._present:
                t = db.tables
                found = inspect(conn)
                self._present[db.name] = {x.name for x in (t.messages, t.inbox_parked, t.inbox_held)
                                          if found.has_table(x.name, schema=t.schema)}
            return self._present[db.name]

    def read(self) -> dict[str, Any]:
        """``{"failed": n|None, "parked": n|None, "held": n|None, "capped": {...}}``; None: no such table."""
        totals: dict[str, int | None] = {"failed": None, "parked": None, "held": None}
        for db in self.databases:
            try:
                self._add(db, totals)
            except SQLAlchemyError:  # one database down: the others still count (the overview says which)
                continue
        return {name: None if n is None else (f"{CAP}+" if n > CAP else str(n)) for name, n in totals.items()}

    def _add(self, db: Database, totals: dict[str, int | None]) -> None:
        """Add ``db``'s counts to ``totals``, all or none of them."""
        t = db.tables
        found: dict[str, int] = {}
        with db.engine.connect() as conn:
            present = self._tables(db, conn)
            m = t.messages.c
            parts = {
                "failed": (t.messages, [m.status != Status.PUBLISHED,
                                        (m.status == Status.FAILED) | (m.available_at > m.created_at),
                                        m.status == Status.FAILED]),
                "parked": (t.inbox_parked, []),
                "held": (t.inbox_held, []),
            }
            for name, (table, where) in parts.items():
                if table.name not in present:
                    continue
                capped: Select[Any] = (select(literal_column("1")).select_from(table).where(*where)
                                       .limit(CAP + 1))
                found[name] = conn.scalar(select(func.count()).select_from(capped.subquery())) or 0
        for name, n in found.items():
            totals[name] = (totals[name] or 0) + n


def navigated(ctx: Context, counts: Counts, handler: Handler) -> Handler:
    """``handler`` with the navigation counts read first, for a viewer who passed the gate."""
    async def page(request: Request) -> Response:
        request.state.viewer = ctx.viewer(request)
        try:
            request.state.nav = await run_in_threadpool(counts.read)
        except Exception:  # a count must never cost the page: the page says what is wrong itself
            request.state.nav = None
        return await handler(request)
    return page


def toggle_refresh(ctx: Context) -> Handler:
    """``/refresh?to=off|on&back=PAGE``: remember the choice in a cookie, go back to the page."""
    async def page(request: Request) -> Response:
        ctx.viewer(request)
        to = "off" if request.query_params.get("to") == "off" else "on"
        back = console_path(request.query_params.get("back", ""), base(request)) or base(request) + "/"
        response = RedirectResponse(back, status_code=303)
        response.set_cookie(REFRESH_COOKIE, to, httponly=True, samesite="strict", max_age=365 * 86400,
                            secure=request.url.scheme == "https", path=cookie_path(request))
        return response
    return page
