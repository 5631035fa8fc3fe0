"""`x @ W.T` for a quantized W (ops/quant_formats.QuantWeight) on our C kernel
(ops/qgemm_cpu.c): AVX-512 VNNI where the build has it, else AVX2 (the build decides: it is
made for this CPU, or for LORASERVE_CPU_ARCH), tried once when first needed. Activations are
quantized to int8 per block of 32 inside the call (ops/qblock.h says why)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once
from loraserve.ops.quant_formats import QuantWeight

_SOURCE = Path(__file__).with_name("qgemm_cpu.c")
ISA_NAMES = {1: "avx2", 2: "avx512-vnni"}


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qgemm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr,
                          ctypes.c_int]
    lib.qgemm.restype = ctypes.c_int
    lib.qgemm_work_bytes.argtypes = [i64, i64]
    lib.qgemm_work_bytes.restype = i64
    return lib if lib.qgemm_isa() in ISA_NAMES else None  # neither VNNI nor AVX2: the stubs


def load_qgemm(flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library (built once per flag set; tests pass `-march=x86-64-v3` for the AVX2
    build), or None where it cannot be built or the CPU has neither AVX2 nor VNNI."""
    return load_library_once(_SOURCE, list(flags), "the quantized GEMM kernel", _configure)


def qgemm_isa(lib: ctypes.CDLL | None = None) -> str | None:
    """'avx512-vnni', 'avx2', or None where the kernel is unavailable."""
    lib = lib if lib is not None else load_qgemm()
    return None if lib is None else ISA_NAMES[lib.qgemm_isa()]


def check_input(x: torch.Tensor, in_features: int) -> None:
    """What the quantized kernels take: float32 `[T, in_features]` on the CPU."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"the quantized GEMM takes float32 CPU inputs, not {x.dtype} on "
                        f"{x.device}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"input of shape {list(x.shape)} for a weight of "
                         f"{in_features} inputs")


def call_buffers(x: torch.Tensor, out_features: int, work_bytes
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x with unit row stride, the output, the kernel's scratch: None when x has no rows)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    return x, y, (torch.empty(work_bytes(m, k), dtype=torch.uint8) if m else None)


def qlinear(x: torch.Tensor, w: QuantWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x @ W.T: x float32 `[T, in_features]` on the CPU (row stride free) -> `[T, out]`."""
    lib = lib if lib is not None else load_qgemm()
    if lib is None:
        raise RuntimeError("the quantized GEMM kernel is not available on this host")
    check_input(x, w.in_features)
    x, y, work = call_buffers(x, w.out_features, lib.qgemm_work_bytes)
    if work is None:
        return y
    m, k = x.shape
    offsets = 0 if w.m is None else w.m.data_ptr()
    rc = lib.qgemm(w.kind, x.data_ptr(), x.stride(0), m, k, w.qs.data_ptr(), w.d.data_ptr(),
                   offsets, w.out_features, y.data_ptr(), w.out_features, work.data_ptr(),
                   torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the quantized GEMM refused a {w.source} weight of "
                         f"{[w.out_features, w.in_features]}")
    return y
