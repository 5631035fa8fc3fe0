"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2/3) for a flat token batch.

What differs between those families is data, not code paths: biases live in the `Linear`s,
rope scaling in the cos/sin tables; Qwen3's q/k norms and SmolLM3's NoPE layers are one
per-layer check each (model/families.py decides which family needs what).

The step batch is flat: `T` tokens of many sequences, each with its position. q/k/v and
gate/up are fused into one matmul each; LoRA deltas are added to those fused outputs by a
hook that sees only slot indices, never adapter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from loraserve.config import ModelConfig
from loraserve.model.attention import AttentionBackend
from loraserve.model.layers import RotaryEmbedding, apply_rope, rms_norm
from loraserve.model.linear import Linear
from loraserve.model.rope import inv_freq


class LoraHook(Protocol):
    """Adds LoRA deltas in place: `y += delta(x)` for the module group of one layer."""

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None: ...


@dataclass
class LayerWeights:
    """Projections are `Linear`s (packed for the fastest GEMM, see linear.py)."""

    input_norm: torch.Tensor  # [d]
    qkv: Linear  # d -> q + 2*kv   fused q_proj, k_proj, v_proj
    o: Linear  # q -> d
    post_norm: torch.Tensor  # [d]
    gate_up: Linear  # d -> 2*inter  fused gate_proj, up_proj
    down: Linear  # inter -> d
    # [nh + kvh, hd]: q_norm's weight once per q head, then k_norm's per kv head (Qwen3)
    qk_norm: torch.Tensor | None = None
    rope: bool = True  # False: a NoPE layer (SmolLM3) keeps q and k unrotated


class LlamaModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: Linear):
        self.config = config
        self.embed = embed  # [V, d]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # d -> V (its own packed copy of embed when tied)
        c = config
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.inter = c.intermediate_size
        self.scale = c.head_dim**-0.5
        # tables in the model's dtype and on its device, as embed is
        self.rope = RotaryEmbedding(inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                                    c.max_position_embeddings, c.rope_scaling.attention_factor,
                                    dtype=embed.dtype, device=embed.device)

    # --- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer ([S, kvh, hd] x 2)
        attention: AttentionBackend,
        attn_meta: object,  # what attention.prepare built for this step
        logits_rows: torch.Tensor,  # [B] rows whose next-token logits are wanted
        lora: LoraHook | None = None,
    ) -> torch.Tensor:  # [B, V]
        c = self.config
        h = F.embedding(input_ids, self.embed)  # [T, d]
        cos, sin = self.rope.tables(positions)
        nh, kvh, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_size, kv_size, eps = self.q_size, self.kv_size, c.rms_norm_eps
        for li, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm(h, w.input_norm, eps)
            qkv = w.qkv(x)  # [T, q + 2kv]
            if lora is not None:
                lora(li, "qkv", x, qkv)
            # Rotate q and k in one go: [T, nh + kvh, hd] (half the small ops per layer).
            qk = qkv[:, : q_size + kv_size].reshape(-1, nh + kvh, hd)
            if w.qk_norm is not None:  # per-head RMSNorm before RoPE, as Qwen3 does
                qk = torch.rms_norm(qk, (hd,), None, eps) * w.qk_norm
            if w.rope:
                qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, q_size + kv_size :].reshape(-1, kvh, hd)
            a = attention.forward(q, k, v, k_cache, v_cache, attn_meta, self.scale)
            a = a.reshape(-1, q_size)
            o = w.o(a)  # [T, d]
            if lora is not None:
                lora(li, "o", a, o)
            h = h + o
            x = rms_norm(h, w.post_norm, eps)
            gu = w.gate_up(x)  # [T, 2*inter]
            if lora is not None:
                lora(li, "gate_up", x, gu)
            gate, up = gu.split((self.inter, self.inter), dim=-1)
            m = F.silu(gate) * up  # [T, inter]
            d = w.down(m)
            if lora is not None:
                lora(li, "down", m, d)
            h = h + d
        h = rms_norm(h[logits_rows], self.final_norm, eps)  # only rows that sample a token
        return self.lm_head(h)
