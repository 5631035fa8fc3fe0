"""Load and call the base projection fused with the LoRA op, through ctypes:
- `gemm_expand` (gemm_expand_cpu.c), for prefill-length segments: the shrink of each x block
  runs while the block is in L2 for the GEMM, and the expand inside the GEMM's register tiles,
  so y is written once (used where `expand_preferred`);
- `DecodeCall` (gemm_lora_decode_cpu.c's `gemm_lora_decode`), for decode steps: shrink and
  expand interleaved with the GEMM, their weights prefetched under its arithmetic.

Both give the same results, bit for bit, as the projection followed by lora_sgmv. Built once
each by ops/cbuild.py (float32 adapter weights only); None where they cannot be built or the CPU
lacks AVX2 + FMA, and the LoRA backend then runs the two ops one after the other.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import torch

from loraserve.lora.layout import padded_rank
from loraserve.ops.cbuild import load_library_once

EXPAND_SOURCE = Path(__file__).with_name("gemm_expand_cpu.c")
DECODE_SOURCE = Path(__file__).with_name("gemm_lora_decode_cpu.c")
__all__ = ["DecodeCall", "expand_preferred", "gemm_expand", "load_decode", "load_expand", "unit"]
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _configure_expand(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    lib.gemm_expand.restype = lib.gemm_expand_unit.restype = ctypes.c_int
    lib.gemm_expand_preferred.restype = ctypes.c_int
    lib.gemm_expand.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64,
                                _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64,
                                ctypes.c_int]
    return lib if lib.gemm_expand_unit() else None


def _configure_decode(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    lib.gemm_lora_decode.restype = ctypes.c_int
    lib.gemm_lora_decode.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr,
                                     _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64,
                                     _i64, ctypes.c_int, ctypes.POINTER(_ptr)]
    lib.gemm_lora_decode_free.restype = None
    lib.gemm_lora_decode_free.argtypes = [_ptr]
    return lib


def load_expand() -> ctypes.CDLL | None:
    """The prefill library, built on first use; None when it cannot be had."""
    return load_library_once(EXPAND_SOURCE, [], "the fused projection + LoRA expand",
                             _configure_expand)


def load_decode() -> ctypes.CDLL | None:
    """The decode library, built on first use; None when it cannot be had."""
    return load_library_once(DECODE_SOURCE, [], "the interleaved decode projection + LoRA",
                             _configure_decode)


def unit(lib: ctypes.CDLL) -> int:
    """Columns per register tile: module widths and the B strip width must be multiples."""
    return lib.gemm_expand_unit()


def expand_preferred(lib: ctypes.CDLL) -> bool:
    """Whether this build's fused expand is faster than the two ops (AVX-512: yes; AVX2: no,
    see gemm_expand_cpu.c)."""
    return bool(lib.gemm_expand_preferred())


def _check(x: torch.Tensor, *weights: torch.Tensor) -> None:
    if x.stride(1) != 1 or not all(w.is_contiguous() for w in weights):
        raise ValueError("the fused LoRA projection needs x with unit column stride and "
                         "contiguous adapter weights")
    if x.dtype != torch.float32 or any(w.dtype != torch.float32 for w in weights):
        raise ValueError(f"the fused LoRA projection takes float32, not x {x.dtype}, "
                         f"weights {[w.dtype for w in weights]}")


def _result(rc: int, what: str) -> bool:
    """False where the layout does not fit (-3); raises on the errors."""
    if rc == -1:
        raise ValueError(f"{what}: segments out of order, past the batch or over the rank")
    if rc == -2:
        raise MemoryError(f"{what} could not allocate its work lists")
    return rc == 0


def gemm_expand(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, d_out: int,
                A: torch.Tensor, B: torch.Tensor, segs: torch.Tensor, parts: torch.Tensor,
                max_rank: int, strip: int) -> torch.Tensor | None:
    """x @ W.T (W packed as ops/gemm.pack_panels) plus every segment's LoRA delta
    (x @ A_s.T) @ B_s, in a new tensor; None when the layout does not fit the tiles (the caller
    runs the two ops).

    x: float32 [T, d_in], unit column stride; A, B: the slot pool's [S, floats] tensors of one
    layer and group; segs int64 [n, 4] (sgmv_cpu.SEG_FIELDS) in token order; parts int64
    [m, 6] (sgmv_cpu.PART_FIELDS) in segment order; strip: the pool's tile width."""
    _check(x, A, B)
    m, k = x.shape
    ldt = padded_rank(max_rank)
    t = torch.empty(m, ldt, dtype=torch.float32)  # the shrink's scratch
    y = torch.empty(m, d_out, dtype=torch.float32)
    rc = lib.gemm_expand(x.data_ptr(), x.stride(0), panels.data_ptr(), m, d_out, k,
                         y.data_ptr(), d_out, A.data_ptr(), A.stride(0), t.data_ptr(), ldt,
                         B.data_ptr(), B.stride(0), segs.data_ptr(), segs.shape[0],
                         parts.data_ptr(), parts.shape[0], strip, torch.get_num_threads())
    return y if _result(rc, "gemm_expand") else None


class DecodeCall:
    """`gemm_lora_decode` for one group of one step, with what every layer shares made once:
    the segment and part arrays' addresses, the shrink's scratch t, and the C side's work plan
    (made by the first call, freed with this object). A decode step makes one call per layer
    and group, each a few microseconds of C, so per-call Python shows. Not for two threads at
    once (nor is a step)."""

    __slots__ = ("fn", "segs", "parts", "t", "args", "plan", "__weakref__")

    def __init__(self, lib: ctypes.CDLL, segs: torch.Tensor, parts: torch.Tensor,
                 max_rank: int, num_tokens: int, strip: int) -> None:
        self.fn = lib.gemm_lora_decode
        self.segs, self.parts = segs, parts  # kept alive: C reads them by address
        ldt = padded_rank(max_rank)
        self.t = torch.empty(num_tokens, ldt, dtype=torch.float32)
        self.plan = _ptr()
        weakref.finalize(self, lib.gemm_lora_decode_free, self.plan)
        self.args = (segs.data_ptr(), segs.shape[0], parts.data_ptr(), parts.shape[0],
                     self.t.data_ptr(), ldt, strip)

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, d_out: int, A: torch.Tensor,
                 B: torch.Tensor) -> torch.Tensor | None:
        """x @ W.T (W packed as ops/gemm.pack_panels) plus the LoRA delta of every segment, in
        a new tensor; None when the layout does not fit (the caller runs the two ops). x:
        float32 [num_tokens, d_in], unit column stride; A, B: the slot pool's float32 tensors
        of one layer and this group (contiguous)."""
        m, k = x.shape
        if x.stride(1) != 1 or x.dtype != torch.float32 or m != self.t.shape[0]:
            raise ValueError(f"gemm_lora_decode takes float32 [{self.t.shape[0]}, d_in] with "
                             f"unit column stride, not {x.dtype} {list(x.shape)}")
        y = torch.empty(m, d_out, dtype=torch.float32)
        rc = self.fn(x.data_ptr(), x.stride(0), panels.data_ptr(), m, d_out, k, y.data_ptr(),
                     d_out, A.data_ptr(), A.stride(0), B.data_ptr(), B.stride(0), *self.args,
                     torch.get_num_threads(), ctypes.byref(self.plan))
        return y if _result(rc, "gemm_lora_decode") else None
