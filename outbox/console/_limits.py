"""A bound on every request body, enforced before anything parses it.

``BodyLimit`` wraps the console's ASGI app. A request that declares a
``Content-Length`` above ``max_bytes`` is answered 413
without reading a byte of its body; one that streams (chunked) is counted as
it is read, and the read that would pass ``max_bytes`` raises a 413 instead of
handing the bytes on. So no route — ``/login`` included, which anyone may
reach — ever holds more than ``max_bytes`` of a body in memory. The form
parser then bounds the number of fields on top (``_actions``).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY = 1024 * 1024


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = [v for k, v in scope.get("headers", []) if k.lower() == b"content-length"]
        too_large = f"the request body is larger than this console accepts ({self.max_bytes} bytes)"
        if declared:
            try:
                size = int(declared[0])
            except ValueError:
                size = -1
            if len(declared) > 1 or size < 0:
                await PlainTextResponse("the request's Content-Length is not one number", 400)(
                    scope, receive, send)
                return
            if size > self.max_bytes:
                await PlainTextResponse(too_large, 413)(scope, receive, send)
                return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, too_large)
            return message

        await self.app(scope, bounded, send)
