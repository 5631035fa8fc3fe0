"""The paged decode kernel gives a token the bits the prompt kernel gives it: the same query
over the same cached context, attended as a decode (paged_decode.c) or as the last row of a
prompt chunk (prefill_attention.c), comes out equal, not merely close. That is what lets a
token's K/V be made by either kernel: a request recomputed after preemption (its generated
tokens come back as prompt rows) and a prompt that hits cached blocks of another request's
generated tokens get the bits of a run without either.

Shapes: grouped-query heads (3 and 4 query heads a kv head, more than one pass of the
decode kernel's score chains at 9 per kv head), plain multi-head, head sizes 64 and 128;
contexts that end mid-group, mid-block and on a block's end; one sequence (items of query
heads) and many (items of whole sequences); one thread and two; and an AVX2 build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from avx2_build import assert_passes_on_avx2

from loraserve.model.attention import paged_decode as decode_kernel
from loraserve.model.attention import prefill_attention as prompt_kernel

BLOCK = 16


@pytest.fixture(scope="module")
def kernels():
    libs = decode_kernel.load(), prompt_kernel.load()
    if None in libs:
        pytest.fail("an attention kernel did not build (gcc is a test dependency)")
    return libs


def caches(lens, kvh, hd, g):
    """Random K/V caches and a shuffled block table per sequence: (k, v, tables [n, nb])."""
    nb = -(-max(lens) // BLOCK)
    blocks = torch.randperm(len(lens) * nb + 3, generator=g)[: len(lens) * nb]
    size = (len(lens) * nb + 3) * BLOCK
    k = torch.randn(size, kvh, hd, generator=g)
    v = torch.randn(size, kvh, hd, generator=g)
    return k, v, blocks.reshape(len(lens), nb).contiguous()


def compare(kernels, nh, kvh, hd, lens, seed):
    dec, pre = kernels
    g = torch.Generator().manual_seed(seed)
    k, v, tables = caches(lens, kvh, hd, g)
    q = torch.randn(len(lens), nh, hd, generator=g)
    scale = hd ** -0.5
    decoded = torch.empty_like(q)
    decode_kernel.paged_decode(dec, q, decoded, torch.arange(len(lens)), k, v, tables,
                               torch.tensor(lens), BLOCK, scale)
    for i, n in enumerate(lens):
        prompted = torch.empty(1, nh, hd)
        assert prompt_kernel.prefill_attention(pre, q[i : i + 1], prompted, n, k, v,
                                               tables[i], BLOCK, scale)
        assert torch.equal(decoded[i], prompted[0]), (i, n)


@pytest.mark.parametrize("nh,kvh,hd", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (27, 3, 64)])
@pytest.mark.parametrize("lens", [[1], [7], [16], [45], [130], [3, 40, 16, 77, 9, 64, 21, 5]])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_gives_the_prompt_kernels_bits(kernels, nh, kvh, hd, lens, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compare(kernels, nh, kvh, hd, lens, seed=len(lens) * 1000 + sum(lens) + nh)
    finally:
        torch.set_num_threads(before)


AVX2_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import test_decode_matches_prompt_kernel as t
from loraserve.model.attention import paged_decode, prefill_attention
libs = paged_decode.load(), prefill_attention.load()
t.compare(libs, 9, 3, 64, [45, 130, 7], seed=1)
t.compare(libs, 8, 2, 128, [16, 33], seed=2)
print("ok")
"""


def test_on_an_avx2_build():
    assert_passes_on_avx2(AVX2_CHECK, Path(__file__).parent)
