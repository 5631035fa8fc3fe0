"""The int8 panel GEMM (ops/q8_panel_gemm.c, AVX-512 VNNI), against the dot-order kernel
(ops/qgemm_cpu.c), which quantizes the activations the same way: equal integer dot products,
so equal to float32 rounding (rel. 1e-5) for every row count and an output count that is not
a multiple of the panel; a row's result bit for bit the same alone or anywhere in a batch;
the same with any thread count; the panels decode to the weight they were made from."""

from __future__ import annotations

import pytest
import torch

from loraserve.ops.q8_panel import PANEL, load_q8_panel, pack_q8_row, q8_panel_linear
from loraserve.ops.qgemm import load_qgemm, qlinear
from loraserve.ops.quant_formats import quantize_int4, quantize_int8

N, K = 83, 768  # 83 outputs: five full panels and a partial one


@pytest.fixture(scope="module")
def lib():
    lib = load_q8_panel()
    if lib is None:
        pytest.skip("no AVX-512 VNNI (or no compiler) here: the dot-order kernel serves int8")
    return lib


def _weight(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(N, K, generator=g) * 0.05)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
def test_equals_the_dot_order_kernel(lib, rows):
    if load_qgemm() is None:
        pytest.skip("the dot-order kernel does not build here")
    qw = _weight()
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    got, ref = q8_panel_linear(x, pack_q8_row(qw), lib), qlinear(x, qw)
    assert got.shape == (rows, N)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a_rows_result_does_not_depend_on_the_batch(lib):
    panels = pack_q8_row(_weight(1))
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(3))
    batch = q8_panel_linear(x, panels, lib)
    for i in range(11):
        assert torch.equal(q8_panel_linear(x[i : i + 1], panels, lib)[0], batch[i])
    assert torch.equal(q8_panel_linear(x[5:9], panels, lib), batch[5:9])


def test_thread_count_changes_nothing(lib):
    panels = pack_q8_row(_weight(2))
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q8_panel_linear(x, panels, lib)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(q8_panel_linear(x, panels, lib), one)
    finally:
        torch.set_num_threads(threads)


def test_panels_decode_to_the_weight_and_count_their_bytes():
    qw = _weight(5)
    panels = pack_q8_row(qw)
    assert torch.equal(panels.dequantize(), qw.dequantize())
    padded = -(-N // PANEL) * PANEL
    assert panels.nbytes == padded * K + padded * (K // 32) * 4 + padded * 4
    with pytest.raises(ValueError, match="int8 per-channel"):
        pack_q8_row(quantize_int4(torch.randn(N, K)))
