"""Fused element-wise steps of a decoder layer: the C kernels of ops/fused_cpu.c for float32
CPU tensors (one pass over memory each), the Triton kernels of ops/triton_elementwise.py for
GPU tensors, torch's ops for anything else (bf16/fp16 on CPU, no C compiler, no triton).
Each function states the torch expression it computes.

`LORASERVE_FUSED_CPU=0` (or `set_enabled(False)`) takes the torch path on CPU too, and
`LORASERVE_FUSED_GPU=0` (or `set_gpu_enabled(False)`) on a GPU: for comparisons
(`benchmarks/kernels/kernel_ab.py elementwise`, `benchmarks/gpu_decode_step.py`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from loraserve.ops.cbuild import load_library_once

SOURCE = Path(__file__).with_name("fused_cpu.c")
_enabled = [os.environ.get("LORASERVE_FUSED_CPU", "1") != "0"]
_gpu_enabled = [os.environ.get("LORASERVE_FUSED_GPU", "1") != "0"]


def set_enabled(on: bool) -> None:
    _enabled[0] = on


def set_gpu_enabled(on: bool) -> None:
    _gpu_enabled[0] = on


def fused_enabled() -> bool:
    return _enabled[0]


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, f32, i32]
    lib.add_rms_norm.argtypes = [ptr, i64, ptr, i64, f32, ptr, ptr, i64, i64, i64, f32, i32]
    lib.silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, i32]
    lib.rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i32]
    for fn in (lib.rms_norm, lib.add_rms_norm, lib.silu_mul, lib.rope):
        fn.restype = None
    return lib


def _load() -> ctypes.CDLL | None:
    return load_library_once(SOURCE, ["-ffp-contract=off"], "fused CPU element-wise ops",
                             _configure)


def fused_library() -> ctypes.CDLL | None:
    """The C library itself where the fused ops are on (None: torch's path), for a caller
    that calls its functions from C (model/native_decode.py)."""
    return _load() if _enabled[0] else None


def _kernel(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The C library when every tensor is a float32 CPU matrix with unit inner stride."""
    if not _enabled[0]:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1:
            return None
    return _load()


@functools.cache
def _triton_kernels():
    try:
        from loraserve.ops import triton_elementwise
    except ImportError:  # no triton: torch's ops
        return None
    return triton_elementwise


def _gpu_kernel(*tensors: torch.Tensor):
    """ops/triton_elementwise.py when every tensor is on a GPU with unit inner stride."""
    if not _gpu_enabled[0]:
        return None
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1:
            return None
    return _triton_kernels()


def fused_for(t: torch.Tensor) -> bool:
    """Whether tensors like `t` take the C kernels."""
    return _kernel(t) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.rms_norm(x, (d,), weight, eps) for x: [T, d]."""
    gpu = _gpu_kernel(x, weight) if x.dim() == 2 and weight.is_contiguous() else None
    if gpu is not None:
        return gpu.add_rms_norm(x, None, 1.0, weight, eps)
    lib = _kernel(x, weight)
    if lib is None or x.dim() != 2 or not weight.is_contiguous():
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                 x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def add_rms_norm_(h: torch.Tensor, r: torch.Tensor, alpha: float, weight: torch.Tensor | None,
                  eps: float) -> torch.Tensor:
    """h.add_(r, alpha=alpha) in place, then rms_norm(h, weight, eps) (h itself when weight is
    None): the residual add and the next norm in one pass. h, r: [T, d]."""
    tensors = (h, r) if weight is None else (h, r, weight)
    plain = h.dim() == 2 and (weight is None or weight.is_contiguous())
    gpu = _gpu_kernel(*tensors) if plain else None
    if gpu is not None:
        return gpu.add_rms_norm(h, r, alpha, weight, eps)
    lib = _kernel(*tensors)
    if lib is None or h.dim() != 2 or (weight is not None and not weight.is_contiguous()):
        h.add_(r, alpha=alpha)
        return h if weight is None else torch.rms_norm(h, (h.shape[-1],), weight, eps)
    out = h if weight is None else torch.empty(h.shape, dtype=h.dtype)
    lib.add_rms_norm(h.data_ptr(), h.stride(0), r.data_ptr(), r.stride(0), alpha,
                     None if weight is None else weight.data_ptr(), out.data_ptr(),
                     out.stride(0), h.shape[0], h.shape[1], eps, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """F.silu(gate) * up, where gate, up = gate_up.split(inter, dim=-1): [T, 2*inter] -> [T,
    inter]."""
    gpu = _gpu_kernel(gate_up) if gate_up.dim() == 2 else None
    if gpu is not None:
        return gpu.silu_mul(gate_up, inter)
    lib = _kernel(gate_up)
    if lib is None:
        gate, up = gate_up.split((inter, inter), dim=-1)
        return F.silu(gate) * up
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                 gate_up.shape[0], inter, torch.get_num_threads())
    return out


def gpu_rope_for(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether rope_ rotates by these tables with the Triton kernel (on their GPU): the kernel
    reads both with cos's row stride."""
    return (cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape
            and _gpu_kernel(cos, sin) is not None)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place, rotate-half layout: x = x * cos[p] + rotate_half(x) * sin[p]
    with p = positions[t] for token t. x: [T, heads, hd] (heads adjacent in a row, as views of
    a fused qkv output are); cos, sin: [P, hd] tables; positions: int64 [T]."""
    if (x.dim() == 3 and x.shape[2] == cos.shape[1] and gpu_rope_for(cos, sin)
            and _gpu_kernel(x) is not None
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.device == x.device):
        return _triton_kernels().rope_(x, positions, cos, sin)
    lib = _kernel(x, cos, sin)
    if (lib is None or x.stride(1) != x.shape[2] or not (cos.is_contiguous()
                                                           and sin.is_contiguous())
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)
        return x
    lib.rope(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2],
             positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return x
