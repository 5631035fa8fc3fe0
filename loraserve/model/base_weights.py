"""A loaded model's weights by PEFT's module names, for adapter reads that need them
(adapters/peft/base_weights.py): as float32 host tensors (the reader works on the host),
unpacked on demand from the packed projections, one fused projection kept at a time, so
nothing of the model's size stays allocated."""

from __future__ import annotations

import threading

import torch

from loraserve.model.llama import LlamaModel

# PEFT module -> (the model's fused projection, index of its part in it)
_PARTS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
          "qkv_proj": ("qkv", None), "o_proj": ("o", None), "gate_proj": ("gate_up", 0),
          "up_proj": ("gate_up", 1), "gate_up_proj": ("gate_up", None),
          "down_proj": ("down", None)}


class ModelBaseWeights:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        c = model.config
        self._splits = {"qkv": (model.q_size, model.kv_size, model.kv_size),
                        "gate_up": (c.intermediate_size, c.intermediate_size)}
        self._last: tuple[tuple[int, str], torch.Tensor] | None = None
        self._lock = threading.Lock()  # adapters are read on several loader threads

    def module(self, layer: int, module: str) -> torch.Tensor:
        group, part = _PARTS[module]
        with self._lock:
            if self._last is None or self._last[0] != (layer, group):
                w = getattr(self.model.layers[layer], group).weight.to("cpu", torch.float32)
                self._last = ((layer, group), w)
            w = self._last[1]
        return w if part is None else w.split(self._splits[group])[part]

    def embed(self) -> torch.Tensor:
        return self.model.embed.to("cpu", torch.float32)

    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight.to("cpu", torch.float32)
