"""Attention on CPU: decodes on the C paged kernel, prompts and chunks on the C prefill kernel.

Decodes (one new token each) read their context where it lies in the KV blocks
(paged_decode.c). A prompt or chunk goes to prefill_attention.c: a fresh prompt attends to
its own new K/V in this step's rows, a later chunk to its context in the cache. Without a C
compiler, for shapes or dtypes the kernels do not take, and with LORASERVE_PAGED_DECODE=0 /
LORASERVE_PREFILL_ATTENTION=0, the other path runs torch's SDPA: a fresh prompt on its own
K/V, a chunk or a prompt with cached context on its context gathered a whole block at a time
(rows of block_size * kv_heads * hd floats: a few long copies instead of one short copy per
token).

A sliding window is a mask (built once per step and window, shared by the layers that have
it); soft-capped scores (Gemma 2) cannot go through SDPA, so those layers compute the same
softmax explicitly, as transformers' eager attention does. Both take the torch path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraserve.model.attention.base import AttentionBackend, AttentionSeq
from loraserve.model.attention.paged_decode import load as load_paged_decode
from loraserve.model.attention.paged_decode import paged_decode
from loraserve.model.attention.prefill_attention import load as load_prefill_attention
from loraserve.model.attention.prefill_attention import prefill_attention


@dataclass
class PrefillSeq:
    """A sequence that feeds several tokens this step (a prompt, a chunk, or a recompute)."""

    start: int  # first of its tokens in the flat step batch
    end: int
    ctx_blocks: torch.Tensor | None  # [nb] blocks holding its whole context; None: no prior one
    ctx_len: int
    # window -> (first context block any of its tokens sees, [q, ctx from that block] mask)
    masks: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor | None = None  # [Bd] row in the flat batch of each decode
    decode_blocks: torch.Tensor | None = None  # [Bd, nb] block tables of their context
    decode_lens: torch.Tensor | None = None  # [Bd] context lengths
    # window -> [Bd, 1, 1, nb * block_size], True on what each decode sees (gather path)
    decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    decode_contiguous: bool = False  # decode rows are exactly 0..Bd-1 (no gather/scatter)


class CpuAttention(AttentionBackend):
    def __init__(self, block_size: int, device, paged_decode_kernel: bool | None = None,
                 prefill_kernel: bool | None = None):
        super().__init__(block_size, device)
        if paged_decode_kernel is None:
            paged_decode_kernel = os.environ.get("LORASERVE_PAGED_DECODE", "1") != "0"
        if prefill_kernel is None:
            prefill_kernel = os.environ.get("LORASERVE_PREFILL_ATTENTION", "1") != "0"
        self.kernel = load_paged_decode() if paged_decode_kernel else None
        self.prefill_kernel = load_prefill_attention() if prefill_kernel else None

    def prepare(self, seqs: Sequence[AttentionSeq]) -> CpuAttentionMetadata:
        bs, dev = self.block_size, self.device
        slot_mapping: list[int] = []
        prefills: list[PrefillSeq] = []
        decodes: list[AttentionSeq] = []
        for s in seqs:
            c, table = s.num_computed, s.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(c, c + s.num_new))
            if s.num_new == 1 and not s.prompt_chunk:
                decodes.append(s)
            else:
                nb = -(-(c + s.num_new) // bs)  # blocks holding its context
                ctx = None if c == 0 else torch.tensor(table[:nb], device=dev)
                prefills.append(PrefillSeq(s.start, s.start + s.num_new, ctx, c + s.num_new))
        meta = CpuAttentionMetadata(torch.tensor(slot_mapping, device=dev), prefills)
        if decodes:
            self._decode_metadata(meta, decodes)
        return meta

    def _decode_metadata(self, meta: CpuAttentionMetadata, decodes: list[AttentionSeq]) -> None:
        bs, dev = self.block_size, self.device
        lens = [s.num_computed + 1 for s in decodes]
        max_blocks = -(-max(lens) // bs)
        # [Bd, nb]: only the blocks that hold context (a table may own one more, empty block)
        meta.decode_blocks = torch.tensor(
            [s.block_table[:max_blocks] + [0] * (max_blocks - min(len(s.block_table), max_blocks))
             for s in decodes], device=dev)
        rows = [s.start for s in decodes]
        meta.decode_lens = torch.tensor(lens, device=dev)
        meta.decode_rows = torch.tensor(rows, device=dev)
        meta.decode_contiguous = rows == list(range(len(rows)))

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuAttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for p in meta.prefills:
            if not window and not softcap and self._prefill_in_c(p, q, k, v, k_cache, v_cache,
                                                                 out, scale):
                continue
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, nh, q, hd]
            if p.ctx_blocks is None and not window and not softcap:
                # Fresh prompt: attend to this step's own K/V, no cache gather.
                ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=gqa)
                out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
                continue
            first, mask = p.masks.get(window) or p.masks.setdefault(
                window, self._prefill_mask(p, window, q.device))
            if p.ctx_blocks is None:
                ks = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vs = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            else:  # only the blocks some token's window reaches
                bs, blocks = self.block_size, p.ctx_blocks[first:]
                n = p.ctx_len - first * bs
                ks = _gather(k_cache, blocks, bs)[:n].transpose(0, 1).unsqueeze(0)
                vs = _gather(v_cache, blocks, bs)[:n].transpose(0, 1).unsqueeze(0)
            o = _attend(qs, ks, vs, mask, scale, softcap, gqa)
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)
        if meta.decode_blocks is None:
            return out
        if self.kernel is not None:
            paged_decode(self.kernel, q, out, meta.decode_rows, k_cache, v_cache,
                         meta.decode_blocks, meta.decode_lens, self.block_size, scale,
                         window, softcap)
            return out
        rows = meta.decode_rows
        only_decodes = meta.decode_contiguous and not meta.prefills
        qd = (q if only_decodes else q[rows]).unsqueeze(2)  # [Bd, nh, 1, hd]
        kd = _gather(k_cache, meta.decode_blocks, self.block_size).transpose(1, 2)
        vd = _gather(v_cache, meta.decode_blocks, self.block_size).transpose(1, 2)
        mask = meta.decode_masks.get(window)
        if mask is None:
            mask = meta.decode_masks[window] = _decode_mask(meta.decode_lens, kd.shape[2],
                                                            window)
        o = _attend(qd, kd, vd, mask, scale, softcap, gqa).squeeze(2)  # [Bd, nh, hd]
        if only_decodes:
            return o
        out[rows] = o
        return out

    def _prefill_in_c(self, p: PrefillSeq, q, k, v, k_cache, v_cache, out,
                      scale: float) -> bool:
        """The chunk's attention by the C kernel, its K/V from this step's rows (a fresh
        prompt) or the cache (a later chunk; this step's rows are written there already);
        False where the kernel does not take it."""
        if self.prefill_kernel is None:
            return False
        rows = slice(p.start, p.end)
        if p.ctx_blocks is None:
            return prefill_attention(self.prefill_kernel, q[rows], out[rows], p.ctx_len,
                                     k[rows], v[rows], None, self.block_size, scale)
        return prefill_attention(self.prefill_kernel, q[rows], out[rows], p.ctx_len, k_cache,
                                 v_cache, p.ctx_blocks, self.block_size, scale)

    def _prefill_mask(self, p: PrefillSeq, window: int, device) -> tuple[int, torch.Tensor]:
        q_len = p.end - p.start
        first = 0  # a fresh prompt's own K/V start at position 0
        if window and p.ctx_blocks is not None:  # its first token sees from first_pos - w + 1
            first = max(0, p.ctx_len - q_len - window + 1) // self.block_size
        return first, _causal_mask(q_len, p.ctx_len, window, first * self.block_size, device)


def _attend(q, k, v, mask, scale: float, softcap: float, gqa: bool) -> torch.Tensor:
    # q: [B, nh, q, hd]; k, v: [B, kvh, L, hd]; mask: broadcast to [B, nh, q, L], True = seen
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    if gqa:  # query head h reads kv head h // (nh / kvh), as repeat_kv does
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    # cache: [S, kvh, hd]; blocks: [..., nb] -> [..., nb * block_size, kvh, hd]. index_select
    # on a 2-D view copies whole rows: far faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0] // block_size, -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])


def _causal_mask(q_len: int, ctx_len: int, window: int, start: int, device) -> torch.Tensor:
    # Query i sits at context position ctx_len - q_len + i and sees positions <= it (and,
    # with a window, > it - window); columns are context positions start..ctx_len - 1.
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    kv_pos = torch.arange(start, ctx_len, device=device).unsqueeze(0)
    mask = kv_pos <= q_pos  # [q, ctx - start]
    return mask & (kv_pos > q_pos - window) if window else mask


def _decode_mask(lens: torch.Tensor, width: int, window: int) -> torch.Tensor:
    # [Bd, 1, 1, width]: a decode at position len - 1 sees positions < len (and >= len - window)
    kv_pos = torch.arange(width, device=lens.device).unsqueeze(0)
    lens = lens.unsqueeze(1)
    mask = kv_pos < lens
    if window:
        mask &= kv_pos >= lens - window
    return mask.view(lens.shape[0], 1, 1, width)
