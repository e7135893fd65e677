"""Who is the operator: a shared token, basic-auth users, or the host application's own check.

Three ways, chosen when the console is built (``Operators``):

- ``token``: a shared secret (``OUTBOX_CONSOLE_TOKEN``). A browser signs in once
  on ``/login`` with the token and the operator's name; the console then keeps
  a signed cookie naming that person, so every action is recorded against a
  name, not against "the token". Scripts may send ``Authorization: Bearer``
  with an ``X-Outbox-Operator`` header instead.
- ``users``: basic-auth users (``OUTBOX_CONSOLE_USERS="alice:pw1,bob:pw2"``);
  the browser asks for them itself. The user name is the operator.
- ``guard``: when the console is mounted in a host application, a callable
  ``guard(request) -> str | None`` naming the signed-in operator (or ``None``
  to refuse), so the host's own authentication protects it.

With none configured the console is read-only: anyone who can reach it (by
default only this machine) may look, nobody may act.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from starlette.requests import Request

from .._errors import ConfigurationError

Guard = Callable[[Request], "str | None"]
SESSION_COOKIE = "outbox_console_operator"
SESSION_SECONDS = 12 * 3600


@dataclass(frozen=True)
class Operators:
    """The credentials that make someone an operator; see the module docstring."""

    token: str | None = None
    users: Mapping[str, str] = field(default_factory=dict)
    guard: Guard | None = None

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < 16:
            raise ConfigurationError("the console token must be at least 16 characters "
                                     "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)")
        for name, password in self.users.items():
            if not name or ":" in name or not password:
                raise ConfigurationError(f"console user {name!r}: give NAME:PASSWORD, both non-empty")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Operators:
        """``OUTBOX_CONSOLE_TOKEN`` and ``OUTBOX_CONSOLE_USERS`` (``name:password,...``)."""
        env = os.environ if environ is None else environ
        users: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in env.get("OUTBOX_CONSOLE_USERS", "").split(","))):
            name, sep, password = item.partition(":")
            if not sep:
                raise ConfigurationError(f"OUTBOX_CONSOLE_USERS: {name!r} has no password "
                                         "(expected name:password,name:password)")
            users[name] = password
        return cls(token=env.get("OUTBOX_CONSOLE_TOKEN") or None, users=users)

    @property
    def configured(self) -> bool:
        return bool(self.token or self.users or self.guard)

    def operator(self, request: Request, secret: bytes) -> str | None:
        """The operator's name for this request, or ``None`` when it carries no valid credential."""
        if self.guard is not None:
            who = self.guard(request)
            if who:
                return who
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if self.users and scheme.lower() == "basic":
            try:
                name, _, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            expected = self.users.get(name)
            if expected is not None and hmac.compare_digest(expected.encode(), password.encode()):
                return name
            return None
        if self.token and scheme.lower() == "bearer":
            name = request.headers.get("x-outbox-operator", "").strip()
            if name and hmac.compare_digest(self.token.encode(), value.encode()):
                return name
            return None
        if self.token:
            return session_operator(self.session_key(secret), request.cookies.get(SESSION_COOKIE))
        return None

    def session_key(self, secret: bytes) -> bytes:
        """What signs sign-in cookies: the secret and the token, so a new token signs everyone out."""
        return secret + hashlib.sha256((self.token or "").encode()).digest()

    def token_matches(self, sent: str) -> bool:
        return self.token is not None and hmac.compare_digest(self.token.encode(), sent.encode())


def _sign(secret: bytes, text: str) -> str:
    return hmac.new(secret, b"operator:" + text.encode(), hashlib.sha256).hexdigest()


def session_cookie(secret: bytes, name: str, now: float | None = None) -> str:
    """A cookie value naming ``name`` until it expires, signed with the console's secret."""
    expires = int((now or time.time()) + SESSION_SECONDS)
    text = f"{expires}:{base64.urlsafe_b64encode(name.encode()).decode()}"
    return f"{text}:{_sign(secret, text)}"


def session_operator(secret: bytes, cookie: str | None) -> str | None:
    if not cookie or cookie.count(":") != 2:
        return None
    expires, encoded, signature = cookie.split(":")
    text = f"{expires}:{encoded}"
    if not hmac.compare_digest(_sign(secret, text), signature):
        return None
    try:
        if int(expires) < time.time():
            return None
        return base64.urlsafe_b64decode(encoded.encode()).decode() or None
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
