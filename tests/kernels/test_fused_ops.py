"""ops/elementwise.py: each fused C kernel against the torch expression its docstring states,
on the strided views the model hands it (rows of fused qkv / gate_up outputs)."""

from __future__ import annotations

import pytest
import torch

from loraserve.ops import elementwise as ew


@pytest.fixture(autouse=True)
def kernels_built():
    if ew._load() is None:
        pytest.fail("the fused CPU kernels did not build (gcc is a test dependency)")
    ew.set_enabled(True)
    yield
    ew.set_enabled(True)


@pytest.mark.parametrize("T", [1, 7, 300])  # 300 x 576 rows: the OpenMP path
def test_rms_norm_on_a_strided_view(T):
    g = torch.Generator().manual_seed(T)
    base = torch.randn(T, 700, generator=g) * 3
    x, w = base[:, 50:626], torch.randn(576, generator=g)  # row stride 700
    got = ew.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, torch.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alpha,with_weight", [(1.0, True), (0.22, True), (1.0, False)])
@pytest.mark.parametrize("T", [3, 300])
def test_add_rms_norm_updates_the_residual_in_place(alpha, with_weight, T):
    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, 576, generator=g)
    r = torch.randn(T, 600, generator=g)[:, :576]
    w = torch.randn(576, generator=g) if with_weight else None
    want_h = h + alpha * r
    got = ew.add_rms_norm_(h, r, alpha, w, 1e-6)
    torch.testing.assert_close(h, want_h, atol=1e-6, rtol=1e-6)
    if w is None:
        assert got is h
    else:
        torch.testing.assert_close(got, torch.rms_norm(want_h, (576,), w, 1e-6),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("T", "inter"), [(2, 1536), (100, 1536), (7, 37)])
def test_silu_mul_matches_torch_over_a_wide_range(T, inter):
    """Eight lanes at a time, then a scalar tail (37 = 4 * 8 + 5)."""
    g = torch.Generator().manual_seed(T)
    gu = torch.randn(T, 2 * inter, generator=g) * 8  # exp far into both tails
    for at in (0, inter - 4):  # in the vector part and in the tail
        gu[0, at:at + 4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gu.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(ew.silu_mul(gu, inter), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 400])
def test_rope_in_place_on_a_view_of_fused_qkv(T):
    g = torch.Generator().manual_seed(T)
    nh, kvh, hd, positions_max = 9, 3, 64, 1000
    qkv = torch.randn(T, (nh + 2 * kvh) * hd, generator=g)
    v_before = qkv[:, (nh + kvh) * hd:].clone()
    qk = qkv[:, : (nh + kvh) * hd].reshape(-1, nh + kvh, hd)  # a view, row stride (nh+2kvh)hd
    cos = torch.randn(positions_max, hd, generator=g)
    sin = torch.randn(positions_max, hd, generator=g)
    pos = torch.randint(0, positions_max, (T,), generator=g)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    rotated = torch.cat((-qk[..., hd // 2:], qk[..., : hd // 2]), dim=-1)
    want = qk * c + rotated * s
    out = ew.rope_(qk, pos, cos, sin)
    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk, want, atol=0, rtol=0)  # the same roundings as torch
    assert torch.equal(qkv[:, (nh + kvh) * hd:], v_before)


def test_disabled_takes_the_torch_path_with_the_same_results():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(4, 64, generator=g)
    fused = ew.silu_mul(gu, 32)
    ew.set_enabled(False)
    assert not ew.fused_for(gu)
    torch.testing.assert_close(ew.silu_mul(gu, 32), fused, atol=1e-6, rtol=1e-6)
