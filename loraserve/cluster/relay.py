"""Ingress side of a forwarded request: the Starlette request in, the replica's answer out.

The replica's head (status, headers) and body chunks are passed through as they come, so a
JSON answer is byte for byte the single server's and an SSE stream stays a stream. Until the
head arrives (a non-streaming answer comes whole at the end) the client is polled for a
hang-up, as the single server does; a hang-up later cancels the relay, and with it the
replica's handler, which aborts the engine's requests.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from loraserve.cluster.asgi_bridge import HttpHead, HttpReply, HttpRequest, HttpUsage
from loraserve.server.errors import error_body, error_response
from loraserve.server.formatting import sse
from loraserve.server.quotas import record_usage

log = logging.getLogger("loraserve.cluster")
GONE = ("the engine replica serving this request stopped; retry (another replica or its "
        "replacement will answer)")


def to_http_request(request: Request, body: bytes) -> HttpRequest:
    scope = request.scope
    client = scope.get("client")
    return HttpRequest(method=scope["method"], path=scope["path"],
                       query=scope.get("query_string", b""),
                       headers=tuple((bytes(k), bytes(v)) for k, v in scope["headers"]),
                       body=body, client=tuple(client) if client else None)


def reply_response(reply: HttpReply) -> Response:
    response = Response(reply.body, status_code=reply.status)
    response.raw_headers = list(reply.headers)
    return response


def json_of(reply: HttpReply) -> dict:
    return json.loads(reply.body)


async def relay(open_stream, request: Request, poll_s: float, attempts: int = 3) -> Response:
    """The replica's streamed answer (`open_stream()` yields an HttpHead, then bytes) as a
    response. A replica that dies before answering took the request's work with it, so the
    request goes to another replica (the router drops the dead one), a few times at most."""
    for attempt in range(attempts):
        gen = open_stream()
        try:
            head = await _head(gen, request, poll_s)
            break
        except (RayActorError, StopAsyncIteration) as e:
            log.warning("replica lost before answering (attempt %d): %r", attempt + 1, e)
            await asyncio.sleep(0.2 * (attempt + 1))
        except BackPressureError:
            return _unavailable("every engine replica's queue is full; retry shortly")
    else:
        return _unavailable(GONE)
    if head is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    streaming = any(k == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in head.headers)
    response = StreamingResponse(_body(gen, streaming, request.scope), status_code=head.status)
    response.raw_headers = list(head.headers)
    return response


async def _head(gen, request: Request, poll_s: float) -> HttpHead | None:
    first = asyncio.ensure_future(gen.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({first}, timeout=poll_s)
            if done:
                head = first.result()
                if not isinstance(head, HttpHead):
                    raise StopAsyncIteration
                return head
            if await request.is_disconnected():
                gen.cancel()
                return None
    finally:
        if not first.done():
            first.cancel()


async def _body(gen, streaming: bool, scope):
    finished = False
    try:
        async for chunk in gen:
            if isinstance(chunk, HttpUsage):  # the replica's count, for the ingress's quotas
                record_usage(scope, chunk.tokens)
                continue
            yield chunk
        finished = True
    except RayActorError as e:
        log.warning("replica lost mid-answer: %r", e)
        if streaming:  # end the stream as the server's shutdown does: an error, then [DONE]
            yield sse(error_body(503, GONE, "server_unavailable")).encode()
            yield sse("[DONE]").encode()
    finally:
        if not finished:
            gen.cancel()


def _unavailable(message: str) -> Response:
    response = error_response(503, message, "server_unavailable")
    response.headers["retry-after"] = "1"
    return response
