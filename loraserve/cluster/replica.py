"""One engine replica: the single server's engine and app, driven by the ingress.

Every request the ingress forwards runs through the same FastAPI app `loraserve serve` runs
(server/app.py), in-process, so answers and errors are the single server's. Before serving,
the replica catches up with the adapter registry if the request says it is behind.

Ray Serve multiplexing: the multiplexed model id is the adapter's name. Its loader is a cheap
"this adapter is registered here" check that never touches weights: the replica's
AdapterStore stays the only authority on residency (it loads on admission, evicts LRU within
max_loaded_loras). Ray's cache gets the same capacity, so what it reports to the routers (the
adapters this replica served last) follows the store's LRU; when Ray drops an adapter from its
cache it only forgets it for routing: the store evicts on its own rules.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

from ray import serve

from loraserve.cluster.asgi_bridge import HttpReply, HttpRequest, call_app, stream_app
from loraserve.cluster.registry import EMPTY, RegistryEntry, RegistryState, RegistryVersion
from loraserve.cluster.spec import ClusterSpec
from loraserve.server.adapter_routes import resolve_path
from loraserve.server.errors import ApiError
from loraserve.types import AdapterNotFoundError, LoraServeError

log = logging.getLogger("loraserve.cluster")
ADAPTER_ROUTES = ("/load_lora_adapter", "/unload_lora_adapter")


class _Residency:
    """What Ray's multiplex cache holds for an adapter: its name, no weights."""

    def __init__(self, name: str):
        self.name = name
        # Ray awaits `model.__del__` when its LRU drops the entry: advisory only (see above)
        self.__del__ = self._forget

    async def _forget(self) -> None:
        log.debug("Ray's multiplex cache dropped %s; the adapter store decides its residency",
                  self.name)


class EngineReplica:
    async def __init__(self, spec: ClusterSpec, registry):
        from loraserve.engine.async_engine import AsyncEngine
        from loraserve.engine.engine import LLMEngine
        from loraserve.server.app import create_app
        from loraserve.server.startup_heap import freeze_startup_heap

        config = spec.engine
        if config.num_threads is None:  # one torch thread per reserved CPU, not all cores
            config = replace(config, num_threads=max(1, int(spec.cluster.replica_cpus)))
        engine = await asyncio.get_running_loop().run_in_executor(
            None, LLMEngine, spec.model, config)
        self.aengine = AsyncEngine(engine)
        self.aengine.start()  # the app's lifespan does this on a direct server
        # the ingress enforces the tenants' limits for the whole deployment
        self.app = create_app(self.aengine, spec.settings, enforce_quotas=False)
        self.ctx = self.app.state.ctx
        freeze_startup_heap()  # this actor's process serves for its whole life
        self.spec = spec
        self.registry = registry
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.names: set[str] = set()  # adapters registered here (kept by our own calls)
        self.synced: RegistryState = EMPTY
        self._old_epochs: set[str] = set()
        self._lock = asyncio.Lock()  # one adapter change at a time on this replica
        cap = spec.engine.max_loaded_loras or -1

        async def residency(name: str) -> _Residency:
            return _Residency(name)

        self.residency = serve.multiplexed(max_num_models_per_replica=cap)(residency)
        await self.sync(None, strict=True)  # replay the registry: --lora-paths and later loads

    # --- called by the ingress --------------------------------------------------------------
    def info(self, target: str | None = None) -> dict:
        return {"replica": self.replica_id, "model_name": self.ctx.model_name,
                "base_names": sorted(self.ctx.base_names)}

    async def handle_http(self, req: HttpRequest, want: RegistryVersion | None = None,
                          adapter: str = "", target: str | None = None):
        """A client request (streamed back: the head, then body chunks)."""
        await self.sync(want)
        if adapter and adapter in self.names:
            await self.residency(adapter)  # tells Ray's routers this replica holds it
        async for item in stream_app(self.app, req):
            yield item

    async def control(self, req: HttpRequest, want: RegistryVersion | None = None,
                      target: str | None = None) -> HttpReply:
        """A fan-out call (load, unload, models, metrics), answered whole."""
        await self.sync(want)
        if not req.path.endswith(ADAPTER_ROUTES):
            return await call_app(self.app, req)
        async with self._lock:
            reply = await call_app(self.app, req)
        if reply.ok:
            name = json.loads(req.body)["lora_name"]
            if req.path.endswith("/unload_lora_adapter"):
                self.names.discard(name)
            else:
                self.names.add(name)
        return reply

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()

    # --- the registry -----------------------------------------------------------------------
    async def sync(self, want: RegistryVersion | None, strict: bool = False) -> None:
        """Apply the registry if `want` is newer than what this replica applied (None: only
        at start-up, `strict`: a registered adapter that fails to load fails the replica)."""
        if not strict and self._covers(want):
            return
        async with self._lock:
            if not strict and self._covers(want):
                return
            state: RegistryState = await self.registry.state.remote()
            if want is not None and state.at.epoch != want.epoch:
                # the registry restarted since the ingress last wrote to it: its state is the
                # truth, and asking again for that old version would pull on every request
                self._old_epochs.add(want.epoch)
            old = self.synced.entries
            restarted = self.synced is not EMPTY and state.at.epoch != self.synced.at.epoch
            for name in old.keys() - state.entries.keys():
                if restarted:  # a fresh registry forgot runtime loads: keep serving them
                    log.warning("the adapter registry restarted without %s; %s keeps it",
                                name, self.replica_id)
                    continue
                await self._unload(name)
            for name, entry in state.entries.items():
                if old.get(name) == entry:
                    continue
                try:
                    await self._load(name, entry)
                except (LoraServeError, ApiError, OSError) as e:
                    if strict:
                        raise RuntimeError(f"adapter {name} ({entry.lora_path}): {e}") from e
                    log.warning("replica %s could not load %s from the registry: %s",
                                self.replica_id, name, e)
            self.synced = state

    def _covers(self, want: RegistryVersion | None) -> bool:
        return self.synced.at.covers(want) or want.epoch in self._old_epochs

    async def _load(self, name: str, entry: RegistryEntry) -> None:
        """The registry's version of `name`, under its number (a replace if another version
        is here already)."""
        root = self.spec.settings.lora_root
        snap = await self.aengine.snapshot()
        live = {a.version for a in snap.adapters if a.name == name and a.registered}
        path = resolve_path(entry.lora_path, root)
        if entry.version not in live:
            await self.aengine.load_lora_adapter(name, path, pinned=entry.pinned, root=root,
                                                 replace=bool(live), version=entry.version)
        elif entry.pinned:  # the same version: at most a pin to apply (a no-op load pins it)
            await self.aengine.load_lora_adapter(name, path, pinned=True, root=root)
        self.names.add(name)

    async def _unload(self, name: str) -> None:
        self.names.discard(name)
        try:
            await self.aengine.unload_lora_adapter(name)
        except AdapterNotFoundError:
            pass
