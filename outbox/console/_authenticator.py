"""Who is asking: the operator a request's credential names, with guessing throttled.

The one place a credential is checked: a basic-auth password, a bearer
token, the ``/login`` token, or a session cookie (the host's ``guard`` first,
when given). Every wrong password or token counts in the ``Throttle`` against
the client's address (and the user it named); a locked-out client is refused
with 429 before its credential is compared. A session cookie is not counted:
it is a random 256-bit key, not something a person could guess.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math

from starlette.requests import Request

from transports._logsafe import safe_logger

from ._auth import Operators
from ._refused import Refused
from ._sessions import Sessions
from ._throttle import Throttle

SESSION_COOKIE = "outbox_console_operator"
audit = safe_logger("outbox.console.audit")


def client_of(request: Request) -> str:
    """The client's address as the server saw it (behind a trusted proxy: X-Forwarded-For's).

    An IPv6 client is named by its /64 network: whoever has one address there
    (a home line, a cloud VM) can use all 2**64, and counted one by one each
    would bring its own free guesses. An IPv4-mapped address is its IPv4 one.
    """
    host = request.client.host if request.client else "unknown"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return f"client {host}"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return f"client {address.ipv4_mapped}"
        return f"client {ipaddress.ip_network(f'{address}/64', strict=False)}"
    return f"client {address}"


class Authenticator:
    """Who a request comes from (``operator``), a ``/login`` token's check, and the sign-in throttle.

    One serves a whole console, a console of many tenants included: a sign-in
    is valid on every page, and wrong guesses count against the client wherever
    they were made.
    """

    def __init__(self, operators: Operators, sessions: Sessions, throttle: Throttle) -> None:
        self.operators, self.sessions, self.throttle = operators, sessions, throttle

    def operator(self, request: Request) -> str | None:
        """The operator's name for this request, or ``None`` when it carries no valid credential.

        Raises ``Refused(429)`` while the client (or the basic-auth user it names) is locked out.
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
            subjects = [client_of(request)] + ([f"user {name!r}"] if name in ops.users else [])
            self.refuse_if_locked(*subjects)
            if ops.password_matches(name, password):
                self.throttle.succeeded(*subjects)
                return name
            self.throttle.failed(*subjects)
            audit.info("basic-auth refused for user %r from %s", name[:100], client_of(request))
            return None
        if ops.token and scheme.lower() == "bearer":
            self.refuse_if_locked(client_of(request))
            if not ops.token_matches(value):
                self.throttle.failed(client_of(request))
                audit.info("bearer token refused from %s", client_of(request))
                return None
            self.throttle.succeeded(client_of(request))
            return request.headers.get("x-outbox-operator", "").strip() or None
        if ops.token:
            return self.sessions.operator(request.cookies.get(SESSION_COOKIE))
        return None

    def token_sign_in(self, request: Request, sent: str) -> bool:
        """``sent`` (a ``/login`` form's token) is the token; raises ``Refused(429)`` while locked out."""
        client = client_of(request)
        self.refuse_if_locked(client)
        if not self.operators.token_matches(sent):
            self.throttle.failed(client)
            audit.info("sign-in refused from %s: wrong token", client)
            return False
        self.throttle.succeeded(client)
        return True

    def refuse_if_locked(self, *subjects: str) -> None:
        wait = self.throttle.wait(*subjects)
        if wait > 0:
            raise Refused(429, f"too many wrong credentials: try again in {math.ceil(wait)} s",
                          {"Retry-After": str(math.ceil(wait))})
