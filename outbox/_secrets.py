"""What of a URL may be shown in a log line, a repr or an error: never a credential.

Two kinds of URL reach the library. A database URL names its secrets in
known places (the password, and for libpq a ``?password=`` query parameter),
so it is shown with those masked: ``database_url``. A webhook URL may be a
secret as a whole (Slack's and Discord's keys are path segments, others a
``?token=``), so only its scheme, host and port are shown: ``webhook_url``.
Each works on text that does not parse too, because an unparseable URL is
exactly what an error message has to name.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import sqlalchemy as sa

MASK = "***"

_SECRET_NAME = re.compile(r"pass|pwd|secret|token|key|auth|credential|sig", re.IGNORECASE)
"""A query parameter whose name matches may carry a credential: its value is masked."""


def database_url(url: str) -> str:
    """``url`` with its password and secret-looking query values masked, parseable or not."""
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError, TypeError):
        return _mask_query(_mask_userinfo(str(url)))
    masked = {name: MASK for name in parsed.query if _SECRET_NAME.search(name)}
    shown = parsed.update_query_dict(masked).render_as_string(hide_password=True)
    return shown.replace("%2A%2A%2A", MASK)  # the mask, as SQLAlchemy escapes it in a query


def webhook_url(url: str) -> str:
    """``scheme://host:port`` of ``url``, with ``/…`` when it has more: the rest may be the secret."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a malformed port or bracket: show no more than the scheme
        return f"{url.partition(':')[0][:16]}://…"
    if ":" in host:
        host = f"[{host}]"
    rest = "/…" if (parts.path not in ("", "/") or parts.query or parts.fragment) else ""
    return f"{parts.scheme}://{host}{port}{rest}"


def _mask_userinfo(text: str) -> str:
    """``scheme://user:password@host…`` → ``scheme://user:***@host…`` (also without a scheme)."""
    at = text.rfind("@")
    if at < 0:
        return text
    slashes = text.find("//")
    start = slashes + 2 if 0 <= slashes < at else 0
    colon = text.find(":", start, at)
    return text if colon < 0 else f"{text[:colon + 1]}{MASK}{text[at:]}"


def _mask_query(text: str) -> str:
    base, question, query = text.partition("?")
    if not question:
        return text
    pairs = []
    for pair in query.split("&"):
        name, equals, _ = pair.partition("=")
        pairs.append(f"{name}={MASK}" if equals and _SECRET_NAME.search(name) else pair)
    return f"{base}?{'&'.join(pairs)}"
