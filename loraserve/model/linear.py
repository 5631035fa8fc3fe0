"""Dense projections `y = x @ W.T` on the fastest float32 GEMM (loraserve/ops/gemm.py).

Weights are packed once at load time when oneDNN is there; the plain weight is not kept (no
extra memory), `weight` unpacks a copy on demand.
"""

from __future__ import annotations

import torch

from loraserve.ops.gemm import gemm_backend, onednn_linear, pack_weight


class Linear:
    """A bias-free linear layer over a `[d_out, d_in]` weight (nn.Linear's orientation)."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.backend = gemm_backend()
        if self.backend == "onednn":
            self._packed = pack_weight(weight)
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
