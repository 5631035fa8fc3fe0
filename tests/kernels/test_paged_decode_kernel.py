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
