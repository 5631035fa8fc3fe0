"""`Linear` gives nn.Linear's result whichever GEMM backend runs it, and keeps its weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraserve.model.linear import Linear
from loraserve.ops.gemm import gemm_backend


@pytest.mark.parametrize("backend", ["onednn", "mkl"])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_linear_equals_f_linear(monkeypatch, backend, rows):
    monkeypatch.setenv("LORASERVE_GEMM", backend)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    lin = Linear(w)
    assert lin.backend == (backend if torch.backends.mkldnn.is_available() else "mkl")
    x = torch.randn(rows, 40, generator=g)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # A strided input (a column slice) is accepted too.
    wide = torch.randn(rows, 80, generator=g)
    torch.testing.assert_close(lin(wide[:, ::2]), F.linear(wide[:, ::2], w), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.weight, w) and (lin.out_features, lin.in_features) == (96, 40)


def test_packing_copies_the_weight(monkeypatch):
    monkeypatch.setenv("LORASERVE_GEMM", "onednn")
    w = torch.randn(8, 4)
    lin = Linear(w)
    w.zero_()  # the caller's tensor is not aliased by the layer
    assert lin.weight.abs().sum() > 0


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("LORASERVE_GEMM", "cublas")
    with pytest.raises(ValueError, match="LORASERVE_GEMM"):
        gemm_backend()
