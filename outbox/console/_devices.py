"""Known browsers: a device cookie proves that a browser signed in here before, with which credential.

When a credential is accepted, the browser gets a device cookie: a random
nonce, the time it was issued, and ``HMAC(secret, "device:" credential nonce
issued)``. Presented again with the same credential within ``lifetime``, it
makes that browser *known*: the sign-in throttle then judges it by its own
count instead of the budget every stranger shares (``_throttle``), so guessers
cannot lock out an operator who signed in before. It grants nothing by itself —
the credential is still compared — and names no credential (the HMAC binds it,
with a digest of its value: ``Operators.version``): a cookie earned with alice's
password does not make a browser known for bob's, nor for the token, nor for
alice's next password once hers is changed. Only the console's secret can make one (the CSRF tokens
sign ``"csrf:"`` messages, never ``"device:"`` ones); changing the secret
(``OUTBOX_CONSOLE_SECRET``, or a restart when it is random) forgets every
browser.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._links import cookie_path

DEVICE_COOKIE = "outbox_console_device"
LIFETIME = 30 * 86400.0
"""Seconds a device cookie makes its browser known (it is renewed at each sign-in after half of it)."""
_ISSUE = "outbox.console.device_cookie"
"""``scope["state"]`` key: the Set-Cookie header the response must carry (``DeviceCookies``)."""


def _wall() -> float:
    return time.time()  # looked up at each call, so a test may replace the module's ``time``


class Devices:
    def __init__(self, secret: bytes, *, lifetime: float = LIFETIME,
                 clock: Callable[[], float] | None = None) -> None:
        self._secret, self.lifetime = secret, lifetime
        self._clock = clock or _wall

    def _mac(self, credential: str, nonce: str, issued: int) -> str:
        message = f"device:{credential}\0{nonce}\0{issued}".encode("utf-8", "surrogatepass")
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self, credential: str) -> str:
        """A new device cookie value for a browser that just proved ``credential``."""
        nonce, issued = secrets.token_urlsafe(18), int(self._clock())
        return f"{nonce}.{issued}.{self._mac(credential, nonce, issued)}"

    def known(self, cookie: str | None, credential: str) -> str | None:
        """The device id (a digest of the nonce, safe to log) when ``cookie`` proves ``credential``."""
        age = self.age(cookie, credential)
        if age is None or cookie is None:
            return None
        return hashlib.sha256(cookie.split(".", 1)[0].encode()).hexdigest()[:16]

    def age(self, cookie: str | None, credential: str) -> float | None:
        """Seconds since ``cookie`` was issued for ``credential``; ``None`` unless it is valid now."""
        if not cookie or len(cookie) > 200 or cookie.count(".") != 2:
            return None
        nonce, issued_text, mac = cookie.split(".")
        if not issued_text.isascii() or not issued_text.isdigit() or len(issued_text) > 12:
            return None
        issued = int(issued_text)
        expected = self._mac(credential, nonce, issued).encode()
        if not hmac.compare_digest(expected, mac.encode("utf-8", "replace")):
            return None
        age = self._clock() - issued
        return age if -300.0 <= age <= self.lifetime else None  # a little clock skew between processes


def remember(request: Request, devices: Devices, credential: str) -> None:
    """Give the browser of ``request`` a device cookie for ``credential``, unless it holds a fresh one."""
    age = devices.age(request.cookies.get(DEVICE_COOKIE), credential)
    if age is not None and age < devices.lifetime / 2:
        return
    carrier = Response()
    carrier.set_cookie(DEVICE_COOKIE, devices.issue(credential), max_age=int(devices.lifetime), httponly=True,
                       samesite="lax", secure=request.url.scheme == "https", path=cookie_path(request))
    request.scope.setdefault("state", {})[_ISSUE] = carrier.headers["set-cookie"]


class DeviceCookies:
    """Adds the device cookie ``remember`` chose to the response, whichever route made it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                header = scope.get("state", {}).pop(_ISSUE, None)  # once, when consoles are nested
                if header is not None:
                    message["headers"] = [*message.get("headers", []),
                                          (b"set-cookie", header.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, with_cookie)
