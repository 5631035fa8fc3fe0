"""The quantized panel GEMM (ops/qpanel_gemm.c, AVX-512 VNNI) for int8 per channel, int4 and
GGUF Q8_0, Q4_0, Q4_1 and Q4_K, against the dot-order kernel (ops/qgemm_cpu.c), which quantizes the
activations the same way: equal integer dot products, so equal to float32 rounding (rel.
1e-5) for every row count and an output count that is not a multiple of the panel; a row's
result bit for bit the same alone or anywhere in a batch; the same with any thread count;
the panels decode to the weight they were made from and read the format's bytes, no more."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_factory import random_q4k

from loraserve.ops import quant_formats as qf
from loraserve.ops.qgemm import load_qgemm, qlinear
from loraserve.ops.qpanel import PANEL, load_qpanel, pack_panels, qpanel_linear

N, K = 83, 768  # 83 outputs: five full panels and a partial one
FORMATS = ["int8", "Q8_0", "int4", "Q4_0", "Q4_1", "Q4_K"]


@pytest.fixture(scope="module")
def lib():
    lib = load_qpanel()
    if lib is None:
        pytest.skip("no AVX-512 VNNI (or no compiler) here: the dot-order kernel serves these")
    return lib


def _weight(fmt: str, seed: int = 0) -> qf.QuantWeight:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "Q4_K":  # gguf has no Q4_K quantizer
        return qf.from_gguf(fmt, random_q4k(N, K, seed), (N, K))
    if fmt in qf.GGUF_FORMATS:
        raw = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt))
        return qf.from_gguf(fmt, raw, (N, K))
    return qf.quantize_int8(w) if fmt == "int8" else qf.quantize_int4(w)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
def test_equals_the_dot_order_kernel(lib, fmt, rows):
    if load_qgemm() is None:
        pytest.skip("the dot-order kernel does not build here")
    qw = _weight(fmt)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    got, ref = qpanel_linear(x, pack_panels(qw), lib), qlinear(x, qw)
    assert got.shape == (rows, N)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_does_not_depend_on_the_batch(lib, fmt):
    panels = pack_panels(_weight(fmt, 1))
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(3))
    batch = qpanel_linear(x, panels, lib)
    for i in range(11):
        assert torch.equal(qpanel_linear(x[i : i + 1], panels, lib)[0], batch[i])
    assert torch.equal(qpanel_linear(x[5:9], panels, lib), batch[5:9])


def test_thread_count_changes_nothing(lib):
    panels = pack_panels(_weight("int4", 2))
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qpanel_linear(x, panels, lib)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(qpanel_linear(x, panels, lib), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_panels_decode_to_the_weight(fmt):
    qw = _weight(fmt, 5)
    panels = pack_panels(qw)
    assert torch.equal(panels.dequantize(), qw.dequantize())
    padded = -(-N // PANEL) * PANEL
    # quants, scales and offsets in the format's precision, padded to whole panels
    assert panels.nbytes == qw.nbytes * padded // N
