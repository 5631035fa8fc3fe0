"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine.

Middleware order (outermost first): the drain (shutting down: 503 to every new request),
API keys, the tenants' limits, then the body size limit — so no unauthenticated, over-limit
or oversized request gets its body read.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loraserve.engine.async_engine import AsyncEngine
from loraserve.server import adapter_routes, serving
from loraserve.server.auth import AuthMiddleware
from loraserve.server.context import ServerContext
from loraserve.server.dashboard_routes import install_dashboard
from loraserve.server.drain import DrainMiddleware
from loraserve.server.errors import install_error_handlers, retry_headers
from loraserve.server.limits import BodyLimitMiddleware
from loraserve.server.openapi import openapi_schema
from loraserve.server.quotas import QuotaMiddleware, TenantCollector
from loraserve.server.settings import ServerSettings
from loraserve.server.tenant_routes import reload_api_keys
from loraserve.server.upload import UPLOAD_PATHS


def create_app(async_engine: AsyncEngine, settings: ServerSettings | None = None,
               enforce_quotas: bool = True) -> FastAPI:
    """`enforce_quotas=False`: a replica behind an ingress, which enforces them for all."""
    settings = settings or ServerSettings()
    ctx = ServerContext(async_engine, settings)
    if enforce_quotas:
        ctx.metrics.registry.register(TenantCollector(ctx.quotas, ctx.keys))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="loraserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    # add_middleware prepends: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes,
                       streamed_paths=UPLOAD_PATHS)
    if enforce_quotas:
        app.add_middleware(QuotaMiddleware, gate=ctx.quotas)
    app.add_middleware(AuthMiddleware, settings=settings, keys=ctx.keys)
    app.add_middleware(DrainMiddleware, ctx=ctx)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503,
                                headers=retry_headers(503))
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(ctx, request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        snap = await async_engine.snapshot()
        cards = adapter_routes.model_cards(ctx, snap, request.state.operator,
                                           request.state.tenant)
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/reload_api_keys")
    async def reload_keys() -> Response:
        return reload_api_keys(ctx)

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/load_lora_adapter", _bind(adapter_routes.load, ctx),
                          methods=["POST"])
        app.add_api_route(f"{prefix}/unload_lora_adapter", _bind(adapter_routes.unload, ctx),
                          methods=["POST"])
        app.add_api_route(f"{prefix}/upload_lora_adapter", _bind(adapter_routes.upload, ctx),
                          methods=["POST"])

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = await async_engine.snapshot()
        return Response(ctx.metrics.render(snap),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/state")
    async def debug_state() -> Response:
        snap = await async_engine.snapshot()
        return JSONResponse({
            "kv_blocks_used": snap.kv_blocks_used,
            "kv_blocks_free": snap.kv_blocks_total - snap.kv_blocks_used,
            "kv_blocks_total": snap.kv_blocks_total,
            "running": snap.running, "waiting": snap.waiting, "paused": snap.paused,
            "engine_errors": async_engine.errors,
            "adapters": [{"name": a.name, "uid": a.uid, "tier": a.tier, "pinned": a.pinned,
                          "refcount": a.refcount, "registered": a.registered,
                          "last_error": a.last_error} for a in snap.adapters],
        })

    install_dashboard(app, settings)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(openapi_schema(app))

    @app.get("/debug/invariants")
    async def debug_invariants() -> Response:
        # A violation is our bug, but the report is the answer asked for: 200 with ok=false.
        report = await async_engine.check_invariants()
        return JSONResponse(report.as_dict())

    return app


def _bind(handler, ctx: ServerContext):
    async def route(request: Request) -> Response:
        return await handler(ctx, request)

    route.__name__ = handler.__name__
    return route
