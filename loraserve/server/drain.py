"""Shutting down without refusing connections: while the server drains, the listening socket
stays open and every new request gets a 503 with Retry-After (and `Connection: close`), so
clients and load balancers retry elsewhere instead of seeing a refused connection; the
requests already in flight are counted, and the server exits once none is left (shutdown.py).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from loraserve.server.context import ServerContext
from loraserve.server.errors import RETRY_AFTER_S, error_bytes

_MESSAGE = "the server is shutting down; retry on another replica or later"


class DrainMiddleware:
    def __init__(self, app: ASGIApp, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.ctx.draining:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body",
                        "body": error_bytes(503, _MESSAGE, "server_unavailable")})
            return
        self.ctx.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ctx.in_flight -= 1
