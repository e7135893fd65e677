"""``outbox demo --console``: after the tour, the web console on both services' databases.

Two consoles mounted in one ASGI app, as a host application would mount them:
``/orders`` (the outbox side: backlog, relays, failed rows) and ``/billing``
(the inbox side, with billing's handlers so parked keys can be replayed).
Operators come from ``OUTBOX_CONSOLE_TOKEN``/``OUTBOX_CONSOLE_USERS``; without
them the demo makes a token for this run and prints it.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ..console import Operators
    from ..console._serve import BoundedH11, serve_until_stopped


def serve_console(workdir: Path, *, host: str = "127.0.0.1", port: int = 8470,
                  console: Console | None = None) -> None:
    """Serve the consoles until Ctrl-C."""
    import uvicorn

    from ..console import Operators

    console = console or Console()
    operators = Operators.from_env()
    if not operators.configured:
        token = secrets.token_urlsafe(18)
        operators = Operators(token=token)
        console.print(f"console token for this run: [bold]{token}[/] (sign in with any name)")
    # No proxy in front: every client is its TCP peer (uvicorn would believe 127.0.0.1's X-Forwarded-For).
    server = uvicorn.Server(uvicorn.Config(demo_console(workdir, operators), host=host, port=port,
                                           log_level="warning", http=BoundedH11, proxy_headers=False))
    console.print(f"outbox console: http://{host}:{port}/orders/ and http://{host}:{port}/billing/ "
                  "(Ctrl-C stops it)")
    serve_until_stopped(server)


def demo_console(workdir: Path, operators: Operators) -> Starlette:
    """The two consoles on the demo's databases in ``workdir``, mounted in one app."""
    from starlette.applications import Starlette
    from starlette.responses import RedirectResponse
    from starlette.routing import Mount, Route

    from ..console import create_app
    from ..core._engine import create_engine
    from ..producer import Outbox
    from .billing import build_inbox

    orders = Outbox(create_engine(f"sqlite:///{workdir / 'orders.db'}"))
    billing_url = f"sqlite:///{workdir / 'billing.db'}"
    billing = build_inbox(billing_url, workdir / "alerts.jsonl")
    return Starlette(routes=[
        Route("/", lambda request: RedirectResponse("/billing/")),
        Mount("/orders", app=create_app(orders, operators=operators)),
        Mount("/billing", app=create_app(Outbox(billing.sessions.kw["bind"]), inboxes=[billing],
                                         operators=operators)),
    ])
