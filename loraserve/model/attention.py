"""Attention over the paged KV cache.

The cache of one layer is a flat tensor of token slots `[num_blocks * block_size, kv_heads, hd]`;
a sequence's K/V live in the slots its block table names. The runner turns block tables into
slot indices once per step (`AttentionMetadata`), so every layer only gathers and computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """A sequence that feeds several tokens this step (a prompt, a chunk, or a recompute)."""

    start: int  # first of its tokens in the flat step batch
    end: int
    ctx_slots: torch.Tensor | None  # [ctx] cache slots of all its context; None: no prior context
    ctx_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    decode_rows: torch.Tensor | None  # [Bd] row in the flat batch of each 1-token sequence
    decode_slots: torch.Tensor | None  # [Bd, Lmax] cache slots of their context (padded)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] True where a slot is real context
    decode_contiguous: bool  # decode rows are exactly 0..Bd-1 (no gather/scatter needed)
    prefills: list[PrefillSeq]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # cache: [S, kvh, hd]; slots: [...]; -> [..., kvh, hd]. index_select on a 2-D view copies
    # whole rows and is ~8x faster on CPU than advanced indexing with a 2-D index.
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:])


def _causal_mask(q_len: int, ctx_len: int) -> torch.Tensor:
    # Query i sits at context position ctx_len - q_len + i and sees positions <= it.
    q_pos = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
    return torch.arange(ctx_len).unsqueeze(0) <= q_pos  # [q, ctx]


def paged_attention(
    q: torch.Tensor,  # [T, nh, hd]
    k: torch.Tensor,  # [T, kvh, hd] (this step's keys, already written to the cache)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [S, kvh, hd]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for p in meta.prefills:
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, nh, q, hd]
        q_len = p.end - p.start
        if p.ctx_slots is None:
            # Fresh prompt: attend to this step's own K/V, no cache gather.
            ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            ks = _gather(k_cache, p.ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, hd]
            vs = _gather(v_cache, p.ctx_slots).transpose(0, 1).unsqueeze(0)
            mask = _causal_mask(q_len, p.ctx_len)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
    if meta.decode_slots is not None:
        rows = meta.decode_rows
        qd = q if meta.decode_contiguous and not meta.prefills else q[rows]
        qd = qd.unsqueeze(2)  # [Bd, nh, 1, hd]
        kd = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [Bd, kvh, L, hd]
        vd = _gather(v_cache, meta.decode_slots).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa)
        o = o.squeeze(2)  # [Bd, nh, hd]
        if meta.decode_contiguous and not meta.prefills:
            return o
        out[rows] = o
    return out
