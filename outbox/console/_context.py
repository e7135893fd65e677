"""What every page and action of one console shares: the databases, who may act, how to render.

One ``Context`` per app, built by ``create_app`` and never changed after: the
handlers read it from several threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jinja2 import Environment, PackageLoader, select_autoescape
from sqlalchemy import Engine
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from transports._logsafe import safe_logger

from ..inbox import Inbox
from ..ops import Database
from ..producer import Outbox
from . import _csrf
from ._auth import Operators
from ._authenticator import Authenticator
from ._links import TENANTS_ROOT, base, cookie_path, link
from ._reads import DEFAULT_TIMEOUT, Reader
from ._refused import Refused
from ._relays import Heartbeats
from ._when import when

audit = safe_logger("outbox.console.audit")
T = TypeVar("T")

PAGE = 50
REFRESH_SECONDS = 30
"""Pages without an action form reload themselves this often (``_nav``), unless turned off."""
REFRESH_COOKIE = "outbox_refresh"
STALE_RELAY_AFTER = 60
"""Seconds without a heartbeat after which the overview marks a relay stale (relays renew every few)."""
MAX_PAGE = 500
# The pages run no script at all, so a payload that slipped past escaping could not run
# either; and no other site may frame them to trick an operator into a click.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass
class Context:
    outbox: Outbox
    inboxes: Mapping[tuple[int, str], Inbox]
    """The app's inboxes (with handlers: replay runs them) by (database index, group)."""
    operators: Operators
    auth: Authenticator
    read_only: bool
    secret: bytes = field(repr=False)
    stuck_after: float
    max_body: int
    databases: list[Database] = field(default_factory=list)
    """The outbox's database (index 0), then the inbox databases: ``?db=N`` names one (``_groups``)."""
    tenant: str | None = None
    """The tenant this console shows, when it is one of many (``create_tenants_app``): every page says so."""
    database_timeout: float = DEFAULT_TIMEOUT
    """Seconds a page or an action waits for one database (``_reads``)."""
    readers: list[Reader] = field(init=False, repr=False)
    """How pages reach ``databases`` (same index): off the event loop, within ``database_timeout``."""
    env: Environment = field(init=False, repr=False)
    heartbeats: Heartbeats = field(init=False, repr=False)
    _discarders: dict[tuple[int, str], Inbox] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        # Autoescape everything: payloads, errors and keys are other people's data.
        self.env = Environment(loader=PackageLoader("outbox.console", "templates"),
                               autoescape=select_autoescape(default=True, default_for_string=True))
        self.env.filters["when"] = when
        self.heartbeats = Heartbeats(STALE_RELAY_AFTER)
        self.readers = [Reader(db, self.database_timeout) for db in self.databases]

    async def read(self, index: int, work: Callable[[], T], *, write: bool = False) -> T:
        """``work()`` on database ``index``, within the deadline; ``Unreadable`` when it cannot be read."""
        return await self.readers[index].run(work, write=write)

    @property
    def engine(self) -> Engine:
        engine = self.outbox.engine
        assert isinstance(engine, Engine)
        return engine

    def inbox_for_discard(self, index: int, group: str) -> Inbox:
        """The group's ``Inbox`` in database ``index``: the app's when given, else one without
        handlers (discard needs none)."""
        if (index, group) in self.inboxes:
            return self.inboxes[index, group]
        with self._lock:
            if (index, group) not in self._discarders:
                self._discarders[index, group] = Inbox(self.databases[index].engine, group=group,
                                                       tables=self.outbox.tables, concurrency=1)
            return self._discarders[index, group]

    # -- access ---------------------------------------------------------------------

    def viewer(self, request: Request) -> str | None:
        """The operator looking, or ``None`` on an unprotected console; refuses a stranger."""
        if not self.operators.configured:
            return None
        if hasattr(request.state, "viewer"):  # checked already for this request (``_nav.navigated``)
            return str(request.state.viewer)
        who = self.auth.operator(request)
        if who is None:
            raise self._unauthenticated(request)
        return who

    def actor(self, request: Request, form: Mapping[str, Any]) -> tuple[str, str]:
        """Who acts and why, after every check an action needs; raises ``Refused`` otherwise."""
        if self.read_only:
            raise Refused(403, "this console is read-only (started with --read-only)")
        if not self.operators.configured:
            raise Refused(403, "no operator credential is configured, so this console is read-only "
                               "(set OUTBOX_CONSOLE_TOKEN or OUTBOX_CONSOLE_USERS)")
        who = self.auth.operator(request)
        if who is None:
            raise Refused(401, "an action needs an operator credential: sign in first",
                          self._challenge())
        self.check_csrf(request, form)
        reason = str(form.get("reason") or "").strip()
        if not reason:
            raise Refused(400, "say why: every action is recorded with a reason")
        return who, reason

    def check_csrf(self, request: Request, form: Mapping[str, Any]) -> None:
        if not _csrf.valid(self.secret, request.cookies.get(_csrf.COOKIE), form.get(_csrf.FIELD)):
            raise Refused(403, "the form's CSRF token is missing or wrong (reload the page and retry)")

    def _challenge(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Basic realm="outbox console"'} if self.operators.users else {}

    def _unauthenticated(self, request: Request) -> Exception:
        if self.operators.token and not self.operators.users:
            return _Redirect(f"{base(request)}/login")
        return Refused(401, "this console needs an operator credential", self._challenge())

    # -- rendering ------------------------------------------------------------------

    def render(self, request: Request, template: str, status: int = 200, **values: Any) -> Response:
        """Render ``template`` with the form token; set the CSRF cookie on the first visit."""
        cookie = request.cookies.get(_csrf.COOKIE)
        fresh = cookie is None
        if cookie is None:
            cookie = _csrf.new_cookie()
        root = base(request)
        html = self.env.get_template(template).render(
            base=root, url=lambda path, **params: link(root, path, **params),
            csrf=_csrf.form_token(self.secret, cookie), read_only=self.read_only,
            can_act=self.operators.configured and not self.read_only,
            read_only_because=self._read_only_because(),
            nav=getattr(request.state, "nav", None), stale_relay_after=STALE_RELAY_AFTER,
            page_url=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            refresh=REFRESH_SECONDS if request.cookies.get(REFRESH_COOKIE) != "off" else None,
            refresh_off=request.cookies.get(REFRESH_COOKIE) == "off",
            session_login=self.operators.token is not None, tenant=self.tenant,
            tenants_root=request.scope.get(TENANTS_ROOT), **values)
        response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
        if fresh:
            response.set_cookie(_csrf.COOKIE, cookie, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https", path=cookie_path(request))
        return response

    def _read_only_because(self) -> str | None:
        """Why no action is offered, and how to enable them; ``None`` when they are."""
        if self.read_only:
            return ("read-only: this console was started with --read-only (create_app(read_only=True)); "
                    "start it without to act")
        if not self.operators.configured:
            return ("read-only: no operator credential is set; set OUTBOX_CONSOLE_TOKEN or "
                    "OUTBOX_CONSOLE_USERS and restart the console to retry, skip, replay or discard "
                    "(see docs/security.md)")
        return None


class _Redirect(Exception):
    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.location = location

    def response(self) -> Response:
        return RedirectResponse(self.location, status_code=303)


def group_of(values: Mapping[str, Any]) -> str:
    """The consumer group a page or action is about (a query or form field: any name routes)."""
    group = str(values.get("group") or "")
    if not group:
        raise Refused(400, "name the consumer group (?group=...)")
    return group


def page_size(request: Request) -> int:
    try:
        return max(1, min(MAX_PAGE, int(request.query_params.get("limit", PAGE))))
    except ValueError:
        raise Refused(400, "limit must be a whole number") from None
