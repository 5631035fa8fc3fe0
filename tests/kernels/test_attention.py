"""The attention backends against a plain per-sequence reference: the CPU backend's C paged
decode kernel and its gather + SDPA path, and the triton backend (under Triton's interpreter,
tests/conftest.py), over random block tables (shuffled, shared, with spare blocks),
grouped-query heads, head sizes that are and are not multiples of 8, and steps mixing fresh
prompts, chunks with cached context and decodes."""

from __future__ import annotations

import random

import pytest
import torch

from loraserve.model.attention.base import AttentionSeq
from loraserve.model.attention.cpu import CpuAttention
from loraserve.model.attention.paged_decode import load
from loraserve.model.attention.triton_paged import TritonAttention


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


def make_backend(kind: str, block_size: int):
    if kind == "triton":
        return TritonAttention(block_size, "cpu")
    kernel = kind == "paged-kernel"
    if kernel and load() is None:
        pytest.fail("the paged decode kernel did not build (gcc is a test dependency)")
    backend = CpuAttention(block_size, "cpu", paged_decode_kernel=kernel)
    assert (backend.kernel is not None) == kernel
    return backend


@pytest.mark.parametrize("kind", ["paged-kernel", "gather-sdpa", "triton", "triton-tile64"])
@pytest.mark.parametrize("nh,kvh,hd", [(4, 2, 16), (6, 2, 12), (3, 3, 64), (8, 1, 8)])
def test_attention_backends_equal_the_reference(kind, nh, kvh, hd, monkeypatch):
    if kind == "triton-tile64":  # context tiles of 64 tokens (triton_paged.BLOCK_N)
        from loraserve.model.attention import triton_paged

        monkeypatch.setattr(triton_paged, "BLOCK_N", 64)
        kind = "triton"
    rng = random.Random(nh * 100 + hd)
    torch.manual_seed(nh * 100 + hd)
    bs, num_blocks = 4, 320
    backend = make_backend(kind, bs)
    k_cache = torch.zeros(num_blocks * bs, kvh, hd)
    v_cache = torch.zeros(num_blocks * bs, kvh, hd)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (cached tokens, new tokens): decodes of many lengths (a long one: the C kernel goes
    # multi-threaded; the interpreted triton kernel walks any length with the same tile loop,
    # so 130 tokens, 9 tiles, cover it), a fresh prompt, a chunk after context
    long = 130 if kind == "triton" else 1100
    shapes = [(0, 7), (5, 1), (12, 1), (1, 1), (9, 6), (30, 1), (3, 1), (long, 1), (2, 40)]
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


def test_triton_attention_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton attention backend needs a CUDA device"):
        TritonAttention(16, "cpu")
