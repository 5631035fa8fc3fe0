"""The dashboard: a page in the browser over the server's own routes.

Its files (server/dashboard/) are static and hold no data, so they are served to anyone, like
/health: a browser cannot send a Bearer header when it navigates. The page asks for a key,
keeps it in the tab's sessionStorage and sends it with every fetch; what it then shows is what
that key may read from /v1/models and /metrics. `/dashboard/access` tells the page what the
key may do (it goes through the usual key check), so it offers admin actions only to a key
the admin routes would accept. Nothing here runs unless someone has the page open.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loraserve.server.auth import bearer_token, is_operator, key_matches
from loraserve.server.dashboard import PAGE, STATIC
from loraserve.server.settings import ServerSettings

ACCESS = f"{PAGE}/access"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


def access(settings: ServerSettings, token: str | None) -> dict:
    """What a request bearing `token` may do: see the operator's views (paths, debug), and
    load / unload / pin adapters (the admin routes' own rule, server/auth.py)."""
    updates = settings.runtime_lora_updates and (
        not settings.admin_api_key or key_matches(token, settings.admin_api_key))
    return {"operator": is_operator(token, settings), "adapter_updates": updates}


def install_dashboard(app: FastAPI, settings: ServerSettings) -> None:
    """GET /dashboard (the page), its files, and /dashboard/access."""
    folder = files("loraserve.server.dashboard")
    # read once: the files ship with the package and never change while it runs
    bodies = {name: folder.joinpath(name).read_bytes() for name in STATIC}

    def serve(name: str) -> Response:
        media = _TYPES[name[name.rfind("."):]]
        return Response(bodies[name], media_type=media,
                        headers={"Cache-Control": "no-cache",
                                 "X-Content-Type-Options": "nosniff"})

    @app.get(PAGE, include_in_schema=False)
    async def dashboard() -> Response:
        return serve("index.html")

    for name in STATIC:
        app.add_api_route(f"{PAGE}/{name}", _static(serve, name), methods=["GET"],
                          include_in_schema=False)

    @app.get(ACCESS, include_in_schema=False)
    async def dashboard_access(request: Request) -> Response:
        return JSONResponse(access(settings, bearer_token(request.scope)))


def _static(serve, name: str):
    async def route() -> Response:
        return serve(name)

    route.__name__ = f"dashboard_{name.replace('.', '_')}"
    return route
