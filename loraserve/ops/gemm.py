"""The fastest float32 GEMM this CPU has, shared by the model's projections and the LoRA op.

Three backends, chosen from measurements (benchmarks/kernels/gemm_shapes.py re-measures them;
the figures are in docs/cpu-kernels.md and docs/benchmarks.md):
- "avx2": our kernel (ops/gemm_cpu.c) on a weight packed into 16-column panels, with 6 x 16
  AVX2 register tiles, or 8 x 32 AVX-512 ones where the build has AVX-512 (the name is older
  than those). It beats oneDNN on a decode step's few-row projections on both ISAs, and is
  about even with it on long prefills. The default wherever it builds (AVX2 + FMA): decode
  steps gain more than long prefills lose, and the weights are packed once, in one layout.
- "onednn": oneDNN's linear on a weight prepacked into its blocked layout: where our kernel
  cannot be built (no C compiler, no AVX2 + FMA).
- "mkl": plain `torch.mm` (what transformers runs): where neither of the others is built.

`LORASERVE_GEMM=avx2|onednn|mkl` forces one (comparisons, tests); `auto` (the default) picks
as above.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once
from loraserve.ops.hugepages import empty_huge
from loraserve.ops.weight_arena import PACKED_WEIGHTS

# oneDNN packs for a batch-size hint; 64 runs few-row and many-row products as fast as the hints
# made for them (benchmarks/kernels/gemm_shapes.py).
PACK_BATCH_HINT = 64
PANEL = 16  # columns per panel of the avx2 kernel's packed weight
_BACKENDS = ("auto", "avx2", "onednn", "mkl")
_SOURCE = Path(__file__).with_name("gemm_cpu.c")


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_pack.argtypes = [ptr, i64, i64, i64, ptr]
    lib.gemm_packed.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, i64, ctypes.c_int]
    lib.gemm_pack.restype = lib.gemm_packed.restype = None
    return lib if lib.gemm_available() else None  # built without AVX2 + FMA: the stubs


def _kernel() -> ctypes.CDLL | None:
    """Our GEMM library, or None where it cannot be built or the CPU lacks AVX2 + FMA."""
    return load_library_once(_SOURCE, [], "the GEMM kernel", _configure)


def gemm_library() -> ctypes.CDLL | None:
    """Our GEMM library (None as `_kernel`), for a caller that calls it from C."""
    return _kernel()


def gemm_backend() -> str:
    """'avx2', 'onednn' or 'mkl': read when weights are packed, so a process can compare them."""
    want = os.environ.get("LORASERVE_GEMM", "auto").lower()
    if want not in _BACKENDS:
        raise ValueError(f"LORASERVE_GEMM must be one of {', '.join(_BACKENDS)}, not {want!r}")
    if want == "auto":
        want = "avx2"
    if want == "avx2" and _kernel() is None:
        want = "onednn"
    if want == "onednn" and not torch.backends.mkldnn.is_available():
        want = "mkl"
    return want


def onednn_enabled() -> bool:
    """Whether ad-hoc products (the torch LoRA path) should go through oneDNN rather than MKL:
    everywhere it is built, unless LORASERVE_GEMM=mkl asks for the plain path."""
    return gemm_backend() != "mkl"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A `[d_out, d_in]` weight in oneDNN's blocked layout, for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                    PACK_BATCH_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN; `weight` packed or plain `[d_out, d_in]` (a strided view
    too: no copy)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def pack_panels(weight: torch.Tensor, model_weight: bool = True) -> torch.Tensor:
    """A float32 `[d_out, d_in]` weight as the avx2 kernel's panels: `[ceil(d_out / 16), d_in,
    16]`, zeros past d_out. A model's weight goes into the weight arena, after the weight packed
    before it (a decode step reads them all in turn); `model_weight=False` (a weight that goes
    before the model does) gets an allocation of its own, so it holds no arena chunk."""
    w = weight.detach().contiguous()
    n, k = w.shape
    shape = (-(-n // PANEL), k, PANEL)
    out = (PACKED_WEIGHTS.empty(*shape, dtype=torch.float32) if model_weight
           else empty_huge(*shape))
    _kernel().gemm_pack(w.data_ptr(), k, n, k, out.data_ptr())
    return out


def unpack_panels(panels: torch.Tensor, d_out: int) -> torch.Tensor:
    """The plain `[d_out, d_in]` weight back from `pack_panels` (a copy)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:d_out].contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, d_out: int) -> torch.Tensor:
    """x @ W.T on the avx2 kernel, W packed by `pack_panels`; x: float32 `[T, d_in]` with unit
    inner stride (row stride free)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"the avx2 GEMM takes float32 CPU inputs, not {x.dtype} on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, d_out, dtype=torch.float32)
    if m:
        _kernel().gemm_packed(x.data_ptr(), x.stride(0), panels.data_ptr(), m, d_out, k,
                              y.data_ptr(), d_out, torch.get_num_threads())
    return y
