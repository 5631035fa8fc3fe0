"""Reloading the tenant keys without a restart: `POST /v1/reload_api_keys` (the operator's)
and SIGHUP. A file that does not parse or validate is refused and the keys in force stay."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from loraserve.server.api_keys import KeyFileError
from loraserve.server.context import ServerContext
from loraserve.server.errors import ApiError

log = logging.getLogger("loraserve.server")


def reload_api_keys(ctx: ServerContext) -> JSONResponse:
    try:
        table = ctx.keys.reload()
    except KeyFileError as e:
        log.error("api keys not reloaded, the keys in force stay: %s", e)
        raise ApiError(400, f"{e}; the keys in force stay", "invalid_api_keys_file") from e
    log.info("api keys reloaded from %s: %d tenants", ctx.keys.path, len(table.tenants))
    return JSONResponse({"success": True, "tenants": sorted(table.tenants)})


def reload_on_signal(ctx: ServerContext) -> None:
    """SIGHUP's handler (event loop thread): errors are logged, never raised."""
    try:
        reload_api_keys(ctx)
    except ApiError:
        pass
