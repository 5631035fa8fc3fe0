"""The CPU attention backend against a plain per-sequence reference: the C paged decode kernel
and the gather + SDPA path, over random block tables (shuffled, shared, with spare blocks),
grouped-query heads, head sizes that are and are not multiples of 8, and steps mixing fresh
prompts, chunks with cached context and decodes."""

from __future__ import annotations

import random

import pytest
import torch

from loraserve.model.attention.base import AttentionSeq
from loraserve.model.attention.cpu import CpuAttention
from loraserve.model.attention.paged_decode import load


def reference(q, k_all, v_all, seqs, ctx_k, ctx_v, scale):
    """Each new token attends, causally, to its sequence's cached context then its new K/V."""
    out = torch.empty_like(q)
    g = q.shape[1] // k_all.shape[1]
    for s, ck, cv in zip(seqs, ctx_k, ctx_v, strict=True):
        ks = torch.cat([ck, k_all[s.start:s.start + s.num_new]]).repeat_interleave(g, dim=1)
        vs = torch.cat([cv, v_all[s.start:s.start + s.num_new]]).repeat_interleave(g, dim=1)
        for j in range(s.num_new):
            qi = q[s.start + j]  # [nh, hd]
            n = s.num_computed + j + 1
            w = torch.softmax(torch.einsum("hd,thd->ht", qi, ks[:n]) * scale, dim=-1)
            out[s.start + j] = torch.einsum("ht,thd->hd", w, vs[:n])
    return out


@pytest.mark.parametrize("kernel", [True, False], ids=["paged-kernel", "gather-sdpa"])
@pytest.mark.parametrize("nh,kvh,hd", [(4, 2, 16), (6, 2, 12), (3, 3, 64), (8, 1, 8)])
def test_cpu_attention_equals_the_reference(kernel, nh, kvh, hd):
    if kernel and load() is None:
        pytest.fail("the paged decode kernel did not build (gcc is a test dependency)")
    rng = random.Random(nh * 100 + hd)
    torch.manual_seed(nh * 100 + hd)
    bs, num_blocks = 4, 320
    backend = CpuAttention(bs, "cpu", paged_decode_kernel=kernel)
    assert (backend.kernel is not None) == kernel
    k_cache = torch.zeros(num_blocks * bs, kvh, hd)
    v_cache = torch.zeros(num_blocks * bs, kvh, hd)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (cached tokens, new tokens): decodes of many lengths (a long one: the kernel goes
    # multi-threaded), a fresh prompt, a chunk after context
    shapes = [(0, 7), (5, 1), (12, 1), (1, 1), (9, 6), (30, 1), (3, 1), (1100, 1)]
    seqs, ctx_k, ctx_v, start = [], [], [], 0
    for cached, new in shapes:
        need = -(-(cached + new) // bs) + rng.randint(0, 1)  # sometimes a spare block
        table = [free.pop() for _ in range(need)]
        ck, cv = torch.randn(cached, kvh, hd), torch.randn(cached, kvh, hd)
        for p in range(cached):
            slot = table[p // bs] * bs + p % bs
            k_cache[slot], v_cache[slot] = ck[p], cv[p]
        seqs.append(AttentionSeq(start, new, cached, table))
        ctx_k.append(ck)
        ctx_v.append(cv)
        start += new
    T = start
    qk = torch.randn(T, nh + kvh, hd)  # q as a strided view, as the model hands it over
    q, k = qk[:, :nh], qk[:, nh:]
    v = torch.randn(T, kvh, hd)
    scale = hd ** -0.5
    meta = backend.prepare(seqs)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    want = reference(q, k, v, seqs, ctx_k, ctx_v, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # decodes only (the common step): the same rows, the same answers
    only = [s for s in seqs if s.num_new == 1]
    rows = torch.tensor([s.start for s in only])
    dec = [AttentionSeq(i, 1, s.num_computed, s.block_table) for i, s in enumerate(only)]
    got = backend.forward(q[rows], k[rows], v[rows], k_cache, v_cache, backend.prepare(dec),
                          scale)
    torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
