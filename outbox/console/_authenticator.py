"""Who is asking: the operator a request's credential names, with guessing throttled.

The one place a credential is checked: a basic-auth password, a bearer
token, the ``/login`` token, or a session cookie (the host's ``guard`` first,
when given). Each try of a password or token is an ``Attempt`` for the
``Throttle``: from the client's address, at the credential it aimed at, from a
known browser when it holds a device cookie for that credential (``_devices``).
A locked-out attempt is refused with 429 before its credential is compared; a
right one gives its browser a device cookie. A session cookie is not counted:
it is a random 256-bit key, not something a person could guess.

The client's address is the TCP peer's, unless the server was told to believe
a proxy's ``X-Forwarded-For`` (``outbox console --forwarded-allow-ips``; by
default it believes none). Whatever it believes, the throttle's budget for
unknown browsers bounds the guesses of every address together.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
from collections.abc import Callable

from starlette.requests import Request

from transports._logsafe import safe_logger

from ._auth import Operators
from ._devices import DEVICE_COOKIE, Devices, remember
from ._refused import Refused
from ._sessions import Sessions
from ._throttle import Attempt, Throttle

SESSION_COOKIE = "outbox_console_operator"
audit = safe_logger("outbox.console.audit")


def client_of(request: Request) -> str:
    """The client's address as the server saw it (behind a trusted proxy: X-Forwarded-For's).

    An IPv6 client is named by its /64 network: whoever has one address there
    (a home line, a cloud VM) can use all 2**64, and counted one by one each
    would bring its own free guesses. An IPv4-mapped address is its IPv4 one.
    Anything that is no IP address (a proxy that forwarded garbage, a unix
    socket) is one client, "unknown": no spelling of garbage is a new address.
    """
    host = request.client.host if request.client else ""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return "client unknown"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return f"client {address.ipv4_mapped}"
        return f"client {ipaddress.ip_network(f'{address}/64', strict=False)}"
    return f"client {address}"


TOKEN = "the token"
"""The credential subject of the shared token (``/login`` and bearer alike)."""


def user(name: str) -> str:
    """The credential subject of a configured basic-auth user."""
    return f"user {name!r}"


class Authenticator:
    """Who a request comes from (``operator``), a ``/login`` token's check, and the sign-in throttle.

    One serves a whole console, a console of many tenants included: a sign-in
    is valid on every page, and wrong guesses count against the client wherever
    they were made.
    """

    def __init__(self, operators: Operators, sessions: Sessions, throttle: Throttle,
                 devices: Devices) -> None:
        self.operators, self.sessions, self.throttle, self.devices = operators, sessions, throttle, devices

    def operator(self, request: Request) -> str | None:
        """The operator's name for this request, or ``None`` when it carries no valid credential.

        Raises ``Refused(429)`` while its attempt is locked out (``Throttle.wait``).
        """
        ops = self.operators
        if ops.guard is not None:
            who = ops.guard(request)
            if who:
                return who
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if ops.users and scheme.lower() == "basic":
            try:
                name, _, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                name, password = "", ""
            if self.check(request, user(name) if name in ops.users else None,
                          lambda: ops.password_matches(name, password), ops.version(name)):
                return name
            audit.info("basic-auth refused for user %r from %s", name[:100], client_of(request))
            return None
        if ops.token and scheme.lower() == "bearer":
            if not self.check(request, TOKEN, lambda: ops.token_matches(value), ops.version()):
                audit.info("bearer token refused from %s", client_of(request))
                return None
            return request.headers.get("x-outbox-operator", "").strip() or None
        if ops.token:
            return self.sessions.operator(request.cookies.get(SESSION_COOKIE))
        return None

    def token_sign_in(self, request: Request, sent: str) -> bool:
        """``sent`` (a ``/login`` form's token) is the token; raises ``Refused(429)`` while locked out."""
        if self.check(request, TOKEN, lambda: self.operators.token_matches(sent), self.operators.version()):
            return True
        audit.info("sign-in refused from %s: wrong token", client_of(request))
        return False

    def check(self, request: Request, credential: str | None, matches: Callable[[], bool],
              version: str) -> bool:
        """Compare a credential (``matches``) unless its attempt is locked out; count the outcome.

        ``credential`` names what is tried (``TOKEN``, ``user(name)``), ``None`` for a user name
        that is not configured (it is compared all the same, so it costs the same time).
        ``version`` is its value's digest (``Operators.version``): a device cookie proves the
        credential as it is now, so a browser known for an old token or password is a stranger.
        """
        proven = None if credential is None else f"{credential}\0{version}"
        device = None if proven is None else self.devices.known(request.cookies.get(DEVICE_COOKIE), proven)
        attempt = Attempt(client_of(request), credential, device)
        wait = self.throttle.wait(attempt)
        if wait > 0:
            raise Refused(429, f"too many wrong credentials: try again in {math.ceil(wait)} s",
                          {"Retry-After": str(math.ceil(wait))})
        if not matches() or proven is None:
            self.throttle.failed(attempt)
            return False
        self.throttle.succeeded(attempt)
        remember(request, self.devices, proven)
        return True
