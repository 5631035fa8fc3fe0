"""The quantized GEMM (ops/qgemm_cpu.c), on the native build (AVX-512 VNNI here) and the AVX2
build (-march=x86-64-v3), for every format and row count:

- against the exact product of its own int8 activations (quantized per block of 32, as the
  kernel does) with the decoded weight, in float64: equal to float32 rounding (rel. 1e-5),
  which pins down the integer path, the dot order, the scales and the offsets;
- against the dequantize-then-float32 reference: the stated tolerance of weight-only
  quantization with int8 activations, relative Frobenius error under 1.5e-2;
- independent of the thread count (each output is one thread's, summed in one order).
"""

from __future__ import annotations

import gguf
import pytest
import torch
from test_quant_formats import random_q4k

from loraserve.ops import quant_formats as qf
from loraserve.ops.qgemm import load_qgemm, qgemm_isa, qlinear

BUILDS = {"native": (), "avx2": ("-march=x86-64-v3",)}
N, K = 83, 768  # an odd number of rows; K of 3 Q4_K super-blocks, 12 groups
REL_TOL = 1.5e-2  # weight-only quantization's error budget against the float32 product


def _lib(build: str):
    lib = load_qgemm(BUILDS[build])
    if lib is None:
        pytest.skip(f"the quantized GEMM does not build for {build} here")
    return lib


def _weights(seed: int) -> dict[str, qf.QuantWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05

    def from_gguf(t: str):
        raw = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, t))
        return qf.from_gguf(t, raw, (N, K))

    return {"int8": qf.quantize_int8(w), "int4": qf.quantize_int4(w), "Q8_0": from_gguf("Q8_0"),
            "Q4_0": from_gguf("Q4_0"), "Q4_1": from_gguf("Q4_1"),
            "Q4_K": qf.from_gguf("Q4_K", random_q4k(N, K, seed), (N, K))}


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per block of 32, int8 quants (round half to even) of x / d with
    d = amax / 127, times d; float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    return (q.double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
def test_every_format_against_both_references(build, rows):
    lib = _lib(build)
    assert qgemm_isa(lib) == ("avx2" if build == "avx2" else qgemm_isa())
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=g)
    x[0, :64] = 0.0  # an all-zero activation block
    for name, q in _weights(rows).items():
        got = qlinear(x, q, lib)
        w = q.dequantize()
        exact = (quantized_activations(x) @ w.double().T).float()
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5, msg=name)
        ref = x @ w.T
        assert float((got - ref).norm() / ref.norm()) < REL_TOL, name


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_strided_input_and_threads(build):
    lib = _lib(build)
    q = _weights(5)["Q4_1"]
    wide = torch.randn(300, 2 * K)
    x = wide[:, K:]  # a row stride of 2K
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qlinear(x, q, lib)
        torch.set_num_threads(max(2, threads))
        many = qlinear(x, q, lib)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert torch.equal(one, qlinear(x.contiguous(), q, lib))


def test_bad_inputs_are_refused():
    q = _weights(0)["int8"]
    with pytest.raises(ValueError, match="768 inputs"):
        qlinear(torch.randn(2, 64), q)
    with pytest.raises(TypeError, match="float32"):
        qlinear(torch.randn(2, K, dtype=torch.float64), q)
    assert qlinear(torch.randn(0, K), q).shape == (0, N)
