"""Quantized weights in panels of 16 output rows, and `x @ W.T` over them on the panel
micro-kernel (ops/qpanel_gemm.c says the layout and why; AVX-512 VNNI or AVX2, whichever the
build targets, with the same results): every format the dot-order kernel serves (int8 per
channel, int4, GGUF Q8_0, Q4_0, Q4_1, Q4_K), with the same quants and scales. Where it cannot be
built `load_qpanel` is None and the dot-order kernel (ops/qgemm.py) serves them; that kernel
needs the same ISAs, so in practice it is the panel kernel's test reference. Both quantize the
activations the same way, so their integer dot products are equal."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once
from loraserve.ops.qgemm import call_buffers
from loraserve.ops.quant_formats import (
    Q4_AFF16,
    Q4_AFF32,
    Q4_F16,
    Q8_F16,
    Q8_ROW,
    QuantWeight,
    dequantize_blocks,
)
from loraserve.ops.weight_arena import PACKED_WEIGHTS

_SOURCE = Path(__file__).with_name("qpanel_gemm.c")
PANEL = 16
# QuantWeight kind -> the kernel's kind (qpanel_gemm.c numbers them alike)
PANEL_KINDS = {kind: kind for kind in (Q8_ROW, Q8_F16, Q4_F16, Q4_AFF16, Q4_AFF32)}


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
    """A `[out_features, in_features]` quantized weight in panels: quants `w` (8-bit: uint8
    q + 128 `[P, K/4, 16, 4]`; 4-bit: uint8 `[P, K/8, 16, 4]`, two steps to a byte), scales `d`
    (row scales `[P * 16]` float32 for int8 per channel; else block scales `[P, K/32, 16]` in
    the format's precision) and the affine formats' block offsets `m` (as `d`)."""

    kind: int  # the QuantWeight kind it was made from
    w: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: quants, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.w, self.d, self.m)
                   if t is not None)

    @property
    def four_bit(self) -> bool:
        return self.kind not in (Q8_ROW, Q8_F16)

    def quants(self) -> torch.Tensor:
        """`[P * 16, K]` quants in natural order (padding rows included): int8 for 8-bit, 0..15
        for 4-bit."""
        k = self.in_features
        if not self.four_bit:
            return (self.w.to(torch.int16) - 128).to(torch.int8).transpose(1, 2).reshape(-1, k)
        lo, hi = self.w & 0x0F, self.w >> 4  # [P, K/8, 16, 4] each
        pairs = torch.stack([lo, hi], dim=3)  # [P, K/8, 16, 2, 4]
        return pairs.permute(0, 2, 1, 3, 4).reshape(-1, k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, as QuantWeight.dequantize computes it."""
        n, k = self.out_features, self.in_features
        q = self.quants()[:n].to(torch.float32)
        if self.kind == Q8_ROW:
            return self.d[:n].view(n, 1) * q
        m = None if self.m is None else _natural(self.m, k)[:n]
        return dequantize_blocks(self.kind, q, _natural(self.d, k)[:n], m)


def _natural(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """`[P, K/32, 16]` per-block values as `[P * 16, K/32]`."""
    return blocks.transpose(1, 2).reshape(-1, k // 32)


def _block_panels(values: torch.Tensor, p: int) -> torch.Tensor:
    """`[N, K/32]` per-block values (their dtype kept) as `[P, K/32, 16]`, padded with zeros."""
    n, blocks = values.shape
    out = torch.zeros(p * PANEL, blocks, dtype=values.dtype)
    out[:n] = values
    return out.view(p, PANEL, blocks).transpose(1, 2).contiguous()


def pack_panels(qw: QuantWeight) -> QuantPanels:
    """Panels of a weight of a kind in PANEL_KINDS (its quants and scales, unchanged)."""
    if qw.kind not in PANEL_KINDS:
        raise ValueError(f"no panel layout for {qw.source} weights")
    n, k = qw.out_features, qw.in_features
    p = -(-n // PANEL)
    q = torch.zeros(p * PANEL, k, dtype=torch.uint8)
    if qw.bits == 8:  # stored + 128: the kernel's unsigned operand
        q[:n] = (qw.quants().to(torch.int16) + 128).to(torch.uint8)
        w = q.view(p, PANEL, k // 4, 4).transpose(1, 2).contiguous()
    else:
        q[:n] = qw.quants()
        pairs = q.view(p, PANEL, k // 8, 2, 4)
        w = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).transpose(1, 2).contiguous()
    if qw.kind == Q8_ROW:
        d = torch.zeros(p * PANEL, dtype=torch.float32)
        d[:n] = qw.d
    else:
        d = _block_panels(qw.d, p)
    m = _block_panels(qw.m, p) if qw.m is not None else None
    # on 2 MB pages, after the weight packed before it (ops/weight_arena.py)
    w, d = PACKED_WEIGHTS.copy(w), PACKED_WEIGHTS.copy(d)
    m = None if m is None else PACKED_WEIGHTS.copy(m)
    return QuantPanels(qw.kind, w, d, m, n, k)


def qpanel_linear(x: torch.Tensor, panels: QuantPanels, lib: ctypes.CDLL) -> torch.Tensor:
    """x @ W.T: x float32 `[T, in_features]` on the CPU -> `[T, out_features]`."""
    x, y, work = call_buffers(x, panels.out_features, lib.qpanel_work_bytes)
    if work is None:
        return y
    m, k = x.shape
    rc = lib.qpanel_gemm(PANEL_KINDS[panels.kind], x.data_ptr(), x.stride(0), m, k,
                         panels.w.data_ptr(), panels.d.data_ptr(),
                         None if panels.m is None else panels.m.data_ptr(),
                         panels.out_features, y.data_ptr(), panels.out_features,
                         work.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the quantized panel GEMM refused a weight of "
                         f"{[panels.out_features, panels.in_features]}")
    return y
