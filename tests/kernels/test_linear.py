"""`Linear` gives nn.Linear's result whichever GEMM backend runs it, and keeps its weight; the
avx2 kernel is exact to float32 rounding on every tile shape, deterministic across threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraserve.model.linear import Linear
from loraserve.ops import gemm
from loraserve.ops.gemm import gemm_backend, pack_panels, panel_linear, unpack_panels

needs_avx2 = pytest.mark.skipif(gemm._kernel() is None, reason="the CPU lacks AVX2 + FMA")


def _expected(backend: str) -> str:
    if backend == "avx2" and gemm._kernel() is None:
        backend = "onednn"
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        backend = "mkl"
    return backend


@pytest.mark.parametrize("backend", ["avx2", "onednn", "mkl"])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_linear_equals_f_linear(monkeypatch, backend, rows):
    monkeypatch.setenv("LORASERVE_GEMM", backend)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 40, generator=g)  # 100: a partial last panel of 16 columns
    lin = Linear(w)
    assert lin.backend == _expected(backend)
    x = torch.randn(rows, 40, generator=g)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # A strided input (a column slice, a row slice of a wider tensor) is accepted too.
    wide = torch.randn(rows, 80, generator=g)
    torch.testing.assert_close(lin(wide[:, ::2]), F.linear(wide[:, ::2], w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(wide[:, 40:]), F.linear(wide[:, 40:], w), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.weight, w) and (lin.out_features, lin.in_features) == (100, 40)


@needs_avx2
@pytest.mark.parametrize("m,k,n", [(1, 8, 1), (7, 33, 17), (64, 1536, 40), (300, 600, 100),
                                   (13, 2048, 16), (0, 16, 16), (61, 576, 960), (2, 64, 48),
                                   (3, 40, 33), (6, 24, 80), (200, 2048, 33)])
def test_avx2_kernel_every_tile_shape(m, k, n):
    # rows: every remainder of the 6-row (AVX2) and 8-row (AVX-512) tiles, several row blocks
    # (k = 1536, 2048); columns: partial panels, odd and even panel counts (AVX-512 tiles
    # take panels in pairs); an empty batch
    g = torch.Generator().manual_seed(m * 7 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    panels = pack_panels(w)
    assert torch.equal(unpack_panels(panels, n), w)
    torch.testing.assert_close(panel_linear(x, panels, n), x @ w.T, rtol=1e-5,
                               atol=1e-5 * k**0.5)


@needs_avx2
def test_avx2_kernel_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(512, 576, generator=g), torch.randn(64, 576, generator=g)
    panels = pack_panels(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panel_linear(x, panels, 512)
        torch.set_num_threads(2)
        assert torch.equal(panel_linear(x, panels, 512), one)
    finally:
        torch.set_num_threads(threads)


def test_avx2_kernel_refuses_other_dtypes():
    if gemm._kernel() is None:
        pytest.skip("the CPU lacks AVX2 + FMA")
    panels = pack_panels(torch.randn(16, 8))
    with pytest.raises(TypeError, match="float32"):
        panel_linear(torch.randn(2, 8, dtype=torch.float64), panels, 16)


@pytest.mark.parametrize("capability,expected", [("AVX2", "avx2"), ("AVX512", "avx2")])
def test_auto_picks_the_backend_measured_fastest_for_the_isa(monkeypatch, capability, expected):
    # our kernel has AVX2 and AVX-512 tiles: faster than oneDNN from 1 to 64 rows on both
    monkeypatch.delenv("LORASERVE_GEMM", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert gemm_backend() == _expected(expected)


def test_packing_copies_the_weight(monkeypatch):
    for backend in ("avx2", "onednn"):
        monkeypatch.setenv("LORASERVE_GEMM", backend)
        w = torch.randn(8, 4)
        lin = Linear(w)
        w.zero_()  # the caller's tensor is not aliased by the layer
        assert lin.weight.abs().sum() > 0


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("LORASERVE_GEMM", "cublas")
    with pytest.raises(ValueError, match="LORASERVE_GEMM"):
        gemm_backend()
