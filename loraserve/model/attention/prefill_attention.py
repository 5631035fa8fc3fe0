"""Load and call the C prefill attention kernel (`prefill_attention.c`) through ctypes: one
prompt chunk's causal attention, its K/V read from this step's rows (a fresh prompt) or from
the paged cache (a later chunk).

Built once by ops/cbuild.py; `load()` returns None (one warning) where no C compiler is found,
and `prefill_attention` returns False where the kernel does not take the step (no AVX2 + FMA,
a head size not a multiple of 16, not float32): the CPU backend then runs torch's SDPA.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once

SOURCE = Path(__file__).with_name("prefill_attention.c")
UNSUPPORTED = -3  # prefill_attention.c: no kernel for this build or shape


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.prefill_attention.restype = ctypes.c_int
    lib.prefill_attention.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64, ptr,
                                      i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    return lib


def load() -> ctypes.CDLL | None:
    return load_library_once(SOURCE, [], "C prefill attention", _configure)


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor, ctx_len: int,
                      k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None,
                      block_size: int, scale: float) -> bool:
    """out = causal attention of the chunk's queries q ([T, nh, hd], the last T positions of
    a context of ctx_len tokens) over that context; False (out untouched) where the kernel
    does not take the shape.

    k, v: [ctx_len, kvh, hd] rows of this step (table None: a fresh prompt, ctx_len == T), or
    the whole caches [S, kvh, hd] with the context's block ids in `table` (int64 [nb])."""
    t, nh, hd = q.shape
    kvh = k.shape[1]
    if any(x.dtype != torch.float32 for x in (q, out, k, v)):
        return False
    for x in (q, out, k, v):
        if x.stride(2) != 1 or x.stride(1) != hd:
            raise ValueError("prefill_attention needs rows with unit strides within a row")
    if table is not None and not table.is_contiguous():
        raise ValueError("prefill_attention needs a contiguous block table")
    rc = lib.prefill_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), t, ctx_len, k.data_ptr(),
        k.stride(0), v.data_ptr(), v.stride(0), None if table is None else table.data_ptr(),
        block_size, nh, kvh, hd, scale, torch.get_num_threads())
    if rc == UNSUPPORTED:
        return False
    if rc != 0:
        raise MemoryError("the prefill attention kernel could not allocate its scratch")
    return True
