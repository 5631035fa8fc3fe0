"""Request body size limit, enforced before the body is read into memory.

A declared Content-Length over the limit is refused at once; a chunked body is read up to the
limit and refused when it goes over. The body read here is replayed to the app, and later
`receive()` calls (disconnect detection) pass through to the server. Routes that stream
their body with bounds of their own (`streamed_paths`: adapter uploads) pass straight through.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.server.errors import error_bytes


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int,
                 streamed_paths: frozenset[str] = frozenset()):
        self.app = app
        self.max_bytes = max_bytes
        self.streamed_paths = streamed_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS")
                or scope["path"] in self.streamed_paths):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(send, declared)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # gone before sending its body: nothing to answer
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(send, size)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, size: int) -> None:
        message = (f"request body is too large ({size} bytes or more); the limit is "
                   f"{self.max_bytes} bytes (--max-request-bytes)")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body",
                    "body": error_bytes(413, message, "request_too_large")})


def _content_length(scope: Scope) -> int | None:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None
