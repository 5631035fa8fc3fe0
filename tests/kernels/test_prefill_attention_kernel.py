"""The C prefill attention kernel (model/attention/prefill_attention.c) against a float64
torch reference: fresh prompts reading this step's K/V rows (strided, as the model's fused
qkv lays them out) and later chunks reading the paged cache through a block table; grouped
and plain multi-head attention; head sizes 64 and 128; contexts that end mid-pass and
mid-block; tiles cut short by the last rows. A prompt computed in one chunk or in several
gives the same values; shapes it does not take are left to torch; the same holds on an AVX2
build (a process of its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from avx2_build import assert_passes_on_avx2

from loraserve.model.attention.prefill_attention import load, prefill_attention


@pytest.fixture(scope="module")
def lib():
    lib = load()
    if lib is None:
        pytest.fail("the prefill attention kernel did not build (gcc is a test dependency)")
    return lib


def reference(q, k, v, ctx_len):
    """q [T, nh, hd] at the last T positions of a context k, v [ctx_len, kvh, hd]."""
    t, nh, _ = q.shape
    group = nh // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,lhd->htl", q.double(), k) * q.shape[2] ** -0.5
    pos = torch.arange(ctx_len - t, ctx_len).unsqueeze(1)
    s = s.masked_fill(torch.arange(ctx_len).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("htl,lhd->thd", s.softmax(-1), v).float()


def fused_rows(t, nh, kvh, hd, g):
    """q, k, v as views into one [t, nh + 2 kvh, hd] tensor, as the model's qkv projection
    gives them (row strides wider than the rows)."""
    qkv = torch.randn(t, nh + 2 * kvh, hd, generator=g)
    return qkv[:, :nh], qkv[:, nh:nh + kvh], qkv[:, nh + kvh:]


def paged(k, v, block_size, g):
    """k, v written into caches at the blocks of a shuffled table: (caches, table)."""
    nb = -(-k.shape[0] // block_size)
    table = torch.randperm(3 * nb, generator=g)[:nb]
    k_cache = torch.randn(3 * nb * block_size, *k.shape[1:], generator=g)
    v_cache = torch.randn_like(k_cache)
    slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)
    k_cache[slots[: k.shape[0]]] = k
    v_cache[slots[: v.shape[0]]] = v
    return k_cache, v_cache, table


@pytest.mark.parametrize("nh,kvh,hd", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
@pytest.mark.parametrize("t", [1, 5, 23, 40])
def test_fresh_prompt_matches_reference(lib, nh, kvh, hd, t):
    g = torch.Generator().manual_seed(nh * 1000 + t)
    q, k, v = fused_rows(t, nh, kvh, hd, g)
    out = torch.full((t, nh, hd), float("nan"))
    assert prefill_attention(lib, q, out, t, k, v, None, 16, hd ** -0.5)
    torch.testing.assert_close(out, reference(q, k, v, t), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("nh,kvh,hd", [(9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("t,ctx", [(1, 37), (7, 16), (30, 101), (64, 64)])
def test_chunk_over_the_cache_matches_reference(lib, nh, kvh, hd, t, ctx):
    g = torch.Generator().manual_seed(hd + t + ctx)
    k = torch.randn(ctx, kvh, hd, generator=g)
    v = torch.randn(ctx, kvh, hd, generator=g)
    k_cache, v_cache, table = paged(k, v, 16, g)
    q = torch.randn(t, nh, hd, generator=g)
    out = torch.full((t, nh, hd), float("nan"))
    assert prefill_attention(lib, q, out, ctx, k_cache, v_cache, table, 16, hd ** -0.5)
    torch.testing.assert_close(out, reference(q, k, v, ctx), rtol=2e-5, atol=2e-6)


def test_one_chunk_or_several_give_the_same_values(lib):
    g = torch.Generator().manual_seed(7)
    nh, kvh, hd, n = 9, 3, 64, 75
    q, k, v = fused_rows(n, nh, kvh, hd, g)
    whole = torch.empty(n, nh, hd)
    assert prefill_attention(lib, q, whole, n, k, v, None, 16, 0.125)
    k_cache, v_cache, table = paged(k.contiguous(), v.contiguous(), 16, g)
    pieces = torch.empty(n, nh, hd)
    first = 29  # a fresh first chunk, then two chunks over the cache
    assert prefill_attention(lib, q[:first], pieces[:first], first, k[:first], v[:first], None,
                             16, 0.125)
    for a, b in ((first, 60), (60, n)):
        assert prefill_attention(lib, q[a:b], pieces[a:b], b, k_cache, v_cache, table, 16,
                                 0.125)
    assert torch.equal(pieces, whole)


def test_shapes_it_does_not_take_are_left_to_torch(lib):
    g = torch.Generator().manual_seed(3)
    q, k, v = fused_rows(6, 4, 2, 40, g)  # a head size not a multiple of 16
    out = torch.zeros(6, 4, 40)
    assert not prefill_attention(lib, q, out, 6, k, v, None, 16, 0.1)
    assert not out.any()
    q, k, v = (x.double() for x in fused_rows(6, 4, 2, 64, g))
    assert not prefill_attention(lib, q, torch.zeros(6, 4, 64, dtype=torch.float64), 6, k, v,
                                 None, 16, 0.1)


AVX2_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import test_prefill_attention_kernel as t
from loraserve.model.attention.prefill_attention import load
lib = load()
t.test_fresh_prompt_matches_reference(lib, 9, 3, 64, 23)
t.test_chunk_over_the_cache_matches_reference(lib, 4, 4, 128, 30, 101)
t.test_one_chunk_or_several_give_the_same_values(lib)
print("ok")
"""


def test_on_an_avx2_build():
    assert_passes_on_avx2(AVX2_CHECK, Path(__file__).parent)
