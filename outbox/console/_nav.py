"""What every page's navigation shows: failed, parked and held counts, and auto-refresh.

``navigated`` wraps a page handler: it checks the viewer first (a stranger is
refused before any count is read, so a count never reaches a sign-in or 401
page and an anonymous request costs no query), then reads each database's
counts within its deadline (``_reads``) and leaves them on ``request.state``
for ``Context.render``. Each
count is bounded: it counts at most ``CAP`` rows through an index (failed rows
through ``ix_outbox_key_waits``; parked and held rows through their tables'
primary keys) and shows ``1000+`` beyond, so the navigation costs the same
whatever is stuck. A database without a table shows no count for it.

Auto-refresh is a ``<meta http-equiv="refresh">`` (the pages run no script):
on every page without an action form, every ``REFRESH_SECONDS``; an operator
turns it off or on with ``/refresh``, remembered in a cookie.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from sqlalchemy import Connection, Select, func, inspect, literal_column, select
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ..core._tables import OutboxStatus as Status
from ..ops import Database
from ._context import REFRESH_COOKIE, Context
from ._links import base, console_path, cookie_path

Handler = Callable[[Request], Awaitable[Response]]
CAP = 1000


class Counts:
    """Counts over the console's databases; which tables each holds is looked up once it holds any."""

    def __init__(self) -> None:
        self._present: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def _tables(self, db: Database, conn: Connection) -> set[str]:
        # Looked up outside the lock: a database that hangs must not hold up the others' counts.
        with self._lock:
            known = self._present.get(db.name)
        if known is None:
            t = db.tables
            found = inspect(conn)
            known = {x.name for x in (t.messages, t.inbox_parked, t.inbox_held)
                     if found.has_table(x.name, schema=t.schema)}
            if known:  # none yet (an empty database): asked again, so counts come with `init-db`
                with self._lock:
                    self._present[db.name] = known
        return known

    @staticmethod
    def shown(parts: list[dict[str, int]]) -> dict[str, str | None]:
        """The navigation's counts from each readable database's: ``None`` where no database has the
        table, ``1000+`` past ``CAP``."""
        totals: dict[str, int | None] = {"failed": None, "parked": None, "held": None}
        for found in parts:
            for name, n in found.items():
                totals[name] = (totals[name] or 0) + n
        return {name: None if n is None else (f"{CAP}+" if n > CAP else str(n)) for name, n in totals.items()}

    def of(self, db: Database) -> dict[str, int]:
        """``db``'s counts, by name, of the tables it has."""
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
        return found


def navigated(ctx: Context, counts: Counts, handler: Handler) -> Handler:
    """``handler`` with the navigation counts read first, for a viewer who signed in (or may look without).

    Each database is counted within its deadline, all at once; one that cannot be read is left
    out (the page says what is wrong itself), and one still busy with an overdue read is not even
    asked, so a frozen database costs the navigation nothing.
    """
    async def page(request: Request) -> Response:
        request.state.viewer = ctx.viewer(request)
        asked = [ctx.read(index, partial(counts.of, db))
                 for index, db in enumerate(ctx.databases) if ctx.readers[index].answering]
        found = await asyncio.gather(*asked, return_exceptions=True)
        request.state.nav = counts.shown([f for f in found if isinstance(f, dict)])
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
