"""Load and call the C paged decode attention kernel (`paged_decode.c`) through ctypes.

Built once by ops/cbuild.py; `load()` returns None (one warning) where no C compiler is found,
and the CPU backend then gathers the context for torch's SDPA instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once

SOURCE = Path(__file__).with_name("paged_decode.c")


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [
        ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr,
        i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_float, ctypes.c_int]
    return lib


def load() -> ctypes.CDLL | None:
    return load_library_once(SOURCE, [], "C paged decode attention", _configure)


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int, scale: float, window: int = 0,
                 softcap: float = 0.0) -> None:
    """out[rows[i]] = attention of q[rows[i]] over its context (see paged_decode.c): the
    last `window` tokens of it when window > 0, scores capped by softcap when > 0.

    q, out: [T, nh, hd] float32, unit strides within a row; k_cache, v_cache: [S, kvh, hd]
    contiguous; rows, lens: int64 [n]; tables: int64 [n, nb] contiguous."""
    nh, hd = q.shape[1], q.shape[2]
    kvh = k_cache.shape[1]
    for t in (q, out):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != hd:
            raise ValueError("paged_decode needs float32 q/out with unit strides in a row")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and tables.is_contiguous()):
        raise ValueError("paged_decode needs contiguous caches and block tables")
    if nh % kvh:
        raise ValueError(f"{nh} query heads do not divide into {kvh} kv heads")
    rc = lib.paged_decode_attention(
        q.data_ptr(), q.stride(0), rows.data_ptr(), out.data_ptr(), out.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), rows.shape[0], nh, kvh, hd, block_size, scale, window, softcap,
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the paged attention kernel could not allocate its scratch")
