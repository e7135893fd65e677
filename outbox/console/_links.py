"""The console's own URLs: built with every name encoded, and recognised when sent back.

Names come from other people's data: a consumer group, topic or key may hold
``/``, ``%``, ``?``, ``#``, spaces, any Unicode or be ``..``. A server decodes
``%2F`` in a path before routing, so no name travels in the path: ``link``
puts every one in the query string, each character that is not unreserved
percent-encoded.

``console_path`` decides whether a ``back`` value sent in a form is a page of
this console. A browser reading a link follows the WHATWG URL parser, which
removes tabs and newlines anywhere, strips leading control characters and
spaces, treats ``\\`` as ``/`` and ``%2e`` as ``.`` in dot segments — so
``/\\t/evil.example/`` is ``//evil.example/``, another host. Accepted is only
what cannot be read two ways: printable ASCII without ``\\`` or spaces,
starting with the console's own path and ``/`` (not ``//``), and no ``.`` or
``..`` segment in the path that could climb out of it. The path itself (the
part before ``?``) may hold only letters, digits and ``-._~/``: the console's
paths need no more, and so no encoded variant (``%2e``, ``%2f``, ``%5c``,
``%09``) has to be reasoned about; names live in the query, encoded.
"""

from __future__ import annotations

import string
from urllib.parse import quote, urlencode

from starlette.requests import Request

_DOT_SEGMENTS = {".", ".."}
_PATH_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-._~/")


TENANTS_ROOT = "outbox.console.tenants_root"
"""Scope key: where a console of many tenants is mounted, set by it for its tenants' consoles."""


def base(request: Request) -> str:
    """Where the console is mounted ("" at the root): every link and cookie path starts here."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def cookie_path(request: Request) -> str:
    """The path of the console's cookies: under a console of many tenants, all of it, so one
    sign-in and one form token serve every tenant's pages."""
    return str(request.scope.get(TENANTS_ROOT, base(request))) + "/"


def link(base: str, path: str, **params: object) -> str:
    """``base + path`` with ``params`` (``None`` ones left out) as a fully encoded query string."""
    query = urlencode([(k, str(v)) for k, v in params.items() if v is not None], quote_via=quote, safe="")
    return f"{base}{path}?{query}" if query else f"{base}{path}"


def console_path(value: str, base: str) -> str | None:
    """``value`` when it is a path of the console mounted at ``base`` ("" at the root), else ``None``."""
    if not value.startswith(base + "/") or value.startswith("//"):
        return None
    if not all("!" <= c <= "~" for c in value) or "\\" in value:
        return None
    path = value.split("?", 1)[0].split("#", 1)[0]
    if not all(c in _PATH_CHARACTERS for c in path):
        return None
    if any(segment in _DOT_SEGMENTS for segment in path.split("/")):
        return None
    return value
