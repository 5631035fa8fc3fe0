"""Test helper: the loraserve cluster app on one small local Ray instance, and direct calls
to a single engine replica (to set up states the ingress would never create)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import httpx
from server_utils import free_port

REPO = Path(__file__).resolve().parents[1]
APP = "loraserve-test"
_apps = itertools.count(1)
_serve_port: int | None = None  # Serve's HTTP proxy, while this process's Ray instance runs


class LocalCluster:
    """The app, under a name of its own, behind Serve's proxy on a free port, on a local Ray
    instance (2 CPUs, no dashboard, a small object store). Starting Ray and Serve is much of
    what a cluster costs, so the first cluster of a process starts them and the next ones
    share them (the Makefile's run puts every cluster test in one process: tests/conftest.py);
    stop() deletes the app, stop_ray() ends Ray and Serve."""

    def __init__(self, spec):
        global _serve_port
        import ray
        from ray import serve

        from loraserve.cluster.launch import OBJECT_STORE_BYTES, deploy

        self.spec = spec
        self.app = f"{APP}-{next(_apps)}"
        if not ray.is_initialized():
            ray.init(num_cpus=max(2, spec.cluster.replicas), include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO),
                                               "TOKENIZERS_PARALLELISM": "false"}})
        # a port free a moment ago can be taken as the source port of one of Ray's own
        # connections before Serve's proxy binds it: then another port
        for attempt in range(3):
            self.port = _serve_port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            try:
                deploy(spec, "127.0.0.1", self.port, name=self.app)  # a running Serve is kept
                break
            except Exception as e:
                if "Failed to bind" not in str(e) or _serve_port or attempt == 2:
                    raise
                serve.shutdown()
        _serve_port = self.port
        self.wait_replicas(spec.cluster.replicas)

    def stop(self) -> None:
        from ray import serve

        serve.delete(self.app)

    # --- the replicas -----------------------------------------------------------------------
    def engine_handle(self):
        from ray import serve

        from loraserve.cluster.spec import ENGINE_DEPLOYMENT

        return serve.get_deployment_handle(ENGINE_DEPLOYMENT, self.app)

    def replica_ids(self) -> list[str]:
        """Live engine replicas as this process's router sees them."""
        from loraserve.cluster import live_replicas
        from loraserve.cluster.spec import ENGINE_DEPLOYMENT

        self.engine_handle().info.remote().result(timeout_s=60)  # starts the router
        return live_replicas.replica_ids(self.app, ENGINE_DEPLOYMENT) or []

    def replica_actor(self, rid: str):
        import ray

        from loraserve.cluster.spec import ENGINE_DEPLOYMENT

        return ray.get_actor(f"SERVE_REPLICA::{self.app}#{ENGINE_DEPLOYMENT}#{rid}",
                             namespace="serve")

    def wait_replicas(self, n: int, exclude: tuple[str, ...] = (), timeout: float = 120) -> list:
        """Block until the ingress reports n replicas (none of `exclude`) and they answer."""
        deadline = time.monotonic() + timeout
        key = self.spec.settings.admin_api_key or self.spec.settings.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while time.monotonic() < deadline:
            try:
                models = httpx.get(self.url + "/v1/models", timeout=10,
                                   headers=headers).json()["data"]
                ids = sorted(r["replica"] for r in models[0]["replicas"])
                if len(ids) == n and not set(ids) & set(exclude):
                    return ids
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{n} replicas not ready in {timeout}s")

    def call_replica(self, rid: str, path: str, body: dict | None = None):
        """POST (or GET without a body) straight to one replica's server app."""
        from loraserve.cluster.asgi_bridge import HttpRequest

        raw = json.dumps(body).encode() if body is not None else b""
        req = HttpRequest("POST" if body is not None else "GET", path,
                          headers=((b"content-type", b"application/json"),
                                   (b"content-length", str(len(raw)).encode())), body=raw)
        return self.engine_handle().control.remote(req, None, target=rid).result(timeout_s=60)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=60)


def stop_ray() -> None:
    """Serve and Ray, if this process runs them."""
    global _serve_port
    if "ray" not in sys.modules:
        return
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    _serve_port = None


def replicas_of(models: dict, model_id: str) -> dict[str, str]:
    """replica id -> tier of `model_id` in a /v1/models answer ({} if it is not listed)."""
    for card in models["data"]:
        if card["id"] == model_id:
            return {r["replica"]: r["tier"] for r in card["replicas"]}
    return {}
