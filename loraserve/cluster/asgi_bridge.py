"""One forwarded HTTP request run through an in-process ASGI app (a replica's server app).

The ingress ships the request as plain data (`HttpRequest`); the replica feeds it to the app
and yields the response as it is produced: an `HttpHead` first, then body chunks, so SSE
streams pass through chunk by chunk. When the consumer goes away (the client hung up and the
ingress cancelled the call), the app sees `http.disconnect` and its handler is cancelled: the
server's own `finally` blocks abort the engine requests, as on a direct connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loraserve.server.quotas import USAGE_KEY

log = logging.getLogger("loraserve.cluster")

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: bytes = b""
    headers: Headers = ()
    body: bytes = b""
    client: tuple[str, int] | None = None

    def with_body(self, path: str, body: bytes, method: str = "POST") -> HttpRequest:
        """The same caller (headers, client) asking for something else: rollback and fan-out
        calls carry the original credentials, so replicas check them as usual."""
        headers = tuple((k, v) for k, v in self.headers if k != b"content-length")
        headers += ((b"content-length", str(len(body)).encode()),)
        return HttpRequest(method, path, b"", headers, body, self.client)


@dataclass(frozen=True)
class HttpHead:
    status: int
    headers: Headers


@dataclass(frozen=True)
class HttpUsage:
    """After the body: the tokens the request used (prompt + generated), for the ingress's
    tokens_per_minute; never sent to the client."""

    tokens: int


@dataclass(frozen=True)
class HttpReply:
    """A whole response (fan-out calls: models, metrics, load/unload)."""

    status: int
    headers: Headers
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def _scope(req: HttpRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": req.method, "scheme": "http", "path": req.path,
            "raw_path": req.path.encode(), "query_string": req.query, "root_path": "",
            "headers": [(k.lower(), v) for k, v in req.headers], "client": req.client,
            "server": ("loraserve-replica", 0), "state": {}}


async def stream_app(app, req: HttpRequest) -> AsyncIterator[HttpHead | bytes | HttpUsage]:
    """Run `req` through `app`; yield the head, every non-empty body chunk, then what the
    request used (if it was a completion)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()  # nothing more to read: only a hang-up can come now
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    scope = _scope(req)
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda t: out.put_nowait(None))  # wakes the reader at the end
    complete = usage_sent = False
    try:
        while True:
            msg = await out.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                yield HttpHead(msg["status"], tuple((bytes(k), bytes(v))
                                                    for k, v in msg.get("headers", ())))
            elif msg["type"] == "http.response.body":
                if not usage_sent and (used := scope["state"].get(USAGE_KEY)) is not None:
                    # before the last bytes: the ingress charges it before the client sees them
                    usage_sent = True
                    yield HttpUsage(int(used))
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    complete = True
                    break
    finally:
        gone.set()
        if not complete:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            # Starlette re-raises a handler's bug after sending its 500: logged there already
            await task
    if not complete:  # the app ended without a response: our bug, but answer the client
        log.error("the server app ended without a complete response for %s %s", req.method,
                  req.path)
    elif not usage_sent and (used := scope["state"].get(USAGE_KEY)) is not None:
        yield HttpUsage(int(used))


async def call_app(app, req: HttpRequest) -> HttpReply:
    """The whole response of `req` at once."""
    head, chunks = HttpHead(500, ()), []
    async for item in stream_app(app, req):
        if isinstance(item, HttpHead):
            head = item
        elif isinstance(item, bytes):
            chunks.append(item)
    return HttpReply(head.status, head.headers, b"".join(chunks))
