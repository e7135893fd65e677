"""``outbox console``: serve the web console (``outbox.console``) with uvicorn.

Binds to 127.0.0.1 unless told otherwise. Operators come from
``OUTBOX_CONSOLE_TOKEN`` / ``OUTBOX_CONSOLE_USERS``; without either the
console is read-only, and it refuses to listen on any address but loopback.
``--app`` (repeatable) hands it your ``Inbox`` objects, so it can replay their
parked keys with their handlers.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import typer
from rich.console import Console
from sqlalchemy import Engine

from ..core._identity import same_database
from ..ops import DEFAULT_TENANT_TIMEOUT
from ..tenants import TenantDatabases
from . import app
from ._db import open_engine, open_outbox
from ._inbox import APP_HELP, load_inbox
from ._options import DB, LOG_LEVEL, PREFIX, SCHEMA, TENANTS, configure_logging
from ._tenants import TENANT_TIMEOUT_HELP, existing_engine, tenants_of


@app.command("console")
def console(
    db: str = DB,
    prefix: str = PREFIX,
    schema: str | None = SCHEMA,
    target: list[str] = typer.Option([], "--app", help=APP_HELP + " Repeat for several groups."),
    inbox_db: list[str] = typer.Option(
        [], "--inbox-db", help="SQLAlchemy URL of a consumer's own inbox database: its groups are "
                               "listed, paged and acted on beside --db's (an --app inbox may live "
                               "there). Repeat for several."),
    host: str = typer.Option("127.0.0.1", envvar="OUTBOX_CONSOLE_HOST",
                             help="Address to bind; the default serves this machine only."),
    port: int = typer.Option(8470, min=1, max=65535, envvar="OUTBOX_CONSOLE_PORT",
                             help="Port to listen on."),
    read_only: bool = typer.Option(False, "--read-only", help="Show everything, allow no action."),
    stuck_after: float = typer.Option(
        300.0, "--stuck-after", min=0,
        help="Seconds after which a retrying head or a held gap counts as stuck."),
    session_idle: float = typer.Option(
        1800.0, "--session-idle", min=1, envvar="OUTBOX_CONSOLE_SESSION_IDLE",
        help="Seconds without a request after which a token sign-in ends."),
    max_body: int = typer.Option(
        1024 * 1024, "--max-body", min=1024, envvar="OUTBOX_CONSOLE_MAX_BODY",
        help="Largest request body accepted, in bytes (checked before anything is parsed)."),
    forwarded_allow_ips: str = typer.Option(
        "", "--forwarded-allow-ips", envvar="OUTBOX_CONSOLE_FORWARDED_ALLOW_IPS",
        help="Addresses or networks of the reverse proxies whose X-Forwarded-For/-Proto are "
             "believed (comma-separated). Default: none, every client is its TCP peer."),
    database_timeout: float | None = typer.Option(
        None, "--database-timeout", min=0.1,
        help="Seconds a page or an action waits for one database before it says the database "
             "could not be read (default 10; with --tenants, --tenant-timeout)."),
    log_level: str = LOG_LEVEL,
    tenants: str | None = TENANTS,
    tenant_timeout: float = typer.Option(DEFAULT_TENANT_TIMEOUT, "--tenant-timeout", min=0.1,
                                         help=TENANT_TIMEOUT_HELP),
) -> None:
    """Serve the web console: overview, failed rows, parked keys and held gaps, with actions.

    Actions need an operator: set OUTBOX_CONSOLE_TOKEN (sign in on /login) or
    OUTBOX_CONSOLE_USERS="name:password,..." (basic auth); each at least 16
    characters with 8 different ones. Set OUTBOX_CONSOLE_SECRET to share CSRF
    tokens across several console processes. See docs/security.md.
    With --tenants, one console over every tenant: / lists them with what is stuck in
    each, /t/NAME/ is tenant NAME's console (docs/tenants.md).
    """
    configure_logging(log_level)
    proxies = trusted_proxies(forwarded_allow_ips)
    try:
        import uvicorn  # noqa: F401  (the extra is installed: ``_serve`` uses it)

        from ..console import Operators, create_app, create_tenants_app
        from ..console._reads import DEFAULT_TIMEOUT as DEFAULT_DATABASE_TIMEOUT
    except ImportError as exc:
        raise typer.BadParameter(f"{exc} (pip install 'transactional-outbox[console]')") from None
    operators = Operators.from_env()
    local = host in ("127.0.0.1", "localhost", "::1")
    if not local and not operators.configured:
        # Pages show payloads: on a network address they need an operator even to look.
        raise typer.BadParameter(f"serving on {host} needs OUTBOX_CONSOLE_TOKEN or OUTBOX_CONSOLE_USERS "
                                 "(the pages show payloads)", param_hint="--host")
    if tenants is not None:
        if target or inbox_db:
            raise typer.BadParameter("--app and --inbox-db serve one database; with --tenants, each "
                                     "tenant's console shows its own schema or database",
                                     param_hint="--tenants")
        if database_timeout is not None:
            raise typer.BadParameter("with --tenants, --tenant-timeout bounds each tenant's pages",
                                     param_hint="--database-timeout")
        engine = open_engine(db)
        databases = TenantDatabases(engine, make=existing_engine)
        web = create_tenants_app(tenants_of(tenants, None, engine, schema), databases,
                                 prefix=prefix, operators=operators, read_only=read_only,
                                 secret=os.environ.get("OUTBOX_CONSOLE_SECRET") or None,
                                 stuck_after=stuck_after, session_idle=session_idle, max_body=max_body,
                                 timeout=tenant_timeout)
        _serve(web, operators.configured, read_only, local, host, port, log_level, proxies)
        return
    # A URL given twice (as --db and --inbox-db, or twice as --inbox-db) is one engine: one pool is
    # one database to the console without asking, down or not. Spelled otherwise, its server is asked.
    opened: dict[str, Engine] = {}
    for url in inbox_db:
        if url != db and url not in opened:
            opened[url] = open_engine(url)
    outbox = open_outbox(db, prefix, schema)
    assert isinstance(outbox.engine, Engine)
    inbox_engines = [outbox.engine if url == db else opened[url] for url in inbox_db]
    inboxes = [load_inbox(t) for t in target]
    known = [e for e in (outbox.engine, *inbox_engines) if isinstance(e, Engine)]
    for name, inbox in zip(target, inboxes, strict=True):
        # Listing one database and replaying in another would confuse everyone: refuse it now.
        # One database in two spellings is one: its server says so (a server down says so here).
        if not isinstance(inbox.engine, Engine) or not any(same_database(inbox.engine, e) for e in known):
            raise typer.BadParameter(f"{name}'s inbox uses another database than --db or any --inbox-db",
                                     param_hint="--app")
    web = create_app(outbox, inboxes=inboxes, operators=operators, read_only=read_only,
                     secret=os.environ.get("OUTBOX_CONSOLE_SECRET") or None, stuck_after=stuck_after,
                     session_idle=session_idle, max_body=max_body, inbox_databases=inbox_engines,
                     database_timeout=database_timeout or DEFAULT_DATABASE_TIMEOUT)
    _serve(web, operators.configured, read_only, local, host, port, log_level, proxies)


def trusted_proxies(value: str) -> list[str]:
    """``--forwarded-allow-ips`` as a list of addresses and networks; refuses anything else.

    uvicorn quietly keeps a misspelt entry as a literal that no peer ever matches, and ``*``
    would believe the first ``X-Forwarded-For`` entry, which a client writes itself.
    """
    proxies = [item.strip() for item in value.split(",") if item.strip()]
    for item in proxies:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise typer.BadParameter(f"{item!r} is not an IP address or network (name each proxy by "
                                     "its address, e.g. 10.0.0.5 or 10.0.0.0/24)",
                                     param_hint="--forwarded-allow-ips") from None
    return proxies


def _serve(web: Any, configured: bool, read_only: bool, local: bool, host: str, port: int, log_level: str,
           proxies: list[str]) -> None:
    import uvicorn

    from ..console._serve import BoundedH11, serve_until_stopped

    err = Console(stderr=True)
    if not configured and not read_only:
        err.print("no OUTBOX_CONSOLE_TOKEN or OUTBOX_CONSOLE_USERS: the console is read-only")
    if not local:
        err.print(f"[yellow]serving on {host}: put it behind TLS (sign-ins and payloads cross the "
                  "network)[/yellow]")
    # No access log: URLs name groups and keys. Forwarded headers only from the proxies named: with
    # none, uvicorn would believe 127.0.0.1's (its default), i.e. every user of this machine's.
    config = uvicorn.Config(web, host=host, port=port, log_level=log_level.lower(), access_log=False,
                            proxy_headers=bool(proxies), forwarded_allow_ips=proxies or None, http=BoundedH11)
    server = uvicorn.Server(config)
    err.print(f"outbox console on http://{host}:{port}/ (Ctrl-C stops it)")
    serve_until_stopped(server)
