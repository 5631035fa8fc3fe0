"""Quantized weights in panels of 16 output rows, and `x @ W.T` over them on the AVX-512 VNNI
micro-kernel (ops/qpanel_gemm.c says the layout and why): int8 per channel, GGUF Q8_0, and
4-bit Q4_0 (`--quantization int4` makes the same). Where the host has no VNNI or no compiler
`load_qpanel` is None, and the affine 4-bit formats (Q4_1, Q4_K) have no panels: those run on
the dot-order kernel (ops/qgemm.py). Both quantize the activations the same way, so their
integer dot products are equal."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once
from loraserve.ops.qgemm import call_buffers
from loraserve.ops.quant_formats import Q4_F16, Q8_F16, Q8_ROW, QuantWeight

_SOURCE = Path(__file__).with_name("qpanel_gemm.c")
PANEL = 16
# QuantWeight kind -> the kernel's kind (qpanel_gemm.c: QP_Q8_ROW, QP_Q8_BLK, QP_Q4_BLK)
PANEL_KINDS = {Q8_ROW: 0, Q8_F16: 1, Q4_F16: 2}


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qpanel_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64,
                                ptr, ctypes.c_int]
    lib.qpanel_gemm.restype = ctypes.c_int
    lib.qpanel_work_bytes.argtypes = [i64, i64]
    lib.qpanel_work_bytes.restype = i64
    return lib if lib.qpanel_available() else None


def load_qpanel(flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    return load_library_once(_SOURCE, list(flags), "the quantized panel GEMM kernel",
                             _configure)


@dataclass(frozen=True)
class QuantPanels:
    """A `[out_features, in_features]` quantized weight in panels: quants `w` (int8 `[P, K/4,
    16, 4]`; 4-bit: uint8 `[P, K/8, 16, 4]`, two steps to a byte), `wsum` int32 `[P, K/32, 16]`
    (128 x each block's quant sum), `scale` float32: row scales `[P * 16]` (int8 per channel)
    or block scales `[P, K/32, 16]`."""

    kind: int  # the QuantWeight kind it was made from
    w: torch.Tensor
    wsum: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: quants, block sums and scales."""
        return sum(t.numel() * t.element_size() for t in (self.w, self.wsum, self.scale))

    def quants(self) -> torch.Tensor:
        """`[P * 16, K]` quants in natural order (padding rows included)."""
        k = self.in_features
        if self.kind != Q4_F16:
            return self.w.transpose(1, 2).reshape(-1, k)
        lo, hi = self.w & 0x0F, self.w >> 4  # [P, K/8, 16, 4] each
        pairs = torch.stack([lo, hi], dim=3)  # [P, K/8, 16, 2, 4]
        return pairs.permute(0, 2, 1, 3, 4).reshape(-1, k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, as QuantWeight.dequantize computes it."""
        n, k = self.out_features, self.in_features
        q = self.quants()[:n].to(torch.float32)
        if self.kind == Q8_ROW:
            return self.scale[:n].view(n, 1) * q
        d = self.scale.transpose(1, 2).reshape(-1, k // 32)[:n].unsqueeze(-1)
        blocks = q.view(n, k // 32, 32)
        return (d * (blocks - 8 if self.kind == Q4_F16 else blocks)).reshape(n, k)


def pack_panels(qw: QuantWeight) -> QuantPanels:
    """Panels of a weight of a kind in PANEL_KINDS (its quants and scales, unchanged)."""
    if qw.kind not in PANEL_KINDS:
        raise ValueError(f"no panel layout for {qw.source} weights")
    n, k = qw.out_features, qw.in_features
    p = -(-n // PANEL)
    signed = qw.kind != Q4_F16
    q = torch.zeros(p * PANEL, k, dtype=torch.int8 if signed else torch.uint8)
    q[:n] = qw.quants()
    sums = q.view(p, PANEL, k // 32, 32).sum(-1, dtype=torch.int32)
    wsum = (128 * sums).to(torch.int32).transpose(1, 2).contiguous()
    if signed:
        w = q.view(p, PANEL, k // 4, 4).transpose(1, 2).contiguous()
    else:
        pairs = q.view(p, PANEL, k // 8, 2, 4)
        w = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).transpose(1, 2).contiguous()
    if qw.kind == Q8_ROW:
        scale = torch.zeros(p * PANEL, dtype=torch.float32)
        scale[:n] = qw.d
    else:
        d = torch.zeros(p * PANEL, k // 32, dtype=torch.float32)
        d[:n] = qw.d.to(torch.float32)
        scale = d.view(p, PANEL, k // 32).transpose(1, 2).contiguous()
    return QuantPanels(qw.kind, w, wsum, scale, n, k)


def qpanel_linear(x: torch.Tensor, panels: QuantPanels, lib: ctypes.CDLL) -> torch.Tensor:
    """x @ W.T: x float32 `[T, in_features]` on the CPU -> `[T, out_features]`."""
    x, y, work = call_buffers(x, panels.out_features, lib.qpanel_work_bytes)
    if work is None:
        return y
    m, k = x.shape
    rc = lib.qpanel_gemm(PANEL_KINDS[panels.kind], x.data_ptr(), x.stride(0), m, k,
                         panels.w.data_ptr(), panels.wsum.data_ptr(), panels.scale.data_ptr(),
                         panels.out_features, y.data_ptr(), panels.out_features,
                         work.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the quantized panel GEMM refused a weight of "
                         f"{[panels.out_features, panels.in_features]}")
    return y
