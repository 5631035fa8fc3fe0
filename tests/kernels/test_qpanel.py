"""The quantized panel GEMM (ops/qpanel_gemm.c) on the native build (AVX-512 VNNI here) and
the AVX2 build (-march=x86-64-v3), for int8 per channel, int4 and GGUF Q8_0, Q4_0, Q4_1 and
Q4_K, against the dot-order kernel (ops/qgemm_cpu.c) of the same build, which quantizes the
activations the same way: equal integer dot products, so equal to float32 rounding (rel.
1e-5) for every row count and an output count that is not a multiple of the panel; both
builds give the same bits; 8-bit quants at the ends of their range (-128, 127) against x at
its own (+-127), where AVX2's int16 pairs are closest to saturating, equal the exact product;
a row's result bit for bit the same alone or anywhere in a batch; the same with any thread
count; the panels decode to the weight they were made from and read the format's bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_factory import random_q4k
from test_qgemm import quantized_activations

from loraserve.ops import quant_formats as qf
from loraserve.ops.qgemm import load_qgemm, qlinear
from loraserve.ops.qpanel import PANEL, load_qpanel, pack_panels, qpanel_linear

N, K = 83, 768  # 83 outputs: five full panels and a partial one
FORMATS = ["int8", "Q8_0", "int4", "Q4_0", "Q4_1", "Q4_K"]
BUILDS = {"native": (), "avx2": ("-march=x86-64-v3",)}
ISAS = {1: "avx2", 2: "avx512-vnni"}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def build(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def lib(build):
    lib = load_qpanel(BUILDS[build])
    if lib is None:
        pytest.skip(f"the panel kernel does not build for {build} here (no compiler, or "
                    "neither AVX2 nor AVX-512 VNNI): the dot-order kernel serves these")
    return lib


@pytest.fixture(scope="module")
def dot_order(build):
    lib = load_qgemm(BUILDS[build])
    if lib is None:
        pytest.skip(f"the dot-order kernel does not build for {build} here")
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
def test_equals_the_dot_order_kernel(lib, dot_order, fmt, rows):
    qw = _weight(fmt)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    got, ref = qpanel_linear(x, pack_panels(qw), lib), qlinear(x, qw, dot_order)
    assert got.shape == (rows, N)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_the_build_targets_its_isa(lib, build):
    native = load_qpanel(BUILDS["native"])
    expected = ISAS[native.qpanel_available()] if build == "native" else "avx2"
    assert ISAS[lib.qpanel_available()] == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_builds_give_the_same_bits(fmt):
    libs = {b: load_qpanel(f) for b, f in BUILDS.items()}
    if any(lib is None for lib in libs.values()):
        pytest.skip("the panel kernel builds for only one of the ISAs here")
    panels = pack_panels(_weight(fmt, 7))
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(7))
    assert torch.equal(qpanel_linear(x, panels, libs["native"]),
                       qpanel_linear(x, panels, libs["avx2"]))


def _q8_0_at_the_ends(seed: int) -> qf.QuantWeight:
    """GGUF Q8_0 blocks (a float16 scale, 32 int8 quants) whose quants are -128 or 127."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((N * K // 32,), dtype=[("d", "<f2"), ("q", "i1", (32,))])
    blocks["d"] = rng.uniform(0.001, 0.01, blocks.shape).astype(np.float16)
    blocks["q"] = np.where(rng.random((blocks.shape[0], 32)) < 0.5, -128, 127)
    return qf.from_gguf("Q8_0", blocks.view(np.uint8), (N, K))


def test_8bit_quants_at_the_ends_of_their_range(lib):
    qw = _q8_0_at_the_ends(3)
    assert qw.quants().min() == -128 and qw.quants().max() == 127
    # every block of x has its quants at +-127: |q| * 127 in each pair, the most it can be
    x = torch.where(torch.rand(9, K, generator=torch.Generator().manual_seed(3)) < 0.5,
                    -1.0, 1.0)
    got = qpanel_linear(x, pack_panels(qw), lib)
    exact = (quantized_activations(x) @ qw.dequantize().double().T).float()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


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
