"""Small building blocks of a Llama decoder: RMSNorm and rotary embeddings."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, d]; float32 throughout (the engine runs float32 on CPU).
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, hd]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
