"""The C paged decode kernel against a plain torch reference, over the shapes that take its
different paths: head sizes 64 / 128 (inlined), 96 (vector, generic) and 12 (scalar); one
sequence (work items of one kv head) and many (all heads of a sequence in one item);
contexts that end mid-group and mid-block; sliding windows and score soft-capping."""

from __future__ import annotations

import pytest
import torch

from loraserve.model.attention.paged_decode import load, paged_decode


def reference(q, k_cache, v_cache, tables, lens, block_size, scale, window, softcap):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for i, n in enumerate(lens.tolist()):
        slots = torch.tensor([tables[i, t // block_size].item() * block_size + t % block_size
                              for t in range(n)])
        if window:
            slots = slots[-window:]
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [L, nh, hd]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), k.double()) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v.double()).float()
    return out


@pytest.mark.parametrize("hd", [64, 128, 96, 12])
@pytest.mark.parametrize("n", [1, 11])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 0.0), (0, 2.5), (20, 3.0)])
def test_kernel_matches_reference(hd, n, window, softcap):
    lib = load()
    if lib is None:
        pytest.fail("the paged decode kernel did not build (gcc is a test dependency)")
    g = torch.Generator().manual_seed(hd * 100 + n)
    nh, kvh, bs = 6, 2, 4
    lens = torch.randint(1, 45, (n,), generator=g)
    lens[0] = 45  # longer than any window, ends mid-block
    nb = 12
    k = torch.randn(n * nb * bs, kvh, hd, generator=g) * 2
    v = torch.randn(n * nb * bs, kvh, hd, generator=g)
    tables = torch.randperm(n * nb, generator=g).view(n, nb).contiguous()
    q = torch.randn(n, nh, hd, generator=g)
    out = torch.empty_like(q)
    scale = hd**-0.5
    paged_decode(lib, q, out, torch.arange(n), k, v, tables, lens, bs, scale, window, softcap)
    want = reference(q, k, v, tables, lens, bs, scale, window, softcap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,max_len,hd", [(5, 300, 64), (40, 200, 64), (9, 700, 128)])
def test_kernel_shares_out_uneven_sequences(n, max_len, hd):
    """Many sequences of uneven lengths on a team of three threads: every work item is run once
    by exactly one thread (the shares are cut by context length), whether an item's rows were
    fetched by the item before it or are too long for that (hd 128, 700 tokens)."""
    lib = load()
    if lib is None:
        pytest.fail("the paged decode kernel did not build (gcc is a test dependency)")
    g = torch.Generator().manual_seed(n * max_len)
    nh, kvh, bs = 6, 2, 16
    lens = torch.randint(1, max_len, (n,), generator=g)
    lens[n // 2] = max_len
    nb = -(-max_len // bs)
    k = torch.randn(n * nb * bs, kvh, hd, generator=g)
    v = torch.randn(n * nb * bs, kvh, hd, generator=g)
    tables = torch.randperm(n * nb, generator=g).view(n, nb).contiguous()
    q = torch.randn(n, nh, hd, generator=g)
    out = torch.full_like(q, float("nan"))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        paged_decode(lib, q, out, torch.arange(n), k, v, tables, lens, bs, hd**-0.5)
    finally:
        torch.set_num_threads(threads)
    want = reference(q, k, v, tables, lens, bs, hd**-0.5, 0, 0.0)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,threads", [(1, 2), (1, 3), (2, 2), (2, 3)])
@pytest.mark.parametrize("hd", [64, 12])
def test_few_sequences_share_query_heads_bit_for_bit(n, threads, hd):
    """With fewer (sequence, kv head) items than the team can share evenly, the work items are
    query heads: runs of them cut across kv heads (9 query heads over 3 kv heads on 2 or 3
    threads). Each head's values are the one-thread run's, bit for bit."""
    lib = load()
    if lib is None:
        pytest.fail("the paged decode kernel did not build (gcc is a test dependency)")
    g = torch.Generator().manual_seed(n * 10 + threads)
    nh, kvh, bs, max_len = 9, 3, 16, 4000  # long enough for the kernel to start a team
    lens = torch.tensor([max_len, 3000][:n])
    nb = -(-max_len // bs)
    k = torch.randn(n * nb * bs, kvh, hd, generator=g)
    v = torch.randn(n * nb * bs, kvh, hd, generator=g)
    tables = torch.randperm(n * nb, generator=g).view(n, nb).contiguous()
    q = torch.randn(n, nh, hd, generator=g)
    outs = []
    before = torch.get_num_threads()
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            outs.append(torch.full_like(q, float("nan")))
            paged_decode(lib, q, outs[-1], torch.arange(n), k, v, tables, lens, bs, hd**-0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    want = reference(q, k, v, tables, lens, bs, hd**-0.5, 0, 0.0)
    torch.testing.assert_close(outs[1], want, atol=2e-5, rtol=1e-4)
