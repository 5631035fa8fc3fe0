"""Load and call the C multi-LoRA kernel (`sgmv_cpu.c`) through ctypes.

Built once per adapter weight dtype (float32, or bfloat16 with -DLORA_BF16) by
ops/cbuild.py (cached per source, compiler and CPU). Where no C compiler is found or the build
fails, `load()` returns None once with a warning; the backend registry
(lora/backends/__init__.py) then falls back to the torch backend.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from loraserve.lora.layout import padded_rank
from loraserve.ops.cbuild import CFLAGS, load_library

SOURCE = Path(__file__).with_name("sgmv_cpu.c")
__all__ = ["CFLAGS", "PART_FIELDS", "SEG_FIELDS", "SOURCE", "accepts_tile", "load",
           "preferred_tile", "sgmv"]

# The columns of the int64 rows every LoRA kernel reads, in order: the fields of lora_seg and
# lora_part in lora/lora_rows.h (the kernels read the tensors as arrays of those structs).
SEG_FIELDS = ("slot", "start", "end", "rank")
PART_FIELDS = ("seg", "o0", "o1", "c0", "c1", "boff")

# adapter weight dtype -> extra compiler flags of its build (the kernel widens bf16 on load)
WEIGHT_FLAGS = {torch.float32: [], torch.bfloat16: ["-DLORA_BF16"]}

_lock = threading.Lock()
_libs: dict[torch.dtype, ctypes.CDLL | None] = {}


def load(weight_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The kernel library for adapter weights of `weight_dtype`, built on first use; None
    when it cannot be had."""
    with _lock:
        if weight_dtype in _libs:
            return _libs[weight_dtype]
        _libs[weight_dtype] = None
        lib = load_library(SOURCE, WEIGHT_FLAGS[weight_dtype], "C LoRA kernel")
        if lib is None:
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.lora_sgmv.restype = ctypes.c_int
        lib.lora_sgmv.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, i64,
                                  ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_int]
        lib.lora_preferred_tile.restype = lib.lora_accepts_tile.restype = ctypes.c_int
        lib.lora_accepts_tile.argtypes = [i64]
        lib.weight_dtype = weight_dtype
        _libs[weight_dtype] = lib
        return lib


def preferred_tile(lib: ctypes.CDLL) -> int:
    """The slot pool tile width this build runs fastest on: 16 on AVX2, 64 on AVX-512."""
    return lib.lora_preferred_tile()


def accepts_tile(lib: ctypes.CDLL, tile: int) -> bool:
    """Whether this build reads pools of tile width `tile` (AVX2: 16 and 64; AVX-512: 64)."""
    return bool(lib.lora_accepts_tile(tile))


def sgmv(lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor, A: torch.Tensor,
         B: torch.Tensor, segs: torch.Tensor, parts: torch.Tensor, max_rank: int,
         tile: int) -> None:
    """y += segmented LoRA delta, in place (see sgmv_cpu.c for the argument layout).

    x: [T, d_in], y: [T, d_out] float32 with unit column stride; A: [S, R * d_in] and
    B: [S, block floats] contiguous; segs int64 [n, 4] (SEG_FIELDS); parts int64 [m, 6]
    (PART_FIELDS); tile: the pool's tile width (layout.py)."""
    if x.stride(1) != 1 or y.stride(1) != 1 or not (A.is_contiguous() and B.is_contiguous()):
        raise ValueError("sgmv needs unit column strides and contiguous A/B")
    if not A.dtype == B.dtype == lib.weight_dtype or x.dtype != torch.float32:
        raise ValueError(f"kernel for {lib.weight_dtype} weights got A {A.dtype}, B {B.dtype}, "
                         f"x {x.dtype}")
    ldt = padded_rank(max_rank)  # the kernel writes t in whole 8- and 16-float vectors
    t = torch.empty(x.shape[0], ldt, dtype=torch.float32, device=x.device)
    rc = lib.lora_sgmv(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
                       A.data_ptr(), A.stride(0), x.shape[1], B.data_ptr(), B.stride(0),
                       segs.data_ptr(), segs.shape[0], parts.data_ptr(),
                       parts.shape[0], t.data_ptr(), ldt, tile, torch.get_num_threads())
    if rc == -1:
        raise ValueError("a segment's rank exceeds the scratch width")
    if rc == -3:
        raise ValueError(f"this build of the LoRA kernel cannot read tiles {tile} wide")
    if rc != 0:
        raise MemoryError("the LoRA kernel could not allocate its work lists")
