"""Projections over quantized weights (weight-only: activations stay float32 between layers),
with the interface of model/linear.Linear, so the model and the LoRA backends use them alike.

A quantized projection is not one of our float32 GEMM's packed weights (`panels` is None), so
the LoRA backends add their deltas after it (`LoraBackend.project`: the projection, then
`apply`), computed on the float32 input in the adapter's own precision, as over a float32
base: the adapter's part is exact; only the base's product is quantized.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from loraserve.model.linear import BiasedLinear, Linear
from loraserve.ops.qgemm import check_input, load_qgemm, qlinear
from loraserve.ops.qpanel import PANEL_KINDS, load_qpanel, pack_panels, qpanel_linear
from loraserve.ops.quant_formats import QuantWeight, quantize_int4, quantize_int8, supports

log = logging.getLogger("loraserve.model")
QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


class QuantLinear:
    """A bias-free projection over a quantized `[d_out, d_in]` weight: in the panels of the
    micro-kernel where it builds (ops/qpanel.py; the dot-order copy is not kept), else in dot
    order (ops/qgemm.py)."""

    panels = None  # not our float32 GEMM's layout: LoRA deltas are added after the product

    def __init__(self, qweight: QuantWeight):
        self.out_features, self.in_features = qweight.out_features, qweight.in_features
        self.format = qweight.source
        self._panel_lib = load_qpanel() if qweight.kind in PANEL_KINDS else None
        if self._panel_lib is not None:
            self.qweight, self.panels_q = None, pack_panels(qweight)
        else:
            self.qweight, self.panels_q = qweight, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, d_in] -> [T, d_out]
        if self.panels_q is not None:
            check_input(x, self.in_features)
            return qpanel_linear(x, self.panels_q, self._panel_lib)
        return qlinear(x, self.qweight)

    @property
    def panel_library(self) -> ctypes.CDLL | None:
        """The panel kernel's library when the weight is in panels."""
        return self._panel_lib if self.panels_q is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight the quantized one stands for (decoded: a copy)."""
        if self.panels_q is not None:
            return self.panels_q.dequantize()
        return self.qweight.dequantize()

    @property
    def nbytes(self) -> int:
        return (self.panels_q or self.qweight).nbytes


class BiasedQuantLinear(QuantLinear):
    """`y = x @ W.T + b` over a quantized W; the bias stays float32."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor):
        super().__init__(qweight)
        if bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {list(bias.shape)} for a "
                             f"{[self.out_features, self.in_features]} weight")
        self.bias = bias.detach().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = super().__call__(x)
        y += self.bias
        return y

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.bias.numel() * 4


def require_kernel(scheme: str) -> None:
    """Quantized weights need our kernel: where it cannot be built, a clear error at load."""
    if load_qgemm() is None:
        raise ValueError(f"quantization {scheme} needs the quantized GEMM kernel, which "
                         "cannot be built here (it needs gcc and a CPU with AVX2 or AVX-512 "
                         "VNNI); serve without quantization")


def quant_linear(qweight: QuantWeight, bias: torch.Tensor | None) -> QuantLinear:
    return QuantLinear(qweight) if bias is None else BiasedQuantLinear(qweight, bias)


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return Linear(weight) if bias is None else BiasedLinear(weight, bias)


def quantized_or_float(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str,
                       name: str) -> Linear | QuantLinear:
    """The projection quantized by `scheme` ("int8" or "int4"), or float32 where d_in is not
    a multiple of 64 (which the log says)."""
    if not supports(weight.shape[1]):
        log.warning("%s stays float32: %d inputs are not a multiple of 64", name,
                    weight.shape[1])
        return float_linear(weight, bias)
    return quant_linear(QUANTIZERS[scheme](weight), bias)
