"""Attention over the paged KV cache.

The cache of one layer is a flat tensor of token slots `[num_blocks * block_size, kv_heads, hd]`;
a sequence's K/V live in the blocks its block table names. New tokens are written by slot;
context is read a whole block at a time (rows of block_size * kv_heads * hd floats: 2.5x faster
than token rows on this CPU). The runner builds the index tensors once per step.
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
    ctx_blocks: torch.Tensor | None  # [nb] blocks holding its whole context; None: no prior one
    ctx_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    decode_rows: torch.Tensor | None  # [Bd] row in the flat batch of each 1-token sequence
    decode_blocks: torch.Tensor | None  # [Bd, nb] block tables of their context (padded)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, nb * block_size] True on real context
    block_size: int
    decode_contiguous: bool  # decode rows are exactly 0..Bd-1 (no gather/scatter needed)
    prefills: list[PrefillSeq]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    # cache: [S, kvh, hd]; blocks: [..., nb] -> [..., nb * block_size, kvh, hd]. index_select
    # on a 2-D view copies whole rows: far faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0] // block_size, -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])


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
        if p.ctx_blocks is None:
            # Fresh prompt: attend to this step's own K/V, no cache gather.
            ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            bs = meta.block_size
            ks = _gather(k_cache, p.ctx_blocks, bs)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
            vs = _gather(v_cache, p.ctx_blocks, bs)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
            mask = _causal_mask(q_len, p.ctx_len)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
    if meta.decode_blocks is not None:
        rows = meta.decode_rows
        qd = q if meta.decode_contiguous and not meta.prefills else q[rows]
        qd = qd.unsqueeze(2)  # [Bd, nh, 1, hd]
        kd = _gather(k_cache, meta.decode_blocks, meta.block_size).transpose(1, 2)  # [Bd,kvh,L,hd]
        vd = _gather(v_cache, meta.decode_blocks, meta.block_size).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa)
        o = o.squeeze(2)  # [Bd, nh, hd]
        if meta.decode_contiguous and not meta.prefills:
            return o
        out[rows] = o
    return out
