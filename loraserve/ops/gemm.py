"""The fastest float32 GEMM this CPU has, shared by the model's projections and the LoRA op.

`torch.mm` goes to MKL's sgemm. On the AMD EPYC machines here MKL takes a slow path: 160-210
GFLOP/s, and 14 GFLOP/s for the batch-1 lm_head. oneDNN's linear on a weight prepacked into
its blocked layout reaches 400-480 GFLOP/s on the same shapes, and streams the batch-1 lm_head
3x faster (measured per shape at batch 1, 7, 64, 200 and 2048; docs/benchmarks.md).

`LORASERVE_GEMM=mkl` forces the plain `torch.mm` path: for comparisons, and for CPUs where
oneDNN is not built in.
"""

from __future__ import annotations

import os

import torch

# oneDNN packs for a batch-size hint; 64 measured as fast as 2048 from 7 rows up, and as fast
# as 1 at batch 1.
PACK_BATCH_HINT = 64


def gemm_backend() -> str:
    """'onednn' or 'mkl': read when weights are packed, so a process can compare both."""
    want = os.environ.get("LORASERVE_GEMM", "onednn").lower()
    if want not in ("onednn", "mkl"):
        raise ValueError(f"LORASERVE_GEMM must be 'onednn' or 'mkl', not {want!r}")
    if want == "onednn" and torch.backends.mkldnn.is_available():
        return "onednn"
    return "mkl"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A `[d_out, d_in]` weight in oneDNN's blocked layout, for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                    PACK_BATCH_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN; `weight` packed or plain `[d_out, d_in]` (a strided view
    too: no copy)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
