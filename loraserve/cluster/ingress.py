"""The cluster's front door: one OpenAI-compatible app over N engine replicas.

The same keys and body limit as the single server are checked here first (the replicas check
them again: they run the single server's app, which also applies each tenant's adapter scope).
The tenants' limits are enforced here only, so they hold for the whole deployment; each
replica reports what a request used with its answer. Completions are routed by adapter (Ray Serve
multiplexing, routing.py) and relayed as they stream; the model list, metrics and debug views
gather every replica; load/unload go to every replica or none (adapter_ops.py); the dashboard's
files are served here, and the page's fetches come back to these routes; anything else
goes to one replica, whose app answers it as a single server would (404, 405, OpenAPI).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from ray import serve

from loraserve.cluster import adapter_ops
from loraserve.cluster.aggregate import relabel_metrics
from loraserve.cluster.fanout import Replicas
from loraserve.cluster.relay import relay, reply_response, to_http_request
from loraserve.cluster.routing import routing_key
from loraserve.cluster.spec import ENGINE_DEPLOYMENT, ClusterSpec
from loraserve.server.api_keys import KeyFileError, KeyRing
from loraserve.server.auth import AuthMiddleware
from loraserve.server.dashboard_routes import install_dashboard
from loraserve.server.errors import ApiError, install_error_handlers, retry_headers
from loraserve.server.limits import BodyLimitMiddleware
from loraserve.server.quotas import QuotaGate, QuotaMiddleware, TenantCollector

_ANY = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@serve.ingress()
class Ingress:
    async def __init__(self, engines, registry, spec: ClusterSpec):
        self.spec = spec
        self.registry = registry
        s = spec.settings
        self.keys = KeyRing(s.api_keys_file, (s.api_key, s.admin_api_key))
        self.quotas = QuotaGate()
        app_name = serve.get_replica_context().app_name
        self.replicas = Replicas(engines, app_name, ENGINE_DEPLOYMENT, spec.control_timeout_s)
        info = await self.replicas.info()  # also starts the router that lists the replicas
        self.base_names = frozenset(info["base_names"])
        self.at = (await registry.state.remote()).at  # the registry version requests carry
        self.lock = asyncio.Lock()
        await self.replicas.wait_for_replicas()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self)

    async def forward(self, request: Request, routed: bool) -> Response:
        body = await request.body()
        adapter = routing_key(_model_of(body), self.base_names) if routed else ""
        req = to_http_request(request, body)
        return await relay(lambda: self.replicas.stream(req, self.at, adapter), request,
                           self.spec.settings.disconnect_poll_s)

    async def gather(self, request: Request, path: str):
        """Every replica's answer to GET `path` with this caller's credentials, or the first
        refusal as the response to give."""
        req = to_http_request(request, b"").with_body(path, b"", "GET")
        replies = {rid: r for rid, r in (await self.replicas.control_all(req, None)).items()
                   if r is not None}
        for reply in replies.values():
            if not reply.ok:
                return None, reply_response(reply)
        return replies, None


def build_app(ing: Ingress) -> FastAPI:
    settings = ing.spec.settings
    app = FastAPI(title="loraserve cluster", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(QuotaMiddleware, gate=ing.quotas)
    app.add_middleware(AuthMiddleware, settings=settings, keys=ing.keys)

    @app.get("/health")
    async def health() -> Response:
        n = len(ing.replicas.ids())
        if not n:
            return JSONResponse({"status": "no engine replica running"}, status_code=503,
                                headers=retry_headers(503))
        return JSONResponse({"status": "ok", "replicas": n})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await ing.forward(request, routed=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await ing.forward(request, routed=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        cards, refusal = await adapter_ops.merged_models(ing, to_http_request(request, b""))
        if refusal is not None:
            return reply_response(refusal)
        return JSONResponse({"object": "list", "data": cards})

    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/load_lora_adapter", _bind(adapter_ops.load, ing),
                          methods=["POST"])
        app.add_api_route(f"{prefix}/upload_lora_adapter", _bind(adapter_ops.refuse_upload, ing),
                          methods=["POST"])
        app.add_api_route(f"{prefix}/unload_lora_adapter", _bind(adapter_ops.unload, ing),
                          methods=["POST"])

    @app.post("/v1/reload_api_keys")
    async def reload_api_keys(request: Request) -> Response:
        """The ingress's keys (scope and limits here), then every replica's (scope there)."""
        try:
            table = ing.keys.reload()
        except KeyFileError as e:
            raise ApiError(400, f"{e}; the keys in force stay", "invalid_api_keys_file") from e
        req = to_http_request(request, b"{}")
        for reply in (await ing.replicas.control_all(req, None)).values():
            if reply is not None and not reply.ok:
                return reply_response(reply)
        return JSONResponse({"success": True, "tenants": sorted(table.tenants)})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        replies, refusal = await ing.gather(request, "/metrics")
        if refusal is not None:
            return refusal
        tenants = CollectorRegistry()
        tenants.register(TenantCollector(ing.quotas, ing.keys))
        extra = generate_latest(tenants).decode() + (
                 "# HELP loraserve_cluster_replicas Engine replicas running\n"
                 "# TYPE loraserve_cluster_replicas gauge\n"
                 f"loraserve_cluster_replicas {len(replies)}\n"
                 "# HELP loraserve_cluster_registry_version Adapter changes committed\n"
                 "# TYPE loraserve_cluster_registry_version gauge\n"
                 f"loraserve_cluster_registry_version {ing.at.version}\n")
        text = relabel_metrics({rid: r.body.decode() for rid, r in replies.items()}, extra)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/state")
    async def debug_state(request: Request) -> Response:
        replies, refusal = await ing.gather(request, "/debug/state")
        if refusal is not None:
            return refusal
        return JSONResponse({"replicas": {rid: json.loads(r.body) for rid, r in
                                          replies.items()}, "registry_version": ing.at.version})

    @app.get("/debug/invariants")
    async def debug_invariants(request: Request) -> Response:
        replies, refusal = await ing.gather(request, "/debug/invariants")
        if refusal is not None:
            return refusal
        reports = {rid: json.loads(r.body) for rid, r in replies.items()}
        return JSONResponse({"ok": all(r.get("ok") for r in reports.values()),
                             "replicas": reports})

    install_dashboard(app, settings)  # the same page; the ingress's routes answer its fetches

    @app.api_route("/{path:path}", methods=_ANY, include_in_schema=False)
    async def anything_else(request: Request) -> Response:
        return await ing.forward(request, routed=False)

    return app


def _model_of(body: bytes) -> object:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("model") if isinstance(data, dict) else None


def _bind(handler, ing: Ingress):
    async def route(request: Request) -> Response:
        return await handler(ing, request)

    route.__name__ = handler.__name__
    return route
