"""Runtime adapter load (from a path or an upload), unload, and the model list.

Access (admin key or the loopback-only flag) is checked by AuthMiddleware before the body is
read. Here: the name must be a valid adapter name (not the base model's), and with
`--lora-root` the path must resolve (realpath: symlinks followed) inside that directory. The
adapter is read and validated off the engine thread; only the commit runs between steps, so a
bad adapter changes nothing.
"""

from __future__ import annotations

import logging
import os
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from loraserve.adapters.peft.files import max_weights_bytes
from loraserve.adapters.versions import label
from loraserve.engine.messages import EngineSnapshot
from loraserve.server import protocol as P
from loraserve.server.api_keys import Tenant
from loraserve.server.context import ServerContext, parse_body
from loraserve.server.errors import ApiError
from loraserve.server.upload import receive_adapter
from loraserve.types import is_valid_adapter_name

log = logging.getLogger("loraserve.server")
MAX_PATH_BYTES = 4095  # Linux's PATH_MAX less the terminating NUL
MAX_NAME_BYTES = 255  # one path component (NAME_MAX)


def check_name(ctx: ServerContext, name: str) -> None:
    if name in ctx.base_names:
        raise ApiError(400, f"adapter name {name!r} is the base model's name: choose another",
                       "invalid_adapter_name")
    if not is_valid_adapter_name(name):
        raise ApiError(400, f"invalid adapter name {name!r}: use 1-64 of [A-Za-z0-9._-] "
                            "(':' is reserved for 'base:adapter', '/' is not allowed)",
                       "invalid_adapter_name")


def resolve_path(path: str, root: str | None) -> str:
    """The real path to load from; with a root, it must stay inside it (no '..', no symlink
    escape: containment is checked on the fully resolved path)."""
    if not path or "\x00" in path:
        raise ApiError(400, "lora_path is empty or invalid", "invalid_adapter_path")
    size = len(path.encode("utf-8", "surrogatepass"))
    longest = max(len(part.encode("utf-8", "surrogatepass")) for part in path.split("/"))
    if size > MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        raise ApiError(400, f"lora_path is too long ({size} bytes, its longest part {longest}); "
                            f"the limits are {MAX_PATH_BYTES} bytes and {MAX_NAME_BYTES} per "
                            "part", "invalid_adapter_path")
    if root is None:
        return os.path.realpath(path)
    if ".." in path.replace("\\", "/").split("/"):
        raise ApiError(403, "lora_path may not contain '..' when --lora-root is set",
                       "path_not_allowed")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # an absolute path stays as is
    if os.path.commonpath([real, real_root]) != real_root:
        raise ApiError(403, f"lora_path {path!r} resolves outside the allowed directory "
                            "(--lora-root); symlinks are followed", "path_not_allowed")
    return real


async def load(ctx: ServerContext, request: Request) -> JSONResponse:
    body = await parse_body(request, P.LoadLoraRequest)
    check_name(ctx, body.lora_name)
    path = resolve_path(body.lora_path, ctx.settings.lora_root)
    return await _load(ctx, body.lora_name, path, body.pinned, body.replace,
                       root=ctx.settings.lora_root, version=body.version)


async def upload(ctx: ServerContext, request: Request) -> JSONResponse:
    """A PEFT adapter streamed in as a multipart form (server/upload.py), loaded like one
    from disk; the store keeps the uploaded directory as the version's copy."""
    info = ctx.aengine.info
    form = await receive_adapter(request, max_weights_bytes(info.model_config,
                                                            info.max_lora_rank))
    try:
        name = form.fields["lora_name"].strip()
        check_name(ctx, name)
        pinned, replace = form.flag("pinned"), form.flag("replace")
    except BaseException:
        form.discard()
        raise
    return await _load(ctx, name, str(form.directory), pinned, replace, owned=True)


async def _load(ctx: ServerContext, name: str, path: str, pinned: bool, replace: bool, *,
                root: str | None = None, owned: bool = False,
                version: int | None = None) -> JSONResponse:
    t0 = time.perf_counter()
    version = await ctx.aengine.load_lora_adapter(name, path, pinned=pinned, root=root,
                                                  replace=replace, owned=owned,
                                                  version=version)
    ctx.metrics.observe_load(name, time.perf_counter() - t0)
    log.info("adapter %s registered via the API from %s (pinned=%s)", label(name, version),
             "an upload" if owned else path, pinned)
    return await _listing(ctx, f"adapter {name!r} loaded as version {version}",
                          version=version)


async def unload(ctx: ServerContext, request: Request) -> JSONResponse:
    body = await parse_body(request, P.UnloadLoraRequest)
    await ctx.aengine.unload_lora_adapter(body.lora_name)  # unknown name: 404
    return await _listing(ctx, f"adapter {body.lora_name!r} unloaded")


async def _listing(ctx: ServerContext, message: str, **extra) -> JSONResponse:
    snap = await ctx.aengine.snapshot()
    cards = [c for c in model_cards(ctx, snap, operator=True) if c["parent"] is not None]
    return JSONResponse({"success": True, "message": message, **extra,
                         "loaded_adapters": {c["id"]: c["root"] for c in cards},
                         "object": "list", "data": cards})


def model_cards(ctx: ServerContext, snap: EngineSnapshot, operator: bool,
                tenant: Tenant | None = None) -> list[dict]:
    """The model list. `root` is where the weights live for the operator, and the model's or
    adapter's own name for everyone else (server paths are the operator's business). A tenant
    sees only what it may use."""
    base = ctx.model_name
    root = ctx.model_path if operator else base
    cards = []
    if tenant is None or tenant.may_use(None):
        cards.append(P.model_card(base, root=root, parent=None, tier="device", pinned=True,
                                  in_flight=snap.base_in_flight, waiting=snap.base_waiting))
    live: dict[str, list] = {}
    for a in snap.adapters:
        if a.registered and (tenant is None or tenant.may_use(a.name)):
            live.setdefault(a.name, []).append(a)
    for name, versions in live.items():
        versions.sort(key=lambda a: a.version)
        numbers = [a.version for a in versions]
        # `name` is the newest version; older live versions are listed as name@N
        for a in versions:
            model_id = name if a is versions[-1] else label(name, a.version)
            cards.append(P.model_card(
                model_id, root=a.path if operator else model_id, parent=base, tier=a.tier,
                pinned=a.pinned, rank=a.rank, in_flight=a.refcount, waiting=a.waiting,
                version=a.version,
                **({"versions": numbers} if a is versions[-1] else {})))
    return cards
