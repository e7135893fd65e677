"""``create_app``: the console as a Starlette app, served by ``outbox console`` or mounted in yours."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from ..core._errors import ConfigurationError, OutboxError, SchemaError
from ..core._identity import answers_same, tables_identity
from ..core._outage import is_database_outage
from ..core._secrets import database_secrets, database_url, scrub
from ..inbox import Inbox
from ..ops import Database
from ..producer import Outbox
from . import _actions, _pages
from ._auth import Operators
from ._authenticator import Authenticator
from ._context import Context, _Redirect
from ._devices import DeviceCookies, Devices
from ._limits import DEFAULT_MAX_BODY, BodyLimit
from ._links import base, link
from ._nav import Counts, navigated, toggle_refresh
from ._reads import DEFAULT_TIMEOUT, Unreadable, reason_of
from ._refused import Refused
from ._sessions import Sessions
from ._throttle import Throttle
from ._trace_page import trace

DEFAULT_SESSION_IDLE = 1800.0


def create_app(outbox: Outbox, *, inboxes: Iterable[Inbox] = (), operators: Operators | None = None,
               read_only: bool = False, secret: bytes | str | None = None,
               stuck_after: float = 300.0, session_idle: float = DEFAULT_SESSION_IDLE,
               max_body: int = DEFAULT_MAX_BODY, inbox_databases: Iterable[Engine] = (),
               database_timeout: float = DEFAULT_TIMEOUT) -> Starlette:
    """The web console for ``outbox``'s database: overview, failed rows, parked keys, held gaps.

    ``inboxes`` are your ``Inbox`` objects with their handlers registered: a
    group's parked keys can be replayed only when its ``Inbox`` is given
    (replay runs the handlers); discarding needs only the database.
    ``operators`` says who may act (``Operators.from_env()`` reads
    ``OUTBOX_CONSOLE_TOKEN``/``OUTBOX_CONSOLE_USERS``; ``Operators(guard=...)``
    lets the host application's authentication decide); with none the console
    is read-only. ``secret`` signs CSRF tokens; give the same one to every
    process behind one address (default: random per process). A token
    sign-in ends at logout, after ``session_idle`` seconds without a request,
    or after 12 hours. ``max_body`` bounds every request's body (bytes).
    ``inbox_databases`` are engines of consumers' own databases (inbox tables
    with the outbox's prefix and schema): the overview lists their groups, the
    parked and held pages and their actions work on them (``?db=N``), and the
    trace page and the navigation's counts read them beside ``outbox``'s
    database. Each of ``inboxes`` must use one of these databases or ``outbox``'s.
    ``database_timeout`` bounds how long a page or an action waits for one
    database (seconds): a database that is down, refuses the password, lacks
    the tables or does not answer in time is a 503 page naming it, or one line
    on the overview and the trace page, never an error of the console.
    Mount it with ``Mount("/outbox", app=create_app(...))``; links follow the mount path.
    """
    return build_app(outbox, inboxes=inboxes, operators=operators, read_only=read_only, secret=secret,
                     stuck_after=stuck_after, session_idle=session_idle, max_body=max_body,
                     inbox_databases=inbox_databases, database_timeout=database_timeout)


def build_app(outbox: Outbox, *, inboxes: Iterable[Inbox] = (), operators: Operators | None = None,
              read_only: bool = False, secret: bytes | str | None = None,
              stuck_after: float = 300.0, session_idle: float = DEFAULT_SESSION_IDLE,
              max_body: int = DEFAULT_MAX_BODY, inbox_databases: Iterable[Engine] = (),
              database_timeout: float = DEFAULT_TIMEOUT, auth: Authenticator | None = None,
              tenant: str | None = None) -> Starlette:
    """``create_app``, as one tenant's console among many: ``auth`` (who signed in, the sign-in
    throttle) shared with the other tenants' consoles, every page and database name saying ``tenant``."""
    if not isinstance(outbox, Outbox):
        raise ConfigurationError(f"create_app needs an outbox.Outbox, got {type(outbox).__name__}")
    if operators is not None and not isinstance(operators, Operators):
        raise ConfigurationError(f"operators must be outbox.console.Operators, "
                                 f"got {type(operators).__name__}")
    engines = list(inbox_databases)
    for engine in engines:
        if not isinstance(engine, Engine):
            raise ConfigurationError(f"inbox_databases must be sqlalchemy Engines, "
                                     f"got {type(engine).__name__}")
    outbox_engine = outbox.engine
    assert isinstance(outbox_engine, Engine)
    # One set of tables named twice (as the outbox's and as an inbox database, or twice as an inbox
    # database, in any spelling) is listed and counted once, as the trace reads it once.
    engines = _distinct(outbox_engine, engines, outbox)
    databases = _apart([_database(e, outbox, tenant) for e in (outbox_engine, *engines)])
    by_group: dict[tuple[int, str], Inbox] = {}
    for inbox in inboxes:
        if not isinstance(inbox, Inbox):
            raise ConfigurationError(f"inboxes must be outbox.Inbox objects, got {type(inbox).__name__}")
        index = _index_of(inbox, [outbox_engine, *engines], outbox)
        if not _same_tables(inbox, outbox, [outbox_engine, *engines][index]):
            raise ConfigurationError(f"the inbox of group {inbox.group!r} uses other tables (prefix "
                                     f"{inbox.tables.prefix!r}, schema {inbox.tables.schema!r}) than the "
                                     f"console's outbox ({outbox.tables.prefix!r}, {outbox.tables.schema!r})")
        if (index, inbox.group) in by_group:
            raise ConfigurationError(f"two inboxes for group {inbox.group!r} in {databases[index].name}")
        by_group[index, inbox.group] = inbox
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and len(secret) < 16:
        raise ConfigurationError("the console secret must be at least 16 bytes")
    if isinstance(stuck_after, bool) or not isinstance(stuck_after, int | float) or stuck_after < 0:
        raise ConfigurationError(f"stuck_after must be non-negative seconds, got {stuck_after!r}")
    if isinstance(session_idle, bool) or not isinstance(session_idle, int | float) or session_idle <= 0:
        raise ConfigurationError(f"session_idle must be positive seconds, got {session_idle!r}")
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1024:
        raise ConfigurationError(f"max_body must be a whole number of bytes, at least 1024, got {max_body!r}")
    if isinstance(database_timeout, bool) or not isinstance(database_timeout, int | float) \
            or not database_timeout > 0:
        raise ConfigurationError(f"database_timeout must be positive seconds, got {database_timeout!r}")
    operators = operators or Operators()
    key = secret or secrets.token_bytes(32)
    auth = auth or Authenticator(operators, Sessions(idle=float(session_idle)), Throttle(), Devices(key))
    ctx = Context(outbox, by_group, auth.operators, auth, read_only, key, float(stuck_after), max_body,
                  databases, tenant, float(database_timeout))
    outbox_db, *inbox_dbs = databases
    counts = Counts()

    def nav(handler: _pages.Handler) -> _pages.Handler:
        return navigated(ctx, counts, handler)

    routes = [
        Route("/", nav(_pages.overview(ctx))),
        Route("/ping", _pages.ping(ctx)),
        Route("/failed", nav(_pages.failed(ctx))),
        Route("/failed/retry", _actions.failed_action(ctx, "retry"), methods=["POST"]),
        Route("/failed/skip", _actions.failed_action(ctx, "skip"), methods=["POST"]),
        Route("/parked", nav(_pages.parked(ctx))),
        Route("/parked/key", nav(_pages.parked_key(ctx))),
        Route("/parked/replay", _actions.replay(ctx), methods=["POST"]),
        Route("/parked/discard", _actions.discard(ctx), methods=["POST"]),
        Route("/held", nav(_pages.held(ctx))),
        Route("/trace", nav(trace(ctx, outbox_db, inbox_dbs))),
        Route("/refresh", toggle_refresh(ctx)),
        Route("/login", _actions.login(ctx), methods=["GET", "POST"]),
        Route("/logout", _actions.logout(ctx), methods=["POST"]),
        # Links of earlier releases (a group without "/"), kept for bookmarks.
        Route("/parked/{group}", _moved("/parked")),
        Route("/held/{group}", _moved("/held")),
    ]

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        response = ctx.render(request, "error.html", status=exc.status, message=str(exc))
        response.headers.update(exc.headers)
        return response

    async def redirect(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Redirect)
        return exc.response()

    async def outbox_error(request: Request, exc: Exception) -> Response:
        # A library error no page expected: its message names the problem and the fix.
        return ctx.render(request, "error.html", status=500, message=str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return ctx.render(request, "error.html", status=exc.status_code, message=str(exc.detail))

    async def unreadable(request: Request, exc: Exception) -> Response:
        # A database down, frozen, refusing the password or without the tables: a page of its own,
        # naming it (``_reads``); the connection stays open for the next request.
        if not isinstance(exc, Unreadable):  # reached without a reader: which database is not known
            exc = Unreadable(databases[0].name if len(databases) == 1 else "a database of this console",
                             scrub(reason_of(databases[0], exc), every_secret))
        return ctx.render(request, "error.html", status=503, message=str(exc))

    every_secret = sorted({x for db in databases
                           for x in database_secrets(db.engine.url.render_as_string(hide_password=False))},
                          key=len, reverse=True)
    handlers: dict[Any, Any] = {Refused: refused, _Redirect: redirect, HTTPException: http_error,
                                OutboxError: outbox_error, Unreadable: unreadable,
                                SQLAlchemyError: unreadable, SchemaError: unreadable}
    return Starlette(routes=routes, middleware=[Middleware(BodyLimit, max_bytes=max_body),
                                                Middleware(DeviceCookies)],
                     exception_handlers=handlers)


def _database(engine: Engine, outbox: Outbox, tenant: str | None = None) -> Database:
    """A database the pages read, named without its password or secret query values (and with
    the tenant whose schema it is, in a console of many)."""
    name = database_url(engine.url.render_as_string(hide_password=False))
    if tenant is not None:
        schema = outbox.tables.schema
        name = f"tenant {tenant}: {name}" + (f" schema {schema}" if schema else "")
    return Database(name, engine, outbox.tables)


def _apart(databases: list[Database]) -> list[Database]:
    """``databases`` with the names two of them share made two, by the schema each one's server says its
    tables are in (two engines of one URL whose connections set two search paths), or by their place
    in the list when it does not answer: pages, links and audit lines tell them apart by name."""
    names = [db.name for db in databases]
    out = []
    for index, db in enumerate(databases):
        if names.count(db.name) == 1:
            out.append(db)
            continue
        try:
            where = tables_identity(db.engine, db.tables.schema, db.tables.prefix).schema
            label = f"schema {where.schema or where.database.database}"
        except Exception:
            label = f"database {index + 1} of the console"
        out.append(Database(f"{db.name} ({label})", db.engine, db.tables))
    return out


def _distinct(first: Engine, others: list[Engine], outbox: Outbox) -> list[Engine]:
    """``others`` less those whose console tables (``outbox``'s schema and prefix) are those of an engine
    before them (``first`` included), by what their servers say.

    Not by their URLs: two engines spelled alike to the letter may put their unqualified tables in two
    schemas (``connect_args`` setting the search path). A database that does not answer, or refuses to
    (a wrong password, no right to ask), is kept: its line says it could not be read.
    """
    kept: list[Engine] = []
    for engine in others:
        if not any(_same_place(engine, seen, outbox) for seen in (first, *kept)):
            kept.append(engine)
    return kept


def _same_place(a: Engine, b: Engine, outbox: Outbox) -> bool | None:
    """Whether the console's tables in ``a`` are those in ``b`` (one pool, or their servers say so);
    None when one does not answer or refuses to say (a wrong password, no right to ask)."""
    if a.pool is b.pool:
        return True
    try:
        schema, prefix = outbox.tables.schema, outbox.tables.prefix
        return tables_identity(a, schema, prefix) == tables_identity(b, schema, prefix)
    except Exception:
        return None


def _same(a: Engine, b: Engine) -> bool | None:
    """``answers_same``, and None too when a database refuses to say (a wrong password, no right to ask):
    unreadable all the same, which its page says."""
    try:
        return answers_same(a, b)
    except Exception:
        return None


def _index_of(inbox: Inbox, engines: list[Engine], outbox: Outbox) -> int:
    """Which of the console's databases ``inbox`` works in: its replays and discards go there.

    Of the console's engines on the inbox's database, the one whose console tables are the inbox's
    (one database may be listed more than once, each engine's search path another schema); if none
    is, the first, which the caller refuses as "other tables".
    """
    bind = inbox.engine
    if isinstance(bind, Engine):  # an async inbox's engine is none of the console's (sync) ones
        for index, engine in enumerate(engines):
            if bind.pool is engine.pool:
                return index  # one pool: no need to ask
        unanswered = False
        found: list[int] = []
        for index, engine in enumerate(engines):
            same = _same(bind, engine)
            if same:
                found.append(index)
            unanswered = unanswered or same is None
        for index in found:
            if _same_tables(inbox, outbox, engines[index]):
                return index
        if found:
            return found[0]
        if unanswered:
            raise ConfigurationError(f"cannot tell which database the inbox of group {inbox.group!r} "
                                     "uses: it or one of the console's databases does not answer")
    raise ConfigurationError(f"the inbox of group {inbox.group!r} uses a database that is not the "
                             f"console's outbox database nor one of its inbox_databases")


def _same_tables(inbox: Inbox, outbox: Outbox, engine: Engine) -> bool:
    """Whether ``inbox`` (working in ``engine``'s database) uses the console's tables: one prefix, in one
    schema, as the server says. ``None`` and ``public`` (``main`` on SQLite) may be one schema; ``None``
    for two users, or two engines of one URL whose connections set two search paths, may be two;
    ``out_`` and ``OUT_`` are one prefix on SQLite. Only one pool needs no question: a URL alike to
    the letter says nothing of the search path its engine's ``connect_args`` set."""
    if inbox.tables.prefix.lower() != outbox.tables.prefix.lower():
        return False  # no server takes them for one (plain ASCII names): nothing to ask
    bind = inbox.engine
    assert isinstance(bind, Engine)  # ``_index_of`` found it among the console's
    if (inbox.tables.schema, inbox.tables.prefix) == (outbox.tables.schema, outbox.tables.prefix) and (
            bind.pool is engine.pool):
        return True  # one pool, one schema and prefix as given: nothing to ask
    try:
        return (tables_identity(bind, inbox.tables.schema, inbox.tables.prefix)
                == tables_identity(engine, outbox.tables.schema, outbox.tables.prefix))
    except Exception as exc:
        if not is_database_outage(exc):
            raise
        raise ConfigurationError(f"cannot tell which tables the inbox of group {inbox.group!r} uses: "
                                 "its database does not answer") from None


def _moved(path: str) -> _pages.Handler:
    async def moved(request: Request) -> Response:
        return RedirectResponse(link(base(request), path, group=request.path_params["group"]), 301)
    return moved
