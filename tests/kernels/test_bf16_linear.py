"""The bf16-weight projection (model/bf16_linear.py) against float64 products of the same
bf16-rounded operands: every output is the exact sum rounded once to bf16, or one bf16 step
from it where float32 sums in another order land across a rounding boundary."""

from __future__ import annotations

import pytest
import torch

from loraserve.model.bf16_linear import Bf16Linear

SHAPES = [(1, 64, 128), (5, 576, 1536), (33, 1536, 576), (64, 96, 80), (0, 64, 32)]


@pytest.mark.parametrize(("rows", "d_in", "d_out"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_is_the_exact_sum_rounded_to_bf16(rows, d_in, d_out, bias):
    g = torch.Generator().manual_seed(rows + d_in + d_out)
    w, x = torch.randn(d_out, d_in, generator=g), torch.randn(rows, d_in, generator=g)
    b = torch.randn(d_out, generator=g) if bias else None
    lin = Bf16Linear(w, b)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, d_out)
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    rounded = exact.float().bfloat16().float()
    ulp = rounded.abs() * 2.0**-7  # one bf16 step (8 significant bits) of the sum
    if b is not None:
        rounded = rounded + b  # added in float32, after the bf16 sum
    assert torch.all((y - rounded).abs() <= ulp + 1e-6)
    if rows:
        assert (y != rounded).float().mean() < 0.01
    assert lin.weight.dtype == torch.bfloat16 and torch.equal(lin.weight, w.bfloat16())
    assert lin.nbytes == d_out * d_in * 2 + (d_out * 4 if bias else 0)
