"""Load and unload through the ingress: every replica or none.

A load is sent to every live replica, each running the single server's own route (same
validation, same answers), with the version number the registry reserved for it, so `name@N`
names the same weights on every replica. If all accept, the registry records it (replicas that
start later replay it); if any refuses, the replicas that accepted drop that version (the one
before it serves again) and the client gets the refusing replica's answer, exactly as a single
server would have given it. Uploads need every replica to get the files: through the ingress
they are refused (load from a path every replica can read).
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
UNLOAD = "/v1/unload_lora_adapter"


async def load(ing, request: Request) -> Response:
    req = to_http_request(request, await request.body())
    fields = _fields(req.body)
    name = fields.get("lora_name")
    async with ing.lock:
        prev = (await ing.registry.state.remote()).entries.get(name) if name else None
        new_version = isinstance(name, str) and "lora_path" in fields and (
            prev is None or fields.get("replace") is True)
        if new_version:  # every replica numbers it alike
            fields["version"] = await ing.registry.reserve_version.remote(name)
            req = req.with_body(req.path, json.dumps(fields).encode())
        replies = _live(await ing.replicas.control_all(req, None))
        if not replies:
            return _no_replicas()
        accepted = [rid for rid, r in replies.items() if r.ok]
        refused = [r for r in replies.values() if not r.ok]
        if refused:
            if accepted and new_version:
                await _roll_back(ing, req, name, fields["version"], accepted)
            return reply_response(refused[0])
        entry = RegistryEntry(fields["lora_path"],
                              bool(fields.get("pinned")) or (prev is not None and prev.pinned),
                              fields["version"] if new_version else
                              prev.version if prev is not None else 1)
        ing.at = await ing.registry.put.remote(name, entry)
        log.info("adapter %s registered on %d replicas from %s", name, len(replies),
                 entry.lora_path)
    return await _listing(ing, req, replies, f"adapter {name!r} loaded")


async def unload(ing, request: Request) -> Response:
    req = to_http_request(request, await request.body())
    name = _fields(req.body).get("lora_name")
    async with ing.lock:
        entries = (await ing.registry.state.remote()).entries
        prev = entries.get(name) if isinstance(name, str) else None
        base, _, version = name.partition("@") if isinstance(name, str) else ("", "", "")
        if base in entries and version == str(entries[base].version):
            return error_response(400, f"{name} is the version every replica serves and "
                                       f"replays: unload {base!r}, or replace it first",
                                  "unload_current_version")
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


async def _roll_back(ing, req: HttpRequest, name: str, version: int,
                     accepted: list[str]) -> None:
    """The replicas that accepted version `version` drop it: the version before it (if any)
    serves there again, as on the replicas that refused."""
    log.warning("load of %s refused by a replica: rolling back on %s", name, accepted)
    body = json.dumps({"lora_name": f"{name}@{version}"}).encode()
    for rid in accepted:
        reply = await ing.replicas.control(rid, req.with_body(UNLOAD, body), None)
        if reply is not None and not reply.ok:
            log.error("rollback of %s on replica %s: %s %s", name, rid, reply.status,
                      reply.body[:200])


async def refuse_upload(ing, request: Request) -> Response:
    return error_response(400, "uploads are not taken through --replicas: every replica "
                               "must read the files; load them from a path every replica can "
                               "read (POST /v1/load_lora_adapter)", "upload_not_supported")


async def _listing(ing, req: HttpRequest, replies: dict[str, HttpReply],
                   message: str) -> Response:
    """The single server's answer to a load/unload, with the merged adapter list."""
    extra = {}
    for reply in replies.values():
        if reply.ok:
            body = json_of(reply)
            message = body.get("message", message)
            extra = {"version": body["version"]} if "version" in body else {}
            break
    cards, _ = await merged_models(ing, req)
    cards = [c for c in cards or () if c.get("parent") is not None]
    return JSONResponse({"success": True, "message": message, **extra,
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
