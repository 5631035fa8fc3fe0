"""Small building blocks of a Llama decoder: RMSNorm and rotary embeddings."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraserve.ops.elementwise import fused_for, gpu_rope_for, rms_norm, rope_

__all__ = ["RotaryEmbedding", "apply_rope", "rms_norm"]


class RotaryEmbedding:
    """Precomputed cos/sin tables (rotate-half layout) from per-pair inverse frequencies
    (model/rope.py: HF's default and scaled rope types)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0,
                 dtype=torch.float32, device: str | torch.device = "cpu"):
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq.to(torch.float64))  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        # `scaling` (yarn's attention factor) scales q and k alike, as transformers does
        self.cos = (emb.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scaling).to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, hd], broadcast over heads; computed once per step.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotator(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Once per step: a function rotating each layer's [T, heads, hd] q/k by `positions`,
        in place by a fused kernel (C on a CPU, Triton on a GPU: it reads the tables by
        position), else from tables gathered here once for every layer. (The GPU kernel does
        not check positions against the tables: that would read a value back to the host
        inside a captured graph; the engine never schedules past max_position_embeddings.)"""
        if fused_for(self.cos) and positions.device.type == "cpu":
            if positions.numel() and int(positions.max()) >= self.max_positions:
                raise ValueError(f"position {int(positions.max())} is past the rope tables "
                                 f"({self.max_positions})")
            return lambda x: rope_(x, positions, self.cos, self.sin)
        if positions.device == self.cos.device and gpu_rope_for(self.cos, self.sin):
            return lambda x: rope_(x, positions, self.cos, self.sin)
        cos, sin = self.tables(positions)
        return lambda x: apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, hd]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
