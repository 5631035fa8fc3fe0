"""Dense projections `y = x @ W.T`, run by the fastest float32 GEMM this CPU has.

`torch.mm` goes to MKL's sgemm. On the AMD EPYC machines here MKL takes a slow path: 160-210
GFLOP/s, and 14 GFLOP/s for the batch-1 lm_head. oneDNN's linear on a weight prepacked into
its blocked layout reaches 400-480 GFLOP/s on the same shapes, and streams the batch-1 lm_head
3x faster (`benchmarks/gemm_backends.py`). So weights are packed once at load time, when oneDNN
is there; the plain weight is not kept (no extra memory), `weight` unpacks a copy on demand.

`LORASERVE_GEMM=mkl` forces the plain `torch.mm` path: for comparisons, and for CPUs where
oneDNN is not built in.
"""

from __future__ import annotations

import os

import torch

# oneDNN packs for a batch-size hint; 64 measured as fast as 2048 from 7 rows up, and as fast
# as 1 at batch 1 (benchmarks/gemm_backends.py).
_PACK_BATCH_HINT = 64


def gemm_backend() -> str:
    """'onednn' or 'mkl': read at weight-load time, so a process can compare both."""
    want = os.environ.get("LORASERVE_GEMM", "onednn").lower()
    if want not in ("onednn", "mkl"):
        raise ValueError(f"LORASERVE_GEMM must be 'onednn' or 'mkl', not {want!r}")
    if want == "onednn" and torch.backends.mkldnn.is_available():
        return "onednn"
    return "mkl"


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN; `weight` packed or plain `[d_out, d_in]` (a strided view
    too: no copy)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


class Linear:
    """A bias-free linear layer over a `[d_out, d_in]` weight (nn.Linear's orientation)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.backend = gemm_backend()
        if self.backend == "onednn":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().contiguous(), _PACK_BATCH_HINT)
            self._weight_t = None
        else:
            # [d_in, d_out]: MKL's NN GEMM streams weights faster than F.linear's NT at batch 1.
            self._packed = None
            self._weight_t = weight.detach().t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, d_in] -> [T, d_out]
        if self._packed is not None:
            return onednn_linear(x, self._packed)
        return torch.mm(x, self._weight_t)

    @property
    def weight(self) -> torch.Tensor:
        """The `[d_out, d_in]` weight as a plain tensor (a copy when packed)."""
        if self._packed is not None:
            return self._packed.to_dense()
        return self._weight_t.t()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4
