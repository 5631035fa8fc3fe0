"""Sliding windows and soft-capped scores in every attention path (C paged decode kernel,
gather + SDPA, triton under the interpreter) against a per-token reference written from
transformers' definitions: position p sees positions > p - window; scores s become
softcap * tanh(s / softcap) before the softmax. Steps mix fresh prompts longer than the
window, chunks whose window starts inside the cached context, and decodes."""

from __future__ import annotations

import random

import pytest
import torch
from test_attention import make_backend

from loraserve.model.attention.base import AttentionSeq


def reference(q, k_all, v_all, seqs, ctx_k, ctx_v, scale, window, softcap):
    out = torch.empty_like(q)
    g = q.shape[1] // k_all.shape[1]
    for s, ck, cv in zip(seqs, ctx_k, ctx_v, strict=True):
        ks = torch.cat([ck, k_all[s.start:s.start + s.num_new]]).repeat_interleave(g, dim=1)
        vs = torch.cat([cv, v_all[s.start:s.start + s.num_new]]).repeat_interleave(g, dim=1)
        for j in range(s.num_new):
            pos = s.num_computed + j
            lo = max(0, pos - window + 1) if window else 0
            sc = torch.einsum("hd,thd->ht", q[s.start + j], ks[lo:pos + 1]) * scale
            if softcap:
                sc = torch.tanh(sc / softcap) * softcap
            out[s.start + j] = torch.einsum("ht,thd->hd", torch.softmax(sc, -1),
                                            vs[lo:pos + 1])
    return out


@pytest.mark.parametrize("kind", ["paged-kernel", "gather-sdpa", "triton"])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (64, 0.0), (0, 2.0), (7, 1.5)])
@pytest.mark.parametrize("nh,kvh,hd", [(4, 2, 16), (6, 2, 12)])
def test_windowed_and_capped_attention_equals_the_reference(kind, window, softcap, nh, kvh,
                                                            hd):
    rng = random.Random(window + hd)
    torch.manual_seed(window + hd)
    bs, num_blocks = 4, 200
    backend = make_backend(kind, bs)
    k_cache = torch.zeros(num_blocks * bs, kvh, hd)
    v_cache = torch.zeros(num_blocks * bs, kvh, hd)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (cached, new): fresh prompts shorter and longer than the window, chunks after context
    # (the window reaching back into it or not), short and long decodes (the long one runs
    # the C kernel's threaded path; the interpreted triton kernel walks any length with the
    # same tile loop, so 130 tokens, past the 64-token window, cover it)
    long = 130 if kind == "triton" else 600
    shapes = [(0, 3), (0, 20), (5, 1), (12, 1), (9, 6), (30, 9), (3, 1), (long, 1), (70, 1)]
    seqs, ctx_k, ctx_v, start = [], [], [], 0
    for cached, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // bs))]
        ck, cv = torch.randn(cached, kvh, hd) * 2, torch.randn(cached, kvh, hd)
        for p in range(cached):
            slot = table[p // bs] * bs + p % bs
            k_cache[slot], v_cache[slot] = ck[p], cv[p]
        seqs.append(AttentionSeq(start, new, cached, table))
        ctx_k.append(ck)
        ctx_v.append(cv)
        start += new
    qk = torch.randn(start, nh + kvh, hd) * 2  # large scores: the cap binds
    q, k = qk[:, :nh], qk[:, nh:]
    v = torch.randn(start, kvh, hd)
    scale = hd ** -0.5
    got = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(seqs), scale,
                          window=window, softcap=softcap)
    want = reference(q, k, v, seqs, ctx_k, ctx_v, scale, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the window and the cap matter here: without them the answer differs
    plain = reference(q, k, v, seqs, ctx_k, ctx_v, scale, 0, 0.0)
    assert not torch.allclose(plain, want, atol=1e-3)
    # decodes only (the common step)
    only = [s for s in seqs if s.num_new == 1]
    rows = torch.tensor([s.start for s in only])
    dec = [AttentionSeq(i, 1, s.num_computed, s.block_table) for i, s in enumerate(only)]
    got = backend.forward(q[rows], k[rows], v[rows], k_cache, v_cache, backend.prepare(dec),
                          scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
