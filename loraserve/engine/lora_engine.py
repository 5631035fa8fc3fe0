"""The engine with adapters: name -> uid at admission, slots bound per step, LoRA in the step.

Adapter commands (load, unload) mutate the store; they run on the engine's own thread,
between steps (the async engine queues them), so a step never sees a half-changed store.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

from loraserve.adapters.format import read_adapter
from loraserve.adapters.host_cache import HostLoader
from loraserve.adapters.prefetch import Prefetcher
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.adapters.store import AdapterStore
from loraserve.config import EngineConfig
from loraserve.engine.engine import LLMEngine
from loraserve.lora import sgmv_cpu
from loraserve.lora.batch import LoraBatch
from loraserve.lora.ops import apply_lora
from loraserve.model.linear import gemm_backend
from loraserve.request import Request
from loraserve.types import RequestOutput

# Every LoRA segment runs in the C kernel when it could be built: it is 2.3-2.7x faster than
# oneDNN's GEMMs on the torch path even for one 2048-token prompt (ranks 8-64,
# benchmarks/lora_op_micro.py --tokens 2048 --adapters 1). The torch path is the fallback.
KERNEL_MAX_TOKENS = 2**62


class LoraEngine(LLMEngine):
    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None):
        super().__init__(model, config)
        c = self.config
        self.slot_pool = LoraSlotPool(self.model_config, c.num_lora_slots, c.max_lora_rank,
                                      dtype=c.lora_torch_dtype)
        loader = HostLoader(self.read_adapter)
        self.adapters = AdapterStore(self.slot_pool, loader,
                                     max_loras_per_batch=c.max_loras_per_batch,
                                     max_loaded_loras=c.max_loaded_loras)
        self.scheduler.gate = self.adapters
        self.prefetcher = Prefetcher(self.adapters, c.max_loras_prefetch)
        self._slot_by_uid: dict[int, int] = {}

    # --- adapter commands -------------------------------------------------------------------
    def read_adapter(self, path: str | os.PathLike):
        """Read and fully validate an adapter (any thread; touches no engine state)."""
        return read_adapter(path, self.model_config, max_lora_rank=self.config.max_lora_rank,
                            allow_pickle=self.config.allow_pickle_adapters)

    def load_lora_adapter(self, name: str, path: str | os.PathLike, pinned: bool = False,
                          weights=None) -> None:
        """Register `name`. `weights` may be pre-read off-thread; else it is read here."""
        path = str(path)
        if self.adapters.check_new(name, path, pinned):
            self.adapters.register(name, path, None, pinned)  # same name+path: maybe pin it
            return
        weights = weights if weights is not None else self.read_adapter(path)
        self.adapters.register(name, path, weights, pinned)

    def unload_lora_adapter(self, name: str) -> None:
        self.adapters.unregister(name)

    def list_adapters(self) -> list[dict]:
        return [
            {"name": e.name, "uid": e.uid, "path": e.path, "tier": e.tier, "pinned": e.pinned,
             "rank": e.weights.rank if e.weights else None, "in_flight": e.refcount}
            for e in self.adapters.registered()
        ]

    # --- hooks of the base engine -----------------------------------------------------------
    def resolve_adapter(self, lora_name: str | None) -> int | None:
        if lora_name is None:
            return None
        return self.adapters.acquire(lora_name)  # 404 for a name never loaded

    def _release_adapter(self, req: Request) -> None:
        if req.adapter_uid is not None:
            uid, req.adapter_uid = req.adapter_uid, None  # exactly once, even if called again
            self.adapters.release(uid)

    def step(self) -> list[RequestOutput]:
        self.adapters.poll_loads()
        self._protect_running()
        self.prefetcher.step(self.scheduler.waiting_uids())
        outputs = self._run_step()
        # bind() narrowed the protected set to this step's batch; between steps (loads,
        # unloads) exactly the adapters of running requests are protected from eviction.
        self._protect_running()
        if not outputs and self.scheduler.has_work and not self.scheduler.running:
            self.adapters.loader.wait_any(timeout=0.05)  # only waiting on adapter loads
        return outputs

    def _protect_running(self) -> None:
        self.adapters.running_uids = {u for u in self.scheduler.running_uids() if u is not None}

    def _run_step(self) -> list[RequestOutput]:
        return super().step()

    def _bind(self, uids: set[int]) -> None:
        self._slot_by_uid = self.adapters.bind(uids)

    def _slot_of(self, req: Request) -> int:
        return -1 if req.adapter_uid is None else self._slot_by_uid[req.adapter_uid]

    def _lora_factory(self):
        return partial(_make_hook, self.slot_pool, sgmv_cpu.load(self.slot_pool.dtype))


def _make_hook(pool: LoraSlotPool, kernel, segments: list[tuple[int, int]]):
    batch = LoraBatch.build(segments, pool, KERNEL_MAX_TOKENS if kernel is not None else 0,
                            onednn=gemm_backend() == "onednn")
    if batch.is_empty:
        return None  # base-only step: LoRA costs nothing

    def hook(layer: int, group: str, x, y) -> None:
        apply_lora(x, y, pool.A[layer][group], pool.B[layer][group], batch, group, kernel)

    return hook
