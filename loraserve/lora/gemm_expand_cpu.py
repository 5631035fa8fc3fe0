"""Load and call the fused projection + LoRA expand (`gemm_expand_cpu.c`) through ctypes.

Built once (float32 adapter weights only: the tile epilogue reads B as float32) by
ops/cbuild.py; None where it cannot be built or the CPU lacks AVX2 + FMA, and the LoRA backend
then runs the projection and the LoRA op one after the other, with the same results.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once

SOURCE = Path(__file__).with_name("gemm_expand_cpu.c")
__all__ = ["gemm_expand", "load", "unit"]


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_expand.restype = lib.gemm_expand_unit.restype = ctypes.c_int
    lib.gemm_expand.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64,
                                ptr, i64, ptr, i64, i64, ctypes.c_int]
    return lib if lib.gemm_expand_unit() else None


def load() -> ctypes.CDLL | None:
    """The library, built on first use; None when it cannot be had."""
    return load_library_once(SOURCE, [], "the fused projection + LoRA expand", _configure)


def unit(lib: ctypes.CDLL) -> int:
    """Columns per register tile: module widths and the B strip width must be multiples."""
    return lib.gemm_expand_unit()


def gemm_expand(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, d_out: int,
                t: torch.Tensor, B: torch.Tensor, segs: torch.Tensor, parts: torch.Tensor,
                strip: int) -> torch.Tensor | None:
    """x @ W.T (W packed as ops/gemm.pack_panels) plus every segment's t @ B, in a new
    tensor; None when the layout does not fit the tiles (the caller runs the two ops).

    x: float32 [T, d_in], unit column stride; t: [T, ldt] from the LoRA shrink; B: the slot
    pool's [S, block floats] float32; segs int64 [n, 4] (slot, start, end, rank) in token
    order; parts int64 [m, 6] (seg, o0, o1, c0, c1, boff) in segment order."""
    if x.stride(1) != 1 or t.stride(1) != 1 or not B.is_contiguous():
        raise ValueError("gemm_expand needs unit column strides and a contiguous B")
    if not x.dtype == t.dtype == B.dtype == torch.float32:
        raise ValueError(f"gemm_expand takes float32, not x {x.dtype}, t {t.dtype}, "
                         f"B {B.dtype}")
    m, k = x.shape
    y = torch.empty(m, d_out, dtype=torch.float32)
    rc = lib.gemm_expand(x.data_ptr(), x.stride(0), panels.data_ptr(), m, d_out, k,
                         y.data_ptr(), d_out, t.data_ptr(), t.stride(0), B.data_ptr(),
                         B.stride(0), segs.data_ptr(), segs.shape[0], parts.data_ptr(),
                         parts.shape[0], strip, torch.get_num_threads())
    if rc == -3:
        return None
    if rc == -1:
        raise ValueError("gemm_expand: segments out of token order or past the batch")
    if rc != 0:
        raise MemoryError("gemm_expand could not allocate its row runs")
    return y
