"""Adapter registration on the engine: read and validate an adapter (any thread), register a
name or a new version of it, unload it. Mixed into `LLMEngine` (engine/engine.py); register and
unload run between steps, on the engine thread."""

from __future__ import annotations

import os
import time

from loraserve.adapters.format import LoraAdapterWeights, read_adapter
from loraserve.adapters.peft.budget import LoadBudget


class AdapterAdmin:
    def read_adapter(self, path: str | os.PathLike, root: str | None = None,
                     budget: LoadBudget | None = None) -> LoraAdapterWeights:
        """Read and fully validate an adapter (any thread; touches no engine state, reads the
        model's weights only: DoRA's norms). `root`: every file read must resolve inside it;
        `budget`: the load's time bound and cancel switch (a fresh one by default)."""
        return read_adapter(path, self.model_config, max_lora_rank=self.config.max_lora_rank,
                            allow_pickle=self.config.allow_pickle_adapters, root=root,
                            base=self.base_weights, budget=budget)

    def load_lora_adapter(self, name: str, path: str | os.PathLike, pinned: bool = False,
                          weights: LoraAdapterWeights | None = None, *, replace: bool = False,
                          version: int | None = None, owned: bool = False) -> int:
        """Register `name` (with `replace`: a new version of it). `weights` may be pre-read
        off-thread; else it is read here. Returns the version now serving under `name`."""
        path = str(path)
        read_s = None
        if weights is None and not self.store.check_new(name, path, pinned, replace):
            t0 = time.perf_counter()
            weights = self.read_adapter(path)
            read_s = time.perf_counter() - t0
        entry = self.store.register(name, path, weights, pinned,
                                    in_use=self.scheduler.running_adapters(), replace=replace,
                                    version=version, owned=owned)
        if read_s is not None:  # read here (at start-up): the registration is its first load
            entry.stats.last_load_seconds = entry.stats.total_load_seconds = read_s
        return entry.version

    def unload_lora_adapter(self, name: str) -> None:
        """Unload `name` (every version) or one version, `name@N`."""
        self.store.unregister(name)
