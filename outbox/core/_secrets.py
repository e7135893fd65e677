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
from urllib.parse import quote, unquote, urlsplit

import sqlalchemy as sa

MASK = "***"

_SECRET_NAME = re.compile(r"pass|pwd|secret|token|key|auth|credential|sig", re.IGNORECASE)
"""A query parameter whose name matches may carry a credential: its value is masked."""


def database_url(url: str) -> str:
    """``url`` with its password and secret-looking query values masked, parseable or not."""
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError, TypeError):
        shown = _mask_query(_mask_userinfo(str(url)))
    else:
        masked = {name: MASK for name in parsed.query if _SECRET_NAME.search(name)}
        shown = parsed.update_query_dict(masked).render_as_string(hide_password=True)
        shown = shown.replace("%2A%2A%2A", MASK)  # the mask, as SQLAlchemy escapes it in a query
    return scrub(shown, database_secrets(url))


def database_secrets(url: str) -> list[str]:
    """Every form in which ``url``'s credentials can reach a message, longest first.

    A password with an unescaped ``@``, ``/`` or ``:`` is cut by URL parsing, and its
    pieces land in the host or the port, where a driver's "could not connect to
    host …" repeats them (libpq cuts further, at the ``,`` between hosts): so every
    piece between two characters other than letters, digits, ``.``, ``_``, ``~`` and
    ``-`` counts too, not only the whole.
    """
    text = str(url)
    found: set[str] = set()
    colon_to_at = _userinfo_password(text)
    values = [colon_to_at] if colon_to_at else []
    query = text.partition("?")[2]
    for pair in query.split("&"):
        name, equals, value = pair.partition("=")
        if equals and value and _SECRET_NAME.search(name):
            values.append(value)
    try:
        password = sa.make_url(text).password
    except (sa.exc.ArgumentError, ValueError, TypeError):
        password = None
    if password:
        values.append(str(password))
    for value in values:
        for form in (value, unquote(value)):
            pieces = {form, *_URL_DELIMITERS.split(form)}
            found.update(pieces)
            found.update(quote(piece, safe="") for piece in pieces)  # as a URL renders them
    # Shorter ones would mask ordinary words of every message (and guard next to nothing).
    return sorted((f for f in found if len(f) >= 4), key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with each of ``secrets`` (longest first, as ``database_secrets`` gives them) masked."""
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


_URL_DELIMITERS = re.compile(r"[^\w.~-]")
"""Where a password may be cut: URL syntax, and what drivers split on (libpq: ``,`` between hosts)."""


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
    password = _userinfo_password(text)
    if password is None:
        return text
    colon = _password_start(text)
    return f"{text[:colon]}{MASK}{text[colon + len(password):]}"


def _userinfo_password(text: str) -> str | None:
    """The text between the user's colon and the *last* ``@``: the password, even unescaped."""
    start = _password_start(text)
    return None if start < 0 else text[start:text.rfind("@")]


def _password_start(text: str) -> int:
    at = text.rfind("@")
    if at < 0:
        return -1
    slashes = text.find("//")
    start = slashes + 2 if 0 <= slashes < at else 0
    colon = text.find(":", start, at)
    return -1 if colon < 0 else colon + 1


def _mask_query(text: str) -> str:
    base, question, query = text.partition("?")
    if not question:
        return text
    pairs = []
    for pair in query.split("&"):
        name, equals, _ = pair.partition("=")
        pairs.append(f"{name}={MASK}" if equals and _SECRET_NAME.search(name) else pair)
    return f"{base}?{'&'.join(pairs)}"
