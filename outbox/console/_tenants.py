"""``create_tenants_app``: one console over many tenants, each tenant's pages under ``/t/NAME/``.

The root page lists every tenant with what is stuck in it, or why it could
not be read (its tables missing, its database down or frozen: read with a
deadline per tenant, ``ops.tenant_statuses``); each tenant's own console (the
overview, failed rows, parked keys, held gaps, trace and their actions) is the
single-database console on that tenant's schema or database, every page and
audit line naming the tenant.

One ``Authenticator`` serves them all: a sign-in, a session and the sign-in throttle
count once for the whole console, never once per tenant (500 tenants must not
mean 500 times the guesses), and cookies are set for the whole console. The
root's report is read by one thread at a time and kept for a few seconds, so
many browsers refreshing it cost one read of the tenants, not one each.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from ..core._errors import ConfigurationError, OutboxError
from ..ops import DEFAULT_TENANT_TIMEOUT, tenant_statuses, tenants_document
from ..producer import Outbox
from ..tenants import Tenant, TenantDatabases, checked_tenants
from . import _actions
from ._app import DEFAULT_SESSION_IDLE, build_app
from ._auth import Operators
from ._authenticator import Authenticator
from ._context import Context, _Redirect
from ._devices import DeviceCookies, Devices
from ._limits import DEFAULT_MAX_BODY, BodyLimit
from ._links import TENANTS_ROOT
from ._refused import Refused
from ._sessions import Sessions
from ._throttle import Throttle

REPORT_FOR = 10.0
"""Seconds the root's report of every tenant is reused before it is read again."""


def create_tenants_app(tenants: Iterable[Tenant], databases: TenantDatabases, *, prefix: str = "",
                       operators: Operators | None = None, read_only: bool = False,
                       secret: bytes | str | None = None, stuck_after: float = 300.0,
                       session_idle: float = DEFAULT_SESSION_IDLE, max_body: int = DEFAULT_MAX_BODY,
                       timeout: float = DEFAULT_TENANT_TIMEOUT) -> Starlette:
    """The console of many tenants: ``/`` lists them, ``/t/NAME/`` is tenant NAME's console.

    ``tenants`` are read once (restart the console to show new ones);
    ``databases`` gives each tenant's engine (one per database). ``timeout``
    bounds how long the root page waits for one tenant, and a tenant's pages
    for its database (``create_app``'s ``database_timeout``). Everything else
    is ``create_app``'s, shared by every tenant's console.
    """
    chosen = checked_tenants(tenants)
    if not chosen:
        raise ConfigurationError("create_tenants_app needs at least one tenant")
    if operators is not None and not isinstance(operators, Operators):
        raise ConfigurationError(
            f"operators must be outbox.console.Operators, got {type(operators).__name__}")
    if isinstance(session_idle, bool) or not isinstance(session_idle, int | float) or session_idle <= 0:
        raise ConfigurationError(f"session_idle must be positive seconds, got {session_idle!r}")
    operators = operators or Operators()
    key = secret.encode() if isinstance(secret, str) else secret or secrets.token_bytes(32)
    auth = Authenticator(operators, Sessions(idle=float(session_idle)), Throttle(), Devices(key))
    consoles = {t.name: build_app(Outbox(_engine_of(t, databases), prefix=prefix, schema=t.schema),
                                  operators=operators, read_only=read_only, secret=key,
                                  stuck_after=stuck_after, max_body=max_body, database_timeout=timeout,
                                  auth=auth, tenant=t.name)
                for t in chosen}
    # The root's own context: who may look, the form token, rendering (its outbox is never read).
    ctx = Context(Outbox(databases.engine_for(chosen[0]), prefix=prefix, schema=chosen[0].schema), {},
                  operators, auth, read_only, key, float(stuck_after), max_body)
    report = _Report(chosen, databases, prefix, float(stuck_after), timeout)

    async def overview(request: Request) -> Response:
        who = ctx.viewer(request)
        doc = await run_in_threadpool(report.read)
        return ctx.render(request, "tenants.html", who=who, doc=doc, tenants_page=True)

    async def tenant_console(scope: Scope, receive: Receive, send: Send) -> None:
        console = consoles.get(scope["path_params"]["tenant"])
        if console is None:
            raise HTTPException(404, "no such tenant in this console")
        await console(scope, receive, send)

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        response = ctx.render(request, "error.html", status=exc.status, message=str(exc), tenants_page=True)
        response.headers.update(exc.headers)
        return response

    async def redirect(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Redirect)
        return exc.response()

    async def error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = str(exc.detail) if isinstance(exc, HTTPException) else str(exc)
        return ctx.render(request, "error.html", status=status, message=message, tenants_page=True)

    app = Starlette(
        routes=[Route("/", overview), Route("/login", _actions.login(ctx), methods=["GET", "POST"]),
                Route("/logout", _actions.logout(ctx), methods=["POST"]),
                Mount("/t/{tenant}", app=tenant_console)],
        middleware=[Middleware(BodyLimit, max_bytes=max_body), Middleware(_TenantsRoot),
                    Middleware(DeviceCookies)],
        exception_handlers={Refused: refused, _Redirect: redirect, HTTPException: error, OutboxError: error})
    return app


def _engine_of(tenant: Tenant, databases: TenantDatabases) -> Engine:
    try:
        return databases.engine_for(tenant)
    except ConfigurationError as exc:  # a URL that cannot be parsed: say whose
        raise ConfigurationError(f"tenant {tenant.name}: {exc}") from None


class _TenantsRoot:
    """Leaves where the console of many tenants is mounted in the scope, for the cookies' path."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[TENANTS_ROOT] = str(scope.get("root_path", "")).rstrip("/")
        await self.app(scope, receive, send)


class _Report:
    """Every tenant's status, read by one thread at a time and reused for a while.

    Reused for ``REPORT_FOR`` seconds, or twice as long as the last read took
    when that is longer (hundreds of tenants): reading them all never becomes
    the console's whole work, however often its root is loaded.
    """

    def __init__(self, tenants: list[Tenant], databases: TenantDatabases, prefix: str,
                 stuck_after: float, timeout: float) -> None:
        self._tenants, self._databases, self._prefix = tenants, databases, prefix
        self._stuck_after, self._timeout = stuck_after, timeout
        self._lock = threading.Lock()
        self._reading: Future[dict[str, Any]] | None = None
        self._fresh_until = 0.0

    def read(self) -> dict[str, Any]:
        with self._lock:
            if self._reading is None or (self._reading.done() and time.monotonic() >= self._fresh_until):
                self._reading = Future()
                threading.Thread(target=self._read, args=(self._reading,), name="outbox-console-tenants",
                                 daemon=True).start()
            reading = self._reading
        return reading.result()

    def _read(self, answer: Future[dict[str, Any]]) -> None:
        started = time.monotonic()
        try:
            outcomes = tenant_statuses(self._tenants, self._databases, prefix=self._prefix,
                                       stuck_after=self._stuck_after, timeout=self._timeout)
            doc = tenants_document(outcomes, self._stuck_after)
        except BaseException as exc:
            answer.set_exception(exc)
            return
        finally:
            took = time.monotonic() - started
            with self._lock:
                self._fresh_until = time.monotonic() + max(REPORT_FOR, 2 * took)
        answer.set_result(doc)
