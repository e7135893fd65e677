"""CSRF protection: a signed double-submit token.

The first page a browser loads sets a random cookie (``HttpOnly``,
``SameSite=Strict``); every form carries ``HMAC(secret, cookie)``. A POST is
accepted only when its form token matches the HMAC of the cookie it came
with. Another site can make a browser send the cookie but can neither read it
nor compute the HMAC without the console's secret, and a sub-domain that can
plant a cookie still cannot compute the matching form token. No server-side
session store is needed, so several console processes behind one address work
when they share ``secret``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

COOKIE = "outbox_console_csrf"
FIELD = "csrf"


def new_cookie() -> str:
    return secrets.token_urlsafe(32)


def form_token(secret: bytes, cookie: str) -> str:
    """The value a form must send back for ``cookie``."""
    return hmac.new(secret, b"csrf:" + cookie.encode(), hashlib.sha256).hexdigest()


def valid(secret: bytes, cookie: str | None, sent: str | None) -> bool:
    """True when ``sent`` is the form token of ``cookie``; compared in constant time."""
    if not cookie or not sent:
        return False
    # As bytes: ``compare_digest`` of two ``str`` raises TypeError when one is not ASCII.
    return hmac.compare_digest(form_token(secret, cookie).encode(), sent.encode("utf-8", "surrogatepass"))
