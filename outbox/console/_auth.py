"""Who is the operator: a shared token, basic-auth users, or the host application's own check.

Three ways, chosen when the console is built (``Operators``):

- ``token``: a shared secret (``OUTBOX_CONSOLE_TOKEN``). A browser signs in once
  on ``/login`` with the token and the operator's name; the console then keeps
  a server-side session naming that person (``_sessions``), so every action is
  recorded against a name, not against "the token". Scripts may send
  ``Authorization: Bearer`` with an ``X-Outbox-Operator`` header instead.
- ``users``: basic-auth users (``OUTBOX_CONSOLE_USERS="alice:PASSWORD,..."``);
  the browser asks for them itself. The user name is the operator.
- ``guard``: when the console is mounted in a host application, a callable
  ``guard(request) -> str | None`` naming the signed-in operator (or ``None``
  to refuse), so the host's own authentication protects it.

With none configured the console is read-only: anyone who can reach it (by
default only this machine) may look, nobody may act.

Tokens and passwords must be strong enough to survive guessing (``weakness``);
they are compared as SHA-256 digests with ``hmac.compare_digest``, so neither
their content nor their length shows in the answer's timing, and they never
appear in a ``repr``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from starlette.requests import Request

from ..core._errors import ConfigurationError

Guard = Callable[[Request], "str | None"]
MIN_LENGTH = 16
MIN_DISTINCT = 8
GENERATE = "python -c 'import secrets; print(secrets.token_urlsafe())'"
# Compared against when a basic-auth user name is unknown, so that case costs the same time.
_NOBODY = hashlib.sha256(b"no such console user").digest()


def weakness(secret: str) -> str | None:
    """Why ``secret`` is too weak to guard the console, or ``None``; never quotes the secret."""
    if len(secret) < MIN_LENGTH:
        return f"has {len(secret)} characters, needs at least {MIN_LENGTH}"
    if len(set(secret)) < MIN_DISTINCT:
        return f"uses {len(set(secret))} different characters, needs at least {MIN_DISTINCT}"
    return None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Operators:
    """The credentials that make someone an operator; see the module docstring.

    The token and the passwords are kept out of ``repr`` (they would land in logs and tracebacks).
    """

    token: str | None = field(default=None, repr=False)
    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    guard: Guard | None = None
    _token_digest: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _user_digests: Mapping[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.token is not None:
            if not isinstance(self.token, str):
                raise ConfigurationError("the console token must be a str")
            why = weakness(self.token)
            if why:
                raise ConfigurationError(f"the console token {why} (make one with `{GENERATE}`)")
        for name, password in self.users.items():
            if not isinstance(name, str) or not name or ":" in name or not isinstance(password, str):
                raise ConfigurationError(f"console user {name!r}: give NAME:PASSWORD, both non-empty, "
                                         "NAME without ':'")
            why = weakness(password)
            if why:
                raise ConfigurationError(f"console user {name!r}: the password {why}")
        object.__setattr__(self, "_token_digest", None if self.token is None else _digest(self.token))
        object.__setattr__(self, "_user_digests", {n: _digest(p) for n, p in self.users.items()})

    def __repr__(self) -> str:
        kinds = [k for k, on in (("token", self.token), ("users", self.users), ("guard", self.guard)) if on]
        users = f", users={sorted(self.users)!r}" if self.users else ""
        return f"Operators({'+'.join(kinds) or 'none'}{users})"

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
        token = env.get("OUTBOX_CONSOLE_TOKEN") or None
        try:
            cls(token=token)
        except ConfigurationError as exc:
            raise ConfigurationError(f"OUTBOX_CONSOLE_TOKEN: {exc}") from None
        try:
            cls(users=users)
        except ConfigurationError as exc:
            raise ConfigurationError(f"OUTBOX_CONSOLE_USERS: {exc}") from None
        return cls(token=token, users=users)

    @property
    def configured(self) -> bool:
        return bool(self.token or self.users or self.guard)

    def version(self, name: str | None = None) -> str:
        """Which value the token (``name`` None) or user ``name``'s password has now, as a digest.

        A device cookie binds it (``_devices``): changing a token or a password
        forgets every browser that signed in with the old one.
        """
        secret = self._token_digest if name is None else self._user_digests.get(name)
        return hashlib.sha256(b"outbox.console.version\0" + (secret or b"")).hexdigest()

    def token_matches(self, sent: str) -> bool:
        """``sent`` is the token; constant time whatever ``sent``'s length or content."""
        expected = self._token_digest
        return expected is not None and hmac.compare_digest(expected, _digest(sent))

    def password_matches(self, name: str, sent: str) -> bool:
        """``name`` is a user whose password is ``sent``; an unknown name costs the same time."""
        expected = self._user_digests.get(name)
        same = hmac.compare_digest(expected or _NOBODY, _digest(sent))
        return expected is not None and same
