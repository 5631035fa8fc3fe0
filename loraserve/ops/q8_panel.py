"""int8 per-channel weights in panels of 16 output rows, and `x @ W.T` over them on the
AVX-512 VNNI micro-kernel (ops/q8_panel_gemm.c says the layout and why). Where the host has
no VNNI or no compiler, `load_q8_panel` is None and the dot-order kernel (ops/qgemm.py) runs.
Both quantize the activations the same way: their integer dot products are equal."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once
from loraserve.ops.quant_formats import Q8_ROW, QuantWeight

_SOURCE = Path(__file__).with_name("q8_panel_gemm.c")
PANEL = 16


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q8p_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr,
                             ctypes.c_int]
    lib.q8p_gemm.restype = ctypes.c_int
    lib.q8p_work_bytes.argtypes = [i64, i64]
    lib.q8p_work_bytes.restype = i64
    return lib if lib.q8p_available() else None


def load_q8_panel(flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    return load_library_once(_SOURCE, list(flags), "the int8 panel GEMM kernel", _configure)


@dataclass(frozen=True)
class Q8Panels:
    """`[out_features, in_features]` int8 weights: `w` int8 `[P, K / 4, 16, 4]`, `wsum` int32
    `[P, K / 32, 16]` (128 x each block's sum), `wd` float32 `[P * 16]` (row scales)."""

    w: torch.Tensor
    wsum: torch.Tensor
    wd: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: quants, block sums and scales."""
        return sum(t.numel() * t.element_size() for t in (self.w, self.wsum, self.wd))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (scale x quant), as QuantWeight.dequantize gives it."""
        n, k = self.out_features, self.in_features
        q = self.w.transpose(1, 2).reshape(-1, k)[:n].to(torch.float32)
        return self.wd[:n].view(n, 1) * q


def pack_q8_row(qw: QuantWeight) -> Q8Panels:
    """Panels of an int8-per-channel weight (its quants and scales, unchanged)."""
    if qw.kind != Q8_ROW:
        raise ValueError(f"panels hold int8 per-channel weights, not {qw.source}")
    n, k = qw.out_features, qw.in_features
    p = -(-n // PANEL)
    q = torch.zeros(p * PANEL, k, dtype=torch.int8)
    q[:n] = qw.quants()
    wsum = (128 * q.view(p, PANEL, k // 32, 32).sum(-1, dtype=torch.int32)).to(torch.int32)
    w = q.view(p, PANEL, k // 4, 4).transpose(1, 2).contiguous()  # [P, K/4, 16, 4]
    wd = torch.zeros(p * PANEL, dtype=torch.float32)
    wd[:n] = qw.d
    return Q8Panels(w, wsum.transpose(1, 2).contiguous(), wd, n, k)


def q8_panel_linear(x: torch.Tensor, panels: Q8Panels, lib: ctypes.CDLL) -> torch.Tensor:
    """x @ W.T: x float32 `[T, in_features]` on the CPU -> `[T, out_features]`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, panels.out_features, dtype=torch.float32)
    if m == 0:
        return y
    work = torch.empty(lib.q8p_work_bytes(m, k), dtype=torch.uint8)
    rc = lib.q8p_gemm(x.data_ptr(), x.stride(0), m, k, panels.w.data_ptr(),
                      panels.wsum.data_ptr(), panels.wd.data_ptr(), panels.out_features,
                      y.data_ptr(), panels.out_features, work.data_ptr(),
                      torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the int8 panel GEMM refused a weight of "
                         f"{[panels.out_features, panels.in_features]}")
    return y
