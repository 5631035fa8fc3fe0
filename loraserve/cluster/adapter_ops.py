"""Load and unload through the ingress: every replica or none.

A load is sent to every live replica, each running the single server's own route (same
validation, same answers). If all accept, the registry records it (replicas that start later
replay it); if any refuses, the replicas that accepted are put back as they were and the
client gets the refusing replica's answer, exactly as a single server would have given it.
An unload leaves the registry first (so no replica brings the adapter back), then every
replica. One adapter change at a time (the ingress's lock).
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraserve.cluster.aggregate import merge_cards
from loraserve.cluster.asgi_bridge import HttpReply, HttpRequest
from loraserve.cluster.registry import RegistryEntry
from loraserve.cluster.relay import json_of, reply_response, to_http_request
from loraserve.server.errors import error_response

log = logging.getLogger("loraserve.cluster")
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


async def load(ing, request: Request) -> Response:
    req = to_http_request(request, await request.body())
    fields = _fields(req.body)
    name = fields.get("lora_name")
    async with ing.lock:
        prev = (await ing.registry.state.remote()).entries.get(name) if name else None
        replies = _live(await ing.replicas.control_all(req, None))
        if not replies:
            return _no_replicas()
        accepted = [rid for rid, r in replies.items() if r.ok]
        refused = [r for r in replies.values() if not r.ok]
        if refused:
            if accepted and isinstance(name, str):
                await _roll_back(ing, req, name, prev, fields, accepted)
            return reply_response(refused[0])
        entry = RegistryEntry(fields["lora_path"],
                              bool(fields.get("pinned")) or (prev is not None and prev.pinned))
        ing.at = await ing.registry.put.remote(name, entry)
        log.info("adapter %s registered on %d replicas from %s", name, len(replies),
                 entry.lora_path)
    return await _listing(ing, req, replies, f"adapter {name!r} loaded")


async def unload(ing, request: Request) -> Response:
    req = to_http_request(request, await request.body())
    name = _fields(req.body).get("lora_name")
    async with ing.lock:
        prev = (await ing.registry.state.remote()).entries.get(name) if name else None
        if prev is not None:
            ing.at = await ing.registry.remove.remote(name)
        replies = _live(await ing.replicas.control_all(req, None))
        if not replies:
            return _no_replicas()
        ok = [r for r in replies.values() if r.ok]
        # with a registry entry, a replica that never had it (404) is fine: it is gone there
        refused = [r for r in replies.values()
                   if not r.ok and not (prev is not None and r.status == 404)]
        if refused or not (ok or prev is not None):
            return reply_response(refused[0] if refused else next(iter(replies.values())))
    return await _listing(ing, req, replies, f"adapter {name!r} unloaded")


async def _roll_back(ing, req: HttpRequest, name: str, prev: RegistryEntry | None,
                     fields: dict, accepted: list[str]) -> None:
    """Put the replicas that accepted the load back as they were: without the adapter, or
    with the registry's version of it (a replica that had fallen behind, or a pin)."""
    if (prev is not None and prev.lora_path == fields.get("lora_path")
            and (prev.pinned or not fields.get("pinned"))):
        return  # the load was a no-op there
    log.warning("load of %s refused by a replica: rolling back on %s", name, accepted)
    for rid in accepted:
        steps = [(UNLOAD, {"lora_name": name})]
        if prev is not None:
            steps.append((LOAD, {"lora_name": name, "lora_path": prev.lora_path,
                                 "pinned": prev.pinned}))
        for path, body in steps:
            reply = await ing.replicas.control(rid, req.with_body(path, json.dumps(body)
                                                                   .encode()), None)
            if reply is not None and not reply.ok:
                log.error("rollback of %s on replica %s: %s %s", name, rid, reply.status,
                          reply.body[:200])


async def _listing(ing, req: HttpRequest, replies: dict[str, HttpReply],
                   message: str) -> Response:
    """The single server's answer to a load/unload, with the merged adapter list."""
    for reply in replies.values():
        if reply.ok:
            message = json_of(reply).get("message", message)
            break
    cards, _ = await merged_models(ing, req)
    cards = [c for c in cards or () if c.get("parent") is not None]
    return JSONResponse({"success": True, "message": message,
                         "loaded_adapters": {c["id"]: c["root"] for c in cards},
                         "object": "list", "data": cards})


async def merged_models(ing, req: HttpRequest) -> tuple[list[dict] | None, HttpReply | None]:
    """Every replica's /v1/models merged, or the first refusal (e.g. a bad API key)."""
    replies = _live(await ing.replicas.control_all(req.with_body("/v1/models", b"", "GET"),
                                                   None))
    for reply in replies.values():
        if not reply.ok:
            return None, reply
    return merge_cards({rid: json_of(r)["data"] for rid, r in replies.items()}), None


def _fields(body: bytes) -> dict:
    """The load/unload fields, if the body is a JSON object (if not, every replica refuses
    it with the single server's 400 and nothing is committed)."""
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _live(replies: dict[str, HttpReply | None]) -> dict[str, HttpReply]:
    return {rid: r for rid, r in replies.items() if r is not None}


def _no_replicas() -> Response:
    response = error_response(503, "no engine replica is running; retry shortly",
                              "server_unavailable")
    response.headers["retry-after"] = "5"
    return response
