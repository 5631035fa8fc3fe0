"""The base model's weights that some adapter kinds need when they are read: DoRA's column
norm takes the linear's weight, and PEFT saves a targeted embedding's base weight next to its
LoRA (kept only where it differs from the model's). The engine hands in the model's
(model/base_weights.py); the reader never imports the model."""

from __future__ import annotations

from typing import Protocol

import torch


class BaseWeights(Protocol):
    def module(self, layer: int, module: str) -> torch.Tensor:
        """[d_out, d_in] float32 weight of a decoder linear, by PEFT's module name (Phi-3's
        fused qkv_proj / gate_up_proj included)."""
        ...

    def embed(self) -> torch.Tensor:
        """[V, d] the embedding table as the model uses it (the embedding scale applied)."""
        ...

    def lm_head(self) -> torch.Tensor:
        """[V, d] the output layer's weight."""
        ...
