"""Llama-family decoder (Llama, Mistral, Qwen2/3, SmolLM2/3, Gemma 1-3, Phi-3, Granite,
OLMo 2, and with experts (model/moe.py) Qwen2/3-MoE, OLMoE, Mixtral) for a flat token batch.

What differs between those families is data, not code paths: biases live in the `Linear`s,
rope scaling in the cos/sin tables, norm offsets and embedding scales are folded into the
weights at load (model/loader.py), multipliers and soft-caps are per-model floats, sliding
windows and rope tables per-layer values; optional norms (Qwen3's and OLMo 2's q/k norms,
Gemma's and OLMo 2's norms on block outputs, OLMo 2's missing input norms) are one per-layer
check each. model/families.py decides which family needs what.

The step batch is flat: `T` tokens of many sequences, each with its position. q/k/v and
gate/up are fused into one matmul each; LoRA deltas are added to those fused outputs by a
hook that sees only slot indices, never adapter names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F

from loraserve.config import ModelConfig, RopeScaling
from loraserve.model.attention import AttentionBackend
from loraserve.model.layers import RotaryEmbedding, rms_norm
from loraserve.model.linear import Linear
from loraserve.model.moe import ExpertLoraHook, MoeWeights, moe_forward, shared_gate
from loraserve.model.native_decode import NativeDecode
from loraserve.model.rope import inv_freq
from loraserve.ops.elementwise import add_rms_norm_, silu_mul
from loraserve.ops.native_lora import NativeLoraStep


class LoraHook(ExpertLoraHook, Protocol):
    """Adds LoRA deltas for the module group of one layer: `project` returns `linear(x)` with
    them added (fused into the GEMM where the backend can); calling it adds them to y;
    `expert_runs` places expert LoRA inside a mixture-of-experts layer (model/moe.py).
    `embed` and `head` are the embedding lookup and the output layer with the adapters' parts
    there (embedding/lm_head LoRA, their own copies, trainable tokens) on their rows."""

    def __call__(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None: ...

    def project(self, layer: int, group: str, x: torch.Tensor,
                linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor: ...

    def head(self, rows: torch.Tensor, x: torch.Tensor,
             lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...

    def native(self) -> NativeLoraStep | None:
        """The step's LoRA op as the C decode loop calls it after each projection; None
        where the backend has no such view or the step's adapters need more than B @ A."""


@dataclass
class LayerWeights:
    """Projections are `Linear`s (packed for the fastest GEMM, see linear.py). Norm weights
    already include the family's offset."""

    input_norm: torch.Tensor | None  # [d]; None: attention reads h itself (OLMo 2)
    qkv: Linear  # d -> q + 2*kv   fused q_proj, k_proj, v_proj
    o: Linear  # q -> d
    post_norm: torch.Tensor | None  # [d] before the MLP; None: the MLP reads h (OLMo 2)
    # d -> 2*inter fused gate_proj, up_proj; inter -> d. None: no dense MLP (experts only)
    gate_up: Linear | None
    down: Linear | None
    # [nh + kvh, hd]: q_norm's weight once per q head, then k_norm's per kv head (Qwen3)
    qk_norm: torch.Tensor | None = None
    # ([q], [kv]): RMSNorm weights over the whole q and k projections (OLMo 2)
    qk_full_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    attn_out_norm: torch.Tensor | None = None  # [d] on o's output (Gemma 2/3, OLMo 2)
    mlp_out_norm: torch.Tensor | None = None  # [d] on down's output
    rope: int | None = 0  # which of the model's rope tables; None: NoPE (SmolLM3)
    window: int = 0  # sliding window of this layer's attention; 0: the whole context
    moe: MoeWeights | None = None  # routed experts; the dense MLP is then the shared expert


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def _act_mul(act, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split((inter, inter), dim=-1)
    return act(gate) * up  # [T, inter]


class LlamaModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: Linear):
        self.config = config
        self.embed = embed  # [V, d], the family's embedding scale already applied
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # d -> V (its own packed copy of the unscaled embed when tied)
        c = config
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.inter = c.intermediate_size
        self.scale = c.head_dim**-0.5 if c.attn_scale is None else c.attn_scale
        # act(gate) * up: fused for SiLU (ops/elementwise.py), chosen once, not per layer
        self.act_mul = (silu_mul if c.hidden_act == "silu"
                        else partial(_act_mul, _ACTIVATIONS[c.hidden_act]))
        # tables in the model's dtype and on its device, as embed is: [0] global, [1] local
        kw = dict(dtype=embed.dtype, device=embed.device)
        self.ropes = [RotaryEmbedding(inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                                      c.max_position_embeddings,
                                      c.rope_scaling.attention_factor, **kw)]
        if c.local_rope_layers:
            self.ropes.append(RotaryEmbedding(
                inv_freq(c.head_dim, c.local_rope_theta, RopeScaling()),
                c.max_position_embeddings, **kw))
        # decode-only base-only steps in one C call where the model's layers allow it
        self.native = NativeDecode.build(self)

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
        # [T, d]
        h = F.embedding(input_ids, self.embed) if lora is None else lora.embed(input_ids,
                                                                                self.embed)
        native = self.native
        if native is not None and native.fits(attention, attn_meta, positions,
                                              self.ropes[0].max_positions):
            native_lora = None if lora is None or not native.takes_lora else lora.native()
            if lora is None or native_lora is not None:
                native.run(h, positions, kv_caches, attention, attn_meta, native_lora)
                return self._logits(h, logits_rows, lora)
        rotate = [r.rotator(positions) for r in self.ropes]  # [0] global, [1] local
        nh, kvh, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_size, kv_size, eps = self.q_size, self.kv_size, c.rms_norm_eps
        res, softcap = c.residual_multiplier, c.attn_softcap
        first = self.layers[0].input_norm
        x = h if first is None else rms_norm(h, first, eps)
        # Residual adds are in place into h (a fresh tensor), each fused with the norm after
        # it; x is h itself where a family has no norm there, and is used up before h changes.
        for li, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = w.qkv(x) if lora is None else lora.project(li, "qkv", x, w.qkv)
            if w.qk_full_norm is not None:  # OLMo 2: over all heads at once, before RoPE
                qkv[:, :q_size] = rms_norm(qkv[:, :q_size], w.qk_full_norm[0], eps)
                qkv[:, q_size : q_size + kv_size] = rms_norm(
                    qkv[:, q_size : q_size + kv_size], w.qk_full_norm[1], eps)
            # Rotate q and k in one go: [T, nh + kvh, hd] (half the small ops per layer).
            qk = qkv[:, : q_size + kv_size].reshape(-1, nh + kvh, hd)
            if w.qk_norm is not None:  # per-head RMSNorm before RoPE, as Qwen3 does
                qk = torch.rms_norm(qk, (hd,), None, eps) * w.qk_norm
            if w.rope is not None:
                qk = rotate[w.rope](qk)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, q_size + kv_size :].reshape(-1, kvh, hd)
            a = attention.forward(q, k, v, k_cache, v_cache, attn_meta, self.scale, w.window,
                                  softcap)
            a = a.reshape(-1, q_size)
            o = w.o(a) if lora is None else lora.project(li, "o", a, w.o)
            if w.attn_out_norm is not None:
                o = rms_norm(o, w.attn_out_norm, eps)
            x = add_rms_norm_(h, o, res, w.post_norm, eps)
            d = None if w.gate_up is None else self._mlp(li, w, x, lora)
            if w.moe is not None:
                routed = moe_forward(x, w.moe, self.act_mul, li, lora)
                d = routed if d is None else routed + shared_gate(x, w.moe) * d
            if w.mlp_out_norm is not None:
                d = rms_norm(d, w.mlp_out_norm, eps)
            nxt = self.layers[li + 1].input_norm if li + 1 < len(self.layers) else None
            x = add_rms_norm_(h, d, res, nxt, eps)
        return self._logits(h, logits_rows, lora)

    def _logits(self, h: torch.Tensor, logits_rows: torch.Tensor, lora: LoraHook | None
                ) -> torch.Tensor:
        c = self.config
        h = rms_norm(h[logits_rows], self.final_norm, c.rms_norm_eps)  # rows that sample
        logits = self.lm_head(h) if lora is None else lora.head(logits_rows, h, self.lm_head)
        if c.logits_scaling != 1.0:  # once per step, not per layer
            logits = logits / c.logits_scaling
        if c.final_softcap:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def _mlp(self, li: int, w: LayerWeights, x: torch.Tensor, lora: LoraHook | None
             ) -> torch.Tensor:
        """The dense gated MLP (a shared expert in a mixture-of-experts layer)."""
        gu = w.gate_up(x) if lora is None else lora.project(li, "gate_up", x, w.gate_up)
        m = self.act_mul(gu, self.inter)  # [T, inter]
        return w.down(m) if lora is None else lora.project(li, "down", m, w.down)
